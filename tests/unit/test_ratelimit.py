"""Token buckets, the per-key limiter and RateLimitMiddleware, with a fake clock."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.responses import JSONResponse

from ember.edge.auth import ApiKeys, AuthMiddleware
from ember.edge.ratelimit import (
    RateLimited,
    RateLimiter,
    RateLimitMiddleware,
    TokenBucket,
)
from ember.errors import ConfigError

KEY_A = "ek-test-aaaaaaaaaaaaaaaaaaaaaaaa"
KEY_B = "ek-test-bbbbbbbbbbbbbbbbbbbbbbbb"


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_allows_a_burst_then_says_how_long_to_wait() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [None, None, None]
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)
    clock.now += 0.25
    assert bucket.take() is None
    assert bucket.take(clock.now) == pytest.approx(0.5)


def test_bucket_never_holds_more_than_its_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10.0, burst=2, clock=clock)
    clock.now += 3600
    assert [bucket.take() is None for _ in range(3)] == [True, True, False]


def test_bucket_survives_a_clock_stepping_back() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=1.0, burst=1, clock=clock)
    assert bucket.take() is None
    clock.now -= 50
    wait = bucket.take()
    assert wait is not None and 0 < wait <= 1.0
    clock.now += 51
    assert bucket.take() is None


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (math.nan, 1), (math.inf, 1),
                                             (1.0, 0), (1.0, -3)])
def test_nonsense_limits_are_refused(rate: float, burst: int) -> None:
    with pytest.raises(ConfigError):
        TokenBucket(rate, burst, FakeClock())
    with pytest.raises(ConfigError):
        RateLimiter(rate, burst, FakeClock())


def test_limiter_keeps_one_bucket_per_key() -> None:
    limiter = RateLimiter(rate_per_s=1.0, burst=1, clock=FakeClock())
    assert limiter.take("a") is None and limiter.take("b") is None
    assert limiter.take("a") == pytest.approx(1.0)
    assert limiter.take("b") == pytest.approx(1.0)


def test_limiter_is_bounded_and_evicts_the_least_recently_used() -> None:
    clock = FakeClock()
    limiter = RateLimiter(rate_per_s=1.0, burst=1, clock=clock, max_keys=2)
    limiter.take("a")
    limiter.take("b")
    limiter.take("a")  # "a" is now the most recently used
    limiter.take("c")  # evicts "b"
    assert len(limiter) == 2
    assert limiter.take("a") is not None  # still remembered, still in debt
    assert limiter.take("b") is None  # forgotten: a fresh bucket
    for n in range(10_000):
        limiter.take(f"addr:{n}")
    assert len(limiter) == 2


def test_limiter_from_env() -> None:
    assert RateLimiter.from_env({}) is None
    limiter = RateLimiter.from_env({"EMBER_RATE_LIMIT_RPS": "5"})
    assert limiter is not None and (limiter.rate_per_s, limiter.burst) == (5.0, 5)
    limiter = RateLimiter.from_env({"EMBER_RATE_LIMIT_RPS": "0.5"})
    assert limiter is not None and limiter.burst == 1
    limiter = RateLimiter.from_env({"EMBER_RATE_LIMIT_RPS": "2", "EMBER_RATE_LIMIT_BURST": "20"})
    assert limiter is not None and (limiter.rate_per_s, limiter.burst) == (2.0, 20)


@pytest.mark.parametrize("env", [
    {"EMBER_RATE_LIMIT_BURST": "10"},
    {"EMBER_RATE_LIMIT_RPS": "ten"},
    {"EMBER_RATE_LIMIT_RPS": "nan"},
    {"EMBER_RATE_LIMIT_RPS": "inf"},
    {"EMBER_RATE_LIMIT_RPS": "0"},
    {"EMBER_RATE_LIMIT_RPS": "5", "EMBER_RATE_LIMIT_BURST": "2.5"},
    {"EMBER_RATE_LIMIT_RPS": "5", "EMBER_RATE_LIMIT_BURST": "0"},
])
def test_limiter_from_env_refuses_bad_values(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"EMBER_RATE_LIMIT|rate limit"):
        RateLimiter.from_env(env)


def _app(limiter: RateLimiter | None, keys: ApiKeys) -> FastAPI:
    app = FastAPI()

    @app.get("/work")
    async def work() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app.add_middleware(RateLimitMiddleware, limiter=limiter)
    app.add_middleware(AuthMiddleware, keys=keys)
    return app


async def _gets(app: Any, n: int, path: str = "/work", key: str | None = None,
                client: tuple[str, int] = ("10.0.0.1", 1234),
                **headers: str) -> list[httpx.Response]:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        return [await http.get(path, headers=headers) for _ in range(n)]


def test_429_with_retry_after_then_recovery_per_key() -> None:
    clock = FakeClock()
    app = _app(RateLimiter(rate_per_s=1.0, burst=2, clock=clock), ApiKeys([KEY_A, KEY_B]))
    replies = asyncio.run(_gets(app, 3, key=KEY_A))
    assert [r.status_code for r in replies] == [200, 200, 429]
    refused = replies[-1]
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "RateLimited" and error["status"] == 429 and error["request_id"]
    assert KEY_A not in refused.text
    # Another key has its own bucket.
    assert asyncio.run(_gets(app, 1, key=KEY_B))[0].status_code == 200
    clock.now += 1.0
    assert [r.status_code for r in asyncio.run(_gets(app, 2, key=KEY_A))] == [200, 429]


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    clock = FakeClock()
    app = _app(RateLimiter(rate_per_s=0.25, burst=1, clock=clock), ApiKeys([KEY_A]))
    assert [r.status_code for r in asyncio.run(_gets(app, 2, key=KEY_A))] == [200, 429]
    assert asyncio.run(_gets(app, 1, key=KEY_A))[0].headers["retry-after"] == "4"
    clock.now += 1.5  # 2.5 s left
    assert asyncio.run(_gets(app, 1, key=KEY_A))[0].headers["retry-after"] == "3"
    clock.now += 2.4  # 0.1 s left: still at least 1
    assert asyncio.run(_gets(app, 1, key=KEY_A))[0].headers["retry-after"] == "1"


def test_without_auth_buckets_are_per_client_address_not_forwarded_for() -> None:
    app = _app(RateLimiter(rate_per_s=1.0, burst=1, clock=FakeClock()), ApiKeys([]))
    first = asyncio.run(_gets(app, 2, client=("10.0.0.1", 1)))
    assert [r.status_code for r in first] == [200, 429]
    assert asyncio.run(_gets(app, 1, client=("10.0.0.2", 1)))[0].status_code == 200
    spoofed = asyncio.run(_gets(app, 1, client=("10.0.0.1", 2), **{"X-Forwarded-For": "9.9.9.9"}))
    assert spoofed[0].status_code == 429


def test_probes_are_never_limited_and_limits_off_passes_through() -> None:
    app = _app(RateLimiter(rate_per_s=1.0, burst=1, clock=FakeClock()), ApiKeys([]))
    assert {r.status_code for r in asyncio.run(_gets(app, 5, path="/healthz"))} == {200}
    unlimited = _app(None, ApiKeys([]))
    assert {r.status_code for r in asyncio.run(_gets(unlimited, 50))} == {200}


def test_rate_limited_error_fields() -> None:
    err = RateLimited(rate_per_s=2.5, burst=5, retry_after_s=3)
    assert err.status_code == 429 and err.headers() == {"Retry-After": "3"}
    assert str(err) == "rate limit of 2.5 requests/s (burst 5) exceeded; retry after 3 s"
