"""Per-key rate limits: a token bucket per API key (or per client address without auth).

Off unless ``EMBER_RATE_LIMIT_RPS`` is set; ``EMBER_RATE_LIMIT_BURST`` (default: the rate,
rounded up) is how many requests may arrive at once. The bucket is a pure class with an
injected clock, so tests drive time by hand. Limits are per ingress replica: with N ingress
replicas a key gets up to N times the rate::

    RequestError (400)                 ember.errors
    └── RateLimited (429)              over the key's rate; retry after Retry-After seconds

Example:
    >>> now = [0.0]
    >>> bucket = TokenBucket(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    >>> bucket.take(), bucket.take(), bucket.take()
    (None, None, 1.0)
    >>> now[0] = 1.0
    >>> bucket.take() is None
    True
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from ember import settings
from ember.edge._asgi import RejectHook, send_error
from ember.edge.auth import KEY_ID_STATE, OPEN_PATHS
from ember.errors import ConfigError, RateLimited

logger = logging.getLogger("ember.ratelimit")

RPS_ENV = settings.variable("rate_limit_rps")
BURST_ENV = settings.variable("rate_limit_burst")
DEFAULT_MAX_KEYS = 10_000

Clock = Callable[[], float]
_N = TypeVar("_N", int, float)


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; each request takes one.

    Args:
        rate_per_s: sustained requests per second (> 0).
        burst: bucket size, i.e. requests allowed at once (>= 1).
        clock: monotonic seconds; ``time.monotonic`` in production, a fake in tests.

    Raises:
        ConfigError: a rate or burst that is not a positive finite number.
    """

    def __init__(self, rate_per_s: float, burst: int, clock: Clock = time.monotonic) -> None:
        _check_limits(rate_per_s, burst)
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._updated = clock()

    def take(self, now: float | None = None) -> float | None:
        """Take one token: None when allowed, else the seconds until one is available."""
        now = self.clock() if now is None else now
        # max(): a clock that steps back must not drain the bucket.
        elapsed = max(0.0, now - self._updated)
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate_per_s)
        self._updated = max(self._updated, now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) / self.rate_per_s


class RateLimiter:
    """One token bucket per key, at most ``max_keys`` of them, least recently used evicted.

    Evicting a bucket forgets its debt, so the least recently used goes first: it has been
    idle longest and is most likely full again, in which case forgetting it changes nothing.

    Args:
        rate_per_s: sustained requests per second per key.
        burst: requests per key allowed at once.
        clock: monotonic seconds.
        max_keys: buckets kept; bounds memory whatever number of keys or addresses call.

    Example:
        >>> limiter = RateLimiter(rate_per_s=1.0, burst=1, clock=lambda: 0.0)
        >>> limiter.take("a"), limiter.take("b"), limiter.take("a")
        (None, None, 1.0)
    """

    def __init__(self, rate_per_s: float, burst: int, clock: Clock = time.monotonic,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        _check_limits(rate_per_s, burst)
        if max_keys < 1:
            raise ConfigError(f"max_keys must be at least 1, got {max_keys}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 clock: Clock = time.monotonic) -> RateLimiter | None:
        """The limiter ``EMBER_RATE_LIMIT_RPS``/``_BURST`` describe, or None when off.

        Raises:
            ConfigError: a value is not a positive number, or a burst is given without a rate.
        """
        config = settings.load(environ)
        rate, burst = config.rate_limit_rps, config.rate_limit_burst
        if rate is None:
            if burst is not None:
                raise ConfigError(f"{BURST_ENV} is set but {RPS_ENV} is not; set both, "
                                  f"e.g. {RPS_ENV}=10 {BURST_ENV}=20")
            return None
        return cls(rate, burst if burst is not None else math.ceil(rate), clock)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float | None:
        """Take one token from ``key``'s bucket: None when allowed, else seconds to wait."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate_per_s, self.burst, self.clock)
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)


def _check_limits(rate_per_s: float, burst: int) -> None:
    """Refuse rates and bursts that would make a bucket that never (or always) refills."""
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ConfigError(f"rate limit must be a positive number of requests/s, "
                          f"got {rate_per_s!r}")
    if burst < 1:
        raise ConfigError(f"rate limit burst must be at least 1 request, got {burst!r}")


def _parse_number(name: str, raw: str, kind: Callable[[str], _N]) -> _N:
    """``kind(raw)``, with a message that names the variable when it is not a number."""
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; e.g. {name}=10") from None


def client_key(scope: Scope) -> str:
    """The bucket key: the API key id auth left in the scope, else the client address.

    Forwarded-for headers are not trusted (any caller can send one), so behind a proxy
    without auth every caller shares the proxy's bucket.
    """
    kid = scope.get("state", {}).get(KEY_ID_STATE)
    if kid:
        return f"key:{kid}"
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:-"


class RateLimitMiddleware:
    """Answer 429 with ``Retry-After`` when the caller's bucket is empty.

    Install it inside ``AuthMiddleware`` so buckets are per key. Pass-through when
    ``limiter`` is None (limits off), for non-HTTP scopes, and for ``exempt_paths``
    (health probes must never be throttled into looking unhealthy).

    Args:
        app: the wrapped ASGI app.
        limiter: the per-key buckets, or None.
        exempt_paths: paths never limited.
        on_reject: called with ``(path, "rate_limited")`` for each refusal (metrics).
    """

    def __init__(self, app: ASGIApp, limiter: RateLimiter | None,
                 exempt_paths: Iterable[str] = OPEN_PATHS, *,
                 on_reject: RejectHook | None = None) -> None:
        self.app = app
        self.limiter = limiter
        self.exempt_paths = frozenset(exempt_paths)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limiter = self.limiter
        if scope["type"] != "http" or limiter is None or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        wait_s = limiter.take(client_key(scope))
        if wait_s is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(scope["path"], "rate_limited")
        # Whole seconds, rounded up (RFC 9110 delay-seconds); never 0, which invites a spin.
        retry_after_s = max(1, math.ceil(wait_s))
        err = RateLimited(rate_per_s=limiter.rate_per_s, burst=limiter.burst,
                          retry_after_s=retry_after_s)
        await send_error(err, scope, receive, send)


__all__ = [
    "RateLimitMiddleware",
    "RateLimited",
    "RateLimiter",
    "TokenBucket",
    "client_key",
]
