"""The root of the tree and the errors every part raises (see :mod:`ember.errors`)."""

from __future__ import annotations

from typing import Any, ClassVar


class EmberError(Exception):
    """Base of every Ember error; ``status_code`` is what HTTP callers receive."""

    status_code: ClassVar[int] = 500
    #: ``str.format`` template filled from the keyword fields given to the constructor.
    template: ClassVar[str] = "{detail}"

    def __init__(self, detail: str = "", **fields: Any) -> None:
        self.fields: dict[str, Any] = {"detail": detail, **fields}
        try:
            message = self.template.format(**self.fields)
        except (KeyError, IndexError):
            message = detail or self.__class__.__name__
        super().__init__(message)

    @property
    def message(self) -> str:
        """The human-readable message (same as ``str(err)``)."""
        return str(self)

    def headers(self) -> dict[str, str]:
        """Extra response headers the ingress sends with this error."""
        return {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors cross process boundaries (a replica raises, the edge answers). Exception's
        # default pickling calls cls(message), which would template the message twice and
        # fails for classes with keyword-only fields; rebuild from the message and fields.
        return (_restore, (type(self), str(self)), dict(self.__dict__))


def _restore(cls: type[EmberError], message: str) -> EmberError:
    """Unpickle an Ember error without running its constructor (see ``__reduce__``)."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    return err


class ConfigError(EmberError, ValueError):
    """A deployment or application is wired wrongly; raised when it is declared."""


class RayInternalsChanged(ConfigError):
    """The installed Ray lacks a private part Ember needs to keep its doors and policies."""

    template = ("the installed Ray differs from the versions Ember was tested with (2.60); "
                "refusing to start: {reasons}")

    def __init__(self, problems: list[str]) -> None:
        super().__init__(reasons="; ".join(problems))
        self.problems = problems


class RequestError(EmberError):
    """The request is at fault; the server state is untouched."""

    status_code = 400


class BadRequest(RequestError):
    status_code = 400


class MalformedJSON(BadRequest):
    status_code = 400
    template = "malformed JSON: {detail}"


class MethodNotAllowed(RequestError):
    status_code = 405
    template = "{method} is not allowed on {path}"


class NotFound(RequestError):
    status_code = 404
    template = "no route for {method} {path}"


class ModelNotFound(NotFound):
    """OpenAI's ``model_not_found``: the request named a model or adapter not served here."""

    template = "The model '{model}' does not exist"


class Conflict(RequestError):
    """The request fits, but not the state it meets (a rollout already running, say)."""

    status_code = 409


class BodyTimeout(RequestError):
    status_code = 408
    template = "request body not received within {timeout_s:g}s; send it whole, faster"


class PayloadTooLarge(RequestError):
    status_code = 413
    template = "request body exceeds {limit} bytes for {path}"


class InvalidBody(RequestError):
    status_code = 422
    template = "invalid body: {detail}"


class ServiceError(EmberError):
    """The server cannot serve this request now; the caller may retry."""

    status_code = 503


class QueueFull(ServiceError):
    status_code = 503
    template = (
        "deployment '{deployment}' has {queued} queued requests (limit {limit}); retry shortly"
    )

    def __init__(self, *, deployment: str, queued: int, limit: int, retry_after_s: int = 1) -> None:
        super().__init__(deployment=deployment, queued=queued, limit=limit)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class DeploymentUnavailable(ServiceError):
    status_code = 503
    template = "deployment '{deployment}' is unavailable: {detail}"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class WaitingForResources(DeploymentUnavailable):
    """No node has room for the deployment's replica, and nothing else can serve it."""

    template = "deployment '{deployment}' is {detail}"

    def headers(self) -> dict[str, str]:
        # Resources free up when other replicas scale down (seconds) or a node joins.
        return {"Retry-After": "5"}


class ShuttingDown(ServiceError):
    """The server is draining before it stops: another instance should take the request."""

    status_code = 503
    template = "the server is shutting down; retry on another instance"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class UserCodeError(ServiceError):
    status_code = 500
    template = "deployment '{deployment}' raised {error_type}; request id {request_id}"


class RequestTimeout(ServiceError):
    status_code = 504
    template = (
        "deployment '{deployment}' did not answer within {timeout_s} s; the work was cancelled"
    )


class DeadlineExceeded(RequestTimeout):
    """The caller's own deadline (``X-Ember-Timeout-S``) passed: the request was dropped
    while it waited (nothing computed) or stopped while it ran (its slot freed)."""

    template = "the request's deadline of {timeout_s} s (X-Ember-Timeout-S) passed {when}"


class WeightsError(EmberError):
    """Weights that are unsafe, malformed, changed underneath us, or unreachable."""

    status_code = 503
