"""HTTP plumbing of the ingress: request ids, body limits, and error responses.

``GuardMiddleware`` is a pure ASGI middleware (no Starlette ``BaseHTTPMiddleware``, which
buffers and breaks streaming). It assigns a request id, and for every request, whatever its
method, it reads at most ``limit + 1`` bytes before answering 413, whether or not the client
sent Content-Length, so an oversized upload is refused without being read whole. The limit
is the route's (the ingress looks the path up first: admin and unknown paths get a small
one), and the whole body must arrive within a deadline (408), so a client that trickles a
body cannot hold a connection and its buffer open for ever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.errors import (
    BodyTimeout,
    EmberError,
    InvalidBody,
    MalformedJSON,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    StatusError,
)

logger = logging.getLogger("ember.ingress")

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

LimitLookup = Callable[[Scope], int]
RejectHook = Callable[[str, str], None]


async def send_error(err: EmberError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer with Ember's error shape from a middleware that runs before the guard's ids.

    Uses the same request id the guard middleware would: Ray Serve's, else a well-formed
    incoming ``X-Request-Id``, else a fresh one.
    """
    serve_id = _serve_request_id()
    request_id = (scope.get("state", {}).get("request_id") or serve_id
                  or _incoming_request_id(scope) or uuid.uuid4().hex)
    response = error_response(err, str(request_id))
    if serve_id is None:  # behind Ray Serve's proxy, it already sends X-Request-Id
        response.headers["x-request-id"] = str(request_id)
    await response(scope, receive, send)


def request_id_of(request: Request) -> str:
    """The id the guard middleware gave this request."""
    return str(request.scope.get("state", {}).get("request_id", "-"))


def error_body(err: EmberError, request_id: str, **extra: Any) -> dict[str, Any]:
    """The JSON body of every Ember error response."""
    # "message", "type", "param" and "code" are OpenAI's error fields, so OpenAI clients
    # pointed at Ember raise their usual exceptions with Ember's message.
    return {
        "error": {
            "message": str(err),
            "type": type(err).__name__,
            "param": extra.pop("param", err.fields.get("param")),
            "code": err.status_code,
            "status": err.status_code,
            "request_id": request_id,
            **extra,
        }
    }


def error_response(err: EmberError, request_id: str, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(err, request_id, **extra), err.status_code, err.headers())


#: Headers the response to the request being answered must carry, for routes whose handlers
#: return only a value (protocol adapters) and for errors raised after the choice was made;
#: :class:`ColdStartHeaderMiddleware` sends them.
_NOTED: ContextVar[dict[str, str] | None] = ContextVar("ember_noted_headers", default=None)
COLD_START_HEADER = "X-Ember-Cold-Start"


def note_header(name: str, value: str) -> None:
    """Have this request's response carry ``name: value`` (the first value noted wins)."""
    box = _NOTED.get()
    if box is not None:
        box.setdefault(name, value)


def note_cold_start(header_value: str) -> None:
    """Record that this request met a cold start; its response will carry the header."""
    note_header(COLD_START_HEADER, header_value)


def note_adapter_load(seconds: float) -> None:
    """Add a cold LoRA adapter load (``adapter=<ms>``) to this request's cold-start header:
    after the replica's phases if the replica was cold too, else as the only phase."""
    box = _NOTED.get()
    if box is None:
        return
    ms = f"{seconds * 1000:.0f}"
    before = box.get(COLD_START_HEADER)
    box[COLD_START_HEADER] = (f"{before};adapter={ms}" if before is not None
                              else f"total={ms};path=adapter;adapter={ms}")


class ColdStartHeaderMiddleware:
    """Add the noted headers (``X-Ember-Cold-Start``, ``X-Ember-Version``) to a response.

    Native routes set the cold-start header themselves; protocol routes (OpenAI, Open
    Inference) call deployments through the gateway, which notes the report here, and a
    version is noted before the call, so an error response names it too. Pure ASGI: one
    context variable per request and a look at the response's first message, nothing
    buffered.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        box: dict[str, str] = {}
        token = _NOTED.set(box)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and box:
                headers = list(message.get("headers", []))
                present = {key.lower() for key, _ in headers}
                headers += [(name.lower().encode(), value.encode("latin-1"))
                            for name, value in box.items()
                            if name.lower().encode() not in present]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _NOTED.reset(token)


class GuardMiddleware:
    """Request ids and body-size limits, before any route code runs."""

    def __init__(self, app: ASGIApp, *, limit_for: LimitLookup, on_reject: RejectHook,
                 body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.limit_for = limit_for
        self.on_reject = on_reject
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        serve_id = _serve_request_id()
        request_id = serve_id or _incoming_request_id(scope) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        if serve_id is None:  # behind Ray Serve's proxy, it already sends X-Request-Id
            send = _with_request_id(send, request_id)
        # Every method: a DELETE (or a GET) may carry a body too, and must not be read whole.
        limit = self.limit_for(scope)
        err: EmberError | None = None
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _read_limited(scope, receive, limit)
        except TimeoutError:
            body, err = None, BodyTimeout(timeout_s=self.body_timeout_s)
            self.on_reject(scope["path"], "body_timeout")
        if body is None:
            if err is None:
                self.on_reject(scope["path"], "too_large")
                err = PayloadTooLarge(limit=limit, path=scope["path"])
            response = error_response(err, request_id)
            response.headers["connection"] = "close"  # the rest of the body is not read
            await response(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)


async def _read_limited(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it is known to exceed ``limit``."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                if int(value) > limit:
                    return None
            except ValueError:
                return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the client to disconnect

    return replay


def _serve_request_id() -> str | None:
    """The id Ray Serve's proxy gave this request, when running inside a replica."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # outside a Serve replica (unit tests), or a Ray without the context
        return None


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if _REQUEST_ID_RE.match(text) else None
    return None


def _with_request_id(send: Send, request_id: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
            headers.append((b"x-request-id", request_id.encode()))
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


def install_error_handlers(app: FastAPI, on_reject: RejectHook) -> None:
    """Map every failure to Ember's error shape and the right status code."""

    async def ember_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(cast(EmberError, exc), request_id_of(request))

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        return _validation_response(request, cast(RequestValidationError, exc), on_reject)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        status = cast(StarletteHTTPException, exc).status_code
        err: EmberError
        if status == 404:
            err = NotFound(method=request.method, path=request.url.path)
        elif status == 405:
            err = MethodNotAllowed(method=request.method, path=request.url.path)
        else:
            err = StatusError(str(cast(StarletteHTTPException, exc).detail))
            err.status_code = status  # type: ignore[misc]
        return error_response(err, request_id_of(request))

    app.add_exception_handler(EmberError, ember_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _validation_response(
    request: Request, exc: RequestValidationError, on_reject: RejectHook
) -> JSONResponse:
    errors = exc.errors()
    malformed = any(e.get("type") == "json_invalid" for e in errors)
    fields = [
        {"field": ".".join(str(p) for p in e.get("loc", ())), "message": str(e.get("msg", ""))}
        for e in errors
    ]
    on_reject(request.url.path, "malformed_json" if malformed else "invalid_body")
    summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields[:5])
    err: EmberError = MalformedJSON(summary) if malformed else InvalidBody(summary)
    fields = json.loads(json.dumps(fields, default=str))
    body = error_body(err, request_id_of(request), fields=fields)
    return JSONResponse(body, err.status_code)

