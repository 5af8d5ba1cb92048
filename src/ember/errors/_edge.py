"""Errors of the HTTP edge: who may call, how fast, and what a request may look like."""

from __future__ import annotations

from ember.errors._base import EmberError, MalformedJSON, RequestError


class Unauthorized(RequestError):
    """The request carries no valid ``Authorization: Bearer <key>``."""

    status_code = 401
    template = "{detail}"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(RequestError):
    """A valid caller asking for what its key (or its address) may not do."""

    status_code = 403
    template = "{detail}"


class JSONTooDeep(MalformedJSON):
    """Arrays and objects nested deeper than the parser allows."""

    template = "malformed JSON: nesting deeper than {max_depth} levels"


class UnsupportedMediaType(RequestError):
    """A request body in a content coding Ember does not accept (anything but identity)."""

    status_code = 415
    template = "Content-Encoding {encoding} is not accepted; send the body uncompressed"

    def headers(self) -> dict[str, str]:
        # RFC 7694: a 415 for a content coding names the codings the server accepts.
        return {"Accept-Encoding": "identity"}


class HeadersTooLarge(RequestError):
    """The request's header block is over the limit."""

    status_code = 431
    template = "request headers total {size} bytes, over the limit of {limit} bytes"


class RateLimited(RequestError):
    """The caller's key (or address) is over its request rate."""

    status_code = 429
    template = (
        "rate limit of {rate_per_s:g} requests/s (burst {burst}) exceeded; "
        "retry after {retry_after_s} s"
    )

    def __init__(self, *, rate_per_s: float, burst: int, retry_after_s: int) -> None:
        super().__init__(rate_per_s=rate_per_s, burst=burst, retry_after_s=retry_after_s)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class StatusError(EmberError):
    """Carries a status chosen by Starlette (405 and the like) into Ember's error shape."""
