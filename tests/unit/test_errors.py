"""The exception hierarchy and its HTTP mapping, through the ingress app in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from ember import errors
from ember.edge._asgi import GuardMiddleware, install_error_handlers


def test_errors_carry_status_and_keyword_messages() -> None:
    err = errors.QueueFull(deployment="mlp", queued=64, limit=64)
    assert err.status_code == 503
    assert str(err) == "deployment 'mlp' has 64 queued requests (limit 64); retry shortly"
    assert err.headers() == {"Retry-After": "1"}
    assert errors.PayloadTooLarge(limit=10, path="/x").status_code == 413
    assert errors.RequestTimeout(deployment="d", timeout_s=2).status_code == 504
    assert issubclass(errors.MalformedJSON, errors.RequestError)
    assert issubclass(errors.ConfigError, ValueError)


@pytest.mark.parametrize("cls", [c for c in vars(errors).values()
                                 if isinstance(c, type) and issubclass(c, errors.EmberError)])
def test_every_error_has_an_http_status(cls: type[errors.EmberError]) -> None:
    assert 400 <= cls.status_code < 600


def _app() -> FastAPI:
    rejected: list[tuple[str, str]] = []
    app = FastAPI()
    install_error_handlers(app, lambda path, reason: rejected.append((path, reason)))
    app.state.rejected = rejected

    @app.post("/boom")
    async def boom() -> JSONResponse:
        raise errors.QueueFull(deployment="d", queued=3, limit=3)

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"n": len(await request.body())})

    app.add_middleware(GuardMiddleware, limit_for=lambda path: 16,
                       on_reject=lambda path, reason: rejected.append((path, reason)))
    return app


async def _call(method: str, path: str, **kwargs: object) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()),
                                 base_url="http://test") as client:
        return await client.request(method, path, **kwargs)  # type: ignore[arg-type]


def test_ember_error_maps_to_status_and_shape() -> None:
    reply = asyncio.run(_call("POST", "/boom"))
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    body = reply.json()["error"]
    assert body["type"] == "QueueFull" and body["status"] == 503 and body["request_id"]


def test_guard_refuses_declared_and_streamed_oversize_bodies() -> None:
    assert asyncio.run(_call("POST", "/boom", content=b"x" * 17)).status_code == 413

    async def stream() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"abcd"

    reply = asyncio.run(_call("POST", "/boom", content=stream()))
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "PayloadTooLarge"


def test_body_within_limit_reaches_the_route() -> None:
    reply = asyncio.run(_call("POST", "/echo", content=b"x" * 16))
    assert reply.status_code == 200 and reply.json() == {"n": 16}
    assert reply.headers["x-request-id"]


def test_unknown_path_is_404_in_ember_shape() -> None:
    reply = asyncio.run(_call("GET", "/missing"))
    assert reply.status_code == 404
    assert reply.json()["error"]["type"] == "NotFound"
