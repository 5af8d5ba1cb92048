"""API keys and AuthMiddleware, in-process through httpx.ASGITransport; no cluster."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ember.edge._asgi import GuardMiddleware
from ember.edge._strict_json import ContentEncodingMiddleware, HeaderLimitMiddleware
from ember.edge.auth import ApiKeys, AuthMiddleware, Unauthorized, bearer_token, key_id
from ember.edge.ratelimit import RateLimitMiddleware
from ember.errors import ConfigError

KEY = "ek-live-7f3a9c2e5b8d4f1a6c0e9b2d"
OTHER_KEY = "ek-live-0b1c2d3e4f5a6b7c8d9e0f1a"
WRONG = "ek-live-WRONG-9c2e5b8d4f1a6c0e9b2d"
OPEN = ("/healthz", "/readyz")


def _platform_app() -> FastAPI:
    """The ingress's route set: a deployment, its extra route, platform and admin routes."""
    app = FastAPI(title="toy")

    @app.post("/embed")
    async def embed(request: Request) -> JSONResponse:
        return JSONResponse({"key_id": request.scope["state"].get("api_key_id")})

    @app.get("/embed/info")
    async def info() -> dict[str, str]:
        return {"model": "toy"}

    async def plain() -> Response:
        return JSONResponse({"ok": True})

    for path in ("/healthz", "/readyz", "/metrics", "/-/status"):
        app.add_api_route(path, plain, methods=["GET"], include_in_schema=False)
    return app


def _client(app: Any, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, **kwargs),
                             base_url="http://test")


def _guarded(app: FastAPI, keys: ApiKeys) -> FastAPI:
    """The order the ingress installs: the last added is outermost."""
    app.add_middleware(GuardMiddleware, limit_for=lambda scope: 64,
                       on_reject=lambda path, reason: None)
    app.add_middleware(ContentEncodingMiddleware)
    app.add_middleware(RateLimitMiddleware, limiter=None)
    app.add_middleware(AuthMiddleware, keys=keys)
    app.add_middleware(HeaderLimitMiddleware)
    return app


def _routes(app: FastAPI) -> Iterator[tuple[str, str]]:
    """Every (method, path) the app serves, docs and schema included."""
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    yield method, route.path


async def _walk(app: FastAPI, headers: dict[str, str]) -> dict[tuple[str, str], int]:
    statuses = {}
    async with _client(app) as client:
        for method, path in [*_routes(app), ("GET", "/no-such-route"), ("POST", "/-/nope")]:
            reply = await client.request(method, path, headers=headers,
                                         json={} if method == "POST" else None)
            statuses[(method, path)] = reply.status_code
    return statuses


def test_every_route_but_the_probes_needs_a_key() -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY], admin_loopback=True))
    paths = {path for _, path in _routes(app)}
    assert {"/docs", "/redoc", "/openapi.json", "/metrics", "/-/status", "/embed"} <= paths
    without = asyncio.run(_walk(app, {}))
    with_key = asyncio.run(_walk(app, {"Authorization": f"Bearer {KEY}"}))
    for (method, path), status in without.items():
        assert status == (200 if path in OPEN else 401), (method, path)
    for (method, path), status in with_key.items():
        expected = 404 if path in ("/no-such-route", "/-/nope") else 200
        assert status == expected, (method, path)


async def _get(app: Any, path: str = "/embed/info", **headers: str) -> httpx.Response:
    async with _client(app) as client:
        return await client.get(path, headers=headers)


@pytest.mark.parametrize("authorization", [
    f"Bearer {WRONG}",
    "Bearer ",
    "Bearer",
    f"Basic {KEY}",
    f"Token {KEY}",
    f"Bearer {KEY}x",
    f"Bearer {KEY[:-1]}",
    f"Bearer {KEY} {KEY}",
    KEY,
    "",
])
def test_bad_credentials_are_refused_in_ember_shape(authorization: str) -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY]))
    reply = asyncio.run(_get(app, Authorization=authorization))
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    error = reply.json()["error"]
    assert error["type"] == "Unauthorized" and error["status"] == 401
    assert error["request_id"] == reply.headers["x-request-id"]


def test_scheme_is_case_insensitive_and_any_configured_key_works() -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY, OTHER_KEY]))
    assert asyncio.run(_get(app, Authorization=f"bearer {KEY}")).status_code == 200
    assert asyncio.run(_get(app, Authorization=f"BEARER  {OTHER_KEY} ")).status_code == 200


def test_two_authorization_headers_are_refused() -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY]))

    async def go() -> int:
        async with _client(app) as client:
            headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {WRONG}")]
            return (await client.get("/embed/info", headers=headers)).status_code

    assert asyncio.run(go()) == 401


def test_key_id_reaches_the_route_and_is_not_the_key() -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY]))

    async def go() -> httpx.Response:
        async with _client(app) as client:
            return await client.post("/embed", json={}, headers={"Authorization": f"Bearer {KEY}"})

    kid = asyncio.run(go()).json()["key_id"]
    assert kid == key_id(KEY) and len(kid) == 12 and kid not in KEY


