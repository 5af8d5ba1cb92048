"""API keys: bearer-token authentication for every route but the health probes.

Invoke auth is on when at least one invoke key is configured (``EMBER_API_KEYS``,
comma-separated, and/or ``EMBER_API_KEYS_FILE``, one key per line with ``#`` comments);
admin routes (``/-/``) always need an admin key (``EMBER_ADMIN_KEYS``) unless the operator
opts in by name (``EMBER_ADMIN_LOOPBACK=1``). ``AuthMiddleware`` is a pure
ASGI middleware that answers 401 before any route, docs page or body read happens, so an
unauthenticated caller learns nothing about which routes exist, not even from a 404.

Keys are held only as SHA-256 digests and compared with ``hmac.compare_digest`` against
every configured key, so neither the matching key's position nor the presented token's
length shows in the timing. Neither keys nor presented tokens are ever logged or echoed;
the matched key is known downstream only by its id, a short SHA-256 prefix::

    Unauthorized (401, ember.errors)   no, malformed or unknown bearer token

Example:
    >>> keys = ApiKeys(["k-0123456789abcdef"])
    >>> keys.enabled, keys.match("k-0123456789abcdef") == key_id("k-0123456789abcdef")
    (True, True)
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from ember import settings
from ember.edge._asgi import RejectHook, send_error
from ember.errors import ConfigError, EmberError, Forbidden, Unauthorized

logger = logging.getLogger("ember.auth")

KEYS_ENV = settings.variable("api_keys")
KEYS_FILE_ENV = settings.variable("api_keys_file")
ADMIN_KEYS_ENV = settings.variable("admin_keys")
ADMIN_LOOPBACK_ENV = settings.variable("admin_loopback")
ALLOW_UNAUTHENTICATED_ENV = settings.variable("allow_unauthenticated")
#: Paths under this prefix are admin routes.
ADMIN_PREFIX = "/-/"
#: Where the matched key's id is left for later middlewares (the rate limiter).
KEY_ID_STATE = "api_key_id"
OPEN_PATHS: tuple[str, ...] = ("/healthz", "/readyz")
_KEY_ID_HEX = 12
_SHORT_KEY = 16

def key_id(key: str) -> str:
    """The id by which a key may be named in logs and metrics: a short SHA-256 prefix."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:_KEY_ID_HEX]