async def _raw(app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """Call an ASGI app with a hand-built scope (httpx would normalise the path)."""
    scope: Scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                    "query_string": b"", "headers": headers, "client": ("1.2.3.4", 5),
                    "server": ("test", 80), "scheme": "http", "http_version": "1.1",
                    "root_path": "", "asgi": {"version": "3.0"}}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return int(sent[0]["status"])


@pytest.mark.parametrize("path", ["/healthz/../metrics", "//healthz", "/healthz/", "/HEALTHZ",
                                  "/healthz\x00", "/readyz/x"])
def test_open_paths_match_exactly(path: str) -> None:
    app = _guarded(_platform_app(), ApiKeys([KEY]))
    assert asyncio.run(_raw(app, path, [])) == 401


def test_no_keys_means_auth_off() -> None:
    app = _guarded(_platform_app(), ApiKeys(["", "  "]))
    assert asyncio.run(_get(app)).status_code == 200


def test_lifespan_passes_and_a_websocket_is_closed_before_the_app() -> None:
    seen: list[str] = []
    sent: list[Message] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def nothing() -> Message:
        return {}

    async def keep(message: Message) -> None:
        sent.append(message)

    middleware = AuthMiddleware(inner, ApiKeys([KEY]))
    asyncio.run(middleware({"type": "lifespan"}, nothing, keep))
    headers = [(b"authorization", f"Bearer {KEY}".encode())]  # even with a valid key
    asyncio.run(middleware({"type": "websocket", "path": "/x", "headers": headers},
                           nothing, keep))
    assert seen == ["lifespan"]
    assert sent == [{"type": "websocket.close", "code": 1008}]


def test_unauthenticated_body_is_never_read() -> None:
    """Auth runs outside the guard: a caller without a key cannot make us buffer a body."""
    app = _guarded(_platform_app(), ApiKeys([KEY]))
    read = 0

    async def body() -> Any:
        nonlocal read
        for _ in range(100):
            read += 1
            yield b"x" * 1024

    async def go() -> httpx.Response:
        async with _client(app) as client:
            return await client.post("/embed", content=body())

    assert asyncio.run(go()).status_code == 401
    assert read <= 1  # httpx may pull the first chunk before the app answers


def test_keys_appear_in_no_body_header_log_or_repr(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    keys = ApiKeys([KEY, OTHER_KEY])
    app = _guarded(_platform_app(), keys)
    replies = [asyncio.run(_get(app, Authorization=f"Bearer {token}"))
               for token in (KEY, WRONG, OTHER_KEY[:-1], "")]
    assert [r.status_code for r in replies] == [200, 401, 401, 401]
    seen = " ".join([caplog.text, repr(keys), str(keys.ids)]
                    + [r.text + str(r.headers) for r in replies]
                    + [str(rec.args) for rec in caplog.records])
    for secret in (KEY, OTHER_KEY, WRONG, OTHER_KEY[:-1], KEY[8:24]):
        assert secret not in seen


def test_every_key_is_compared_without_early_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys([KEY, OTHER_KEY, "ek-live-third-key-0123456789"])
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return bool(real(a, b))

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert keys.match(KEY) == key_id(KEY)
    assert keys.match("short") is None
    # Three comparisons each time, all of equal-length digests whatever the token's length.
    assert calls == [64] * 6


def test_from_env_reads_the_list_and_the_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rotated 2024-05\n{OTHER_KEY}  # ci\n\n   \n{KEY}\n")
    keys = ApiKeys.from_env({"EMBER_API_KEYS": f" {KEY} ,, ", "EMBER_API_KEYS_FILE": str(key_file)})
    assert keys.enabled and set(keys.ids) == {key_id(KEY), key_id(OTHER_KEY)}
    assert not ApiKeys.from_env({}).enabled
    assert not ApiKeys.from_env({"EMBER_API_KEYS": ""}).enabled


def test_from_env_fails_closed_on_a_bad_key_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="holds no key"):
        ApiKeys.from_env({"EMBER_API_KEYS_FILE": str(empty)})
    with pytest.raises(ConfigError, match="cannot be read"):
        ApiKeys.from_env({"EMBER_API_KEYS_FILE": str(tmp_path / "missing")})


def test_unsendable_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as info:
        ApiKeys([KEY, "ek live zq8Xw-with-a-space"])
    assert "#2" in str(info.value) and "zq8Xw" not in str(info.value)


def test_short_key_warns_without_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    ApiKeys(["abc123"])
    assert "shorter than" in caplog.text and "abc123" not in caplog.text
    assert key_id("abc123") not in caplog.text


def test_bearer_token_parsing() -> None:
    def scope(*values: bytes) -> Scope:
        return {"headers": [(b"authorization", v) for v in values]}

    assert bearer_token(scope(b"Bearer abc")) == "abc"
    assert bearer_token(scope(b"  bearer   abc  ")) == "abc"
    assert bearer_token(scope()) is None
    assert bearer_token(scope(b"Bearer")) is None
    assert bearer_token(scope(b"Basic abc")) is None
    assert Unauthorized().status_code == 401