class ApiKeys:
    """The configured API keys, held as digests; ``enabled`` is False when there are none.

    Args:
        keys: the keys; surrounding whitespace is stripped and empty entries skipped.

    Raises:
        ConfigError: a key holds characters a bearer token cannot carry (the message names
            its position, never the key).

    Example:
        >>> ApiKeys([]).enabled
        False
    """

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = (), *,
                 admin_loopback: bool = False, allow_unauthenticated: bool = False) -> None:
        cleaned = [k.strip() for k in keys if k.strip()]
        admin = [k.strip() for k in admin_keys if k.strip()]
        for index, key in enumerate([*cleaned, *admin], start=1):
            _check_key(index, key)
        # A dict keeps one entry per distinct key, in order, so a key listed twice
        # is compared once.
        digests = {hashlib.sha256(k.encode()).digest(): key_id(k) for k in [*cleaned, *admin]}
        self._digests: tuple[tuple[bytes, str], ...] = tuple(digests.items())
        self._admin_ids = frozenset(key_id(k) for k in admin)
        self._invoke = bool(cleaned)
        #: The operator's opt-ins, by name: admin routes for loopback callers with no admin
        #: key, and an edge beyond loopback with no invoke key.
        self.admin_loopback = admin_loopback
        self.allow_unauthenticated = allow_unauthenticated

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ApiKeys:
        """Invoke keys from ``EMBER_API_KEYS`` and ``EMBER_API_KEYS_FILE``, admin keys from
        ``EMBER_ADMIN_KEYS`` (each is read if set).

        Raises:
            ConfigError: the key file cannot be read or holds no key; failing here, rather
                than serving with auth off, is what the operator who set it meant.
        """
        config = settings.load(environ)
        secret = config.api_keys.get_secret_value() if config.api_keys else ""
        keys = secret.split(",")
        path = config.api_keys_file
        if path is not None:
            from_file = _read_key_file(Path(path))
            if not from_file:
                raise ConfigError(f"{KEYS_FILE_ENV}={path} holds no key; add one key per line")
            keys.extend(from_file)
        admin = config.admin_keys.get_secret_value() if config.admin_keys else ""
        return cls(keys, admin.split(","), admin_loopback=config.admin_loopback,
                   allow_unauthenticated=config.allow_unauthenticated)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured."""
        return bool(self._digests)

    @property
    def invoke_enabled(self) -> bool:
        """Whether invoke keys are configured, i.e. whether invoke routes ask for a key."""
        return self._invoke

    @property
    def admin_enabled(self) -> bool:
        """Whether admin keys are configured (else admin routes are closed, or answer
        loopback callers with ``EMBER_ADMIN_LOOPBACK=1``)."""
        return bool(self._admin_ids)

    def is_admin(self, kid: str) -> bool:
        """Whether the key with id ``kid`` is an admin key."""
        return kid in self._admin_ids

    @property
    def ids(self) -> tuple[str, ...]:
        """The ids of the configured keys (safe to log)."""
        return tuple(kid for _, kid in self._digests)

    def match(self, token: str) -> str | None:
        """The id of the key equal to ``token``, else None; constant time in the token."""
        presented = hashlib.sha256(token.encode("utf-8")).digest()
        found: str | None = None
        # No early exit: every key is compared whether or not one already matched, and
        # digests have one length, so timing reveals neither which key nor how long a token.
        for digest, kid in self._digests:
            if hmac.compare_digest(presented, digest):
                found = kid
        return found

    def __repr__(self) -> str:
        return f"ApiKeys(ids={list(self.ids)!r})"


def _check_key(index: int, key: str) -> None:
    """Refuse keys a client could not send in a header; warn about short ones."""
    if not all("\x21" <= ch <= "\x7e" for ch in key):
        raise ConfigError(
            f"API key #{index} holds a space, control or non-ASCII character; "
            "use printable ASCII, e.g. the output of `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    if len(key) < _SHORT_KEY:
        # No id here: a short key's hash prefix would help someone guess it offline.
        logger.warning("API key #%d is shorter than %d characters; use 32 or more random "
                       "characters", index, _SHORT_KEY)


def _read_key_file(path: Path) -> list[str]:
    """Keys in ``path``: one per line; blank lines and ``#`` comments skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{KEYS_FILE_ENV}={path} cannot be read: {type(exc).__name__}") from exc
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def bearer_token(scope: Scope) -> str | None:
    """The token of the one ``Authorization: Bearer`` header, else None.

    Two Authorization headers are refused rather than one picked: a proxy and Ember could
    pick differently.
    """
    values: list[bytes] = [v for k, v in scope.get("headers", []) if k == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].decode("latin-1").strip().partition(" ")
    token = token.strip()
    # RFC 7235: the scheme name is case-insensitive.
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class AuthMiddleware:
    """Answer 401 unless ``Authorization: Bearer <key>`` names a key the route accepts.

    Invoke routes take any configured key (pass-through when no invoke key is configured).
    Admin routes (``/-/...``: status, warm leases, anything that changes what is served)
    take an admin key, and an invoke key gets 403 there. With no admin key configured they
    answer 403, unless ``EMBER_ADMIN_LOOPBACK=1`` opens them to loopback clients (still
    asking for an invoke key when invoke auth is on): a TLS proxy on the same host connects
    from loopback, so that opt-in is for local development only. WebSocket scopes are closed
    (1008); lifespan scopes and ``open_paths`` (exact matches, so ``/healthz/../metrics`` is
    not open) pass. On
    success the key's id is left in ``scope["state"]["api_key_id"]``.

    Args:
        app: the wrapped ASGI app.
        keys: the configured keys.
        open_paths: paths served without a key (load-balancer probes).
        on_reject: called with ``(path, "unauthorized" | "forbidden")`` per refusal (metrics).
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys, open_paths: Iterable[str] = OPEN_PATHS,
                 *, on_reject: RejectHook | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            # No route of the edge is a WebSocket, and none may pass unchecked should a
            # server ever accept the upgrade: refused before anything reads it.
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            if self.on_reject is not None:
                self.on_reject(scope["path"], "unauthorized" if refusal.status_code == 401
                               else "forbidden")
            await send_error(refusal, scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> EmberError | None:
        """Why this request may not pass, or None (its key id then left in the scope)."""
        admin = scope["path"].startswith(ADMIN_PREFIX)
        if admin and not self.keys.admin_enabled and not (
                self.keys.admin_loopback and _is_loopback(scope.get("client"))):
            return Forbidden(f"admin routes need an admin key: set {ADMIN_KEYS_ENV} on the "
                             f"server and send one ({ADMIN_LOOPBACK_ENV}=1 opens them to "
                             "loopback callers, for local development only)")
        if not (self.keys.invoke_enabled or (admin and self.keys.admin_enabled)):
            return None
        token = bearer_token(scope)
        kid = self.keys.match(token) if token is not None else None
        if kid is None:
            # Debug, not info: a flood of bad tokens must not flood the logs; the on_reject
            # hook counts them.
            logger.debug("refused %s %s: %s", scope["method"], scope["path"],
                         "no bearer token" if token is None else "unknown key")
            return Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>'")
        if admin and self.keys.admin_enabled and not self.keys.is_admin(kid):
            return Forbidden(f"an invoke key cannot call admin routes; send a key from "
                             f"{ADMIN_KEYS_ENV}")
        scope.setdefault("state", {})[KEY_ID_STATE] = kid
        return None


def check_exposure(host: str, keys: ApiKeys) -> None:
    """Refuse to listen beyond loopback with no invoke key unless the operator opted in.

    A missing or misspelt key Secret would otherwise serve every route to anyone who can
    reach the port.

    Raises:
        ConfigError: ``host`` is not a loopback address, no invoke key is configured and
            ``EMBER_ALLOW_UNAUTHENTICATED`` is not set.
    """
    if keys.invoke_enabled or keys.allow_unauthenticated or _is_loopback((host, 0)):
        return
    raise ConfigError(
        f"refusing to listen on {host} with no API key: anyone who reaches the port could "
        f"call every route. Set {KEYS_ENV} or {KEYS_FILE_ENV}, listen on 127.0.0.1, or set "
        f"{ALLOW_UNAUTHENTICATED_ENV}=1 if another layer guards the port")


def _is_loopback(client: Any) -> bool:
    """Whether an ASGI ``client`` (host, port) is this machine."""
    if not client:
        return False
    try:
        return ipaddress.ip_address(str(client[0])).is_loopback
    except ValueError:
        return str(client[0]) == "localhost"


__all__ = [
    "ApiKeys",
    "AuthMiddleware",
    "Unauthorized",
    "bearer_token",
    "check_exposure",
    "key_id",
]
