"""OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions`` over a streaming handler.

The target handler is an async generator taking a :class:`GenerateRequest` and yielding one
dict per step: ``text`` (may be empty), ``finish_reason`` (None until the last),
``prompt_tokens``, ``completion_tokens``, ``running`` and ``waiting`` (the engine's state,
for the gauges). With ``"stream": true`` the answer is server-sent events in OpenAI's chunk
shape ending with ``data: [DONE]``, and ``stream_options.include_usage`` adds a last chunk
with ``usage`` and no choices, as OpenAI does.

The first chunk is awaited before the response starts, so a refusal (a full engine, a
request that cannot fit, a deadline that passed while it waited) is a real status code with
``Retry-After``, not an error event inside a 200. ``X-Ember-Priority`` (an integer from -10
to 10, higher first, or ``batch``) and ``X-Ember-Timeout-S`` (seconds) reach the engine's
admission as the request's ``priority`` and ``timeout_s``; ``n`` choices stream with their
``index``. Time to first token, inter-token latency, time per output token and tokens
per second are measured here, at the edge: what the caller sees, queueing included.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ember.edge._asgi import error_body, note_adapter_load, request_id_of
from ember.edge.protocols import Gateway, Protocol
from ember.edge.protocols.openai_metrics import GenerationMetrics, RequestTiming
from ember.edge.protocols.openai_structured import (
    LegacyLogprobs,
    ResponseFormat,
    chat_logprobs,
    grammar_of,
)
from ember.errors import BadRequest, ConfigError, DeadlineExceeded, EmberError, InvalidBody

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ember.app.app import App



class ChatMessage(BaseModel):
    """One chat turn; only text content."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


#: Longest stop string a request may send: every generated token is checked against each.
MAX_STOP_CHARS = 256
#: Most choices one request may ask for.
MAX_N = 16
PRIORITY_HEADER, TIMEOUT_HEADER = "X-Ember-Priority", "X-Ember-Timeout-S"
#: A priority: higher is admitted first; ``batch`` is below every number (spare capacity).
Priority = Annotated[int, Field(ge=-10, le=10)] | Literal["batch"]
#: How long past a deadline the edge waits for the replica's own 504 before giving its own
#: (a request still queued for a replica that is starting never reaches the engine's timer).
_DEADLINE_GRACE_S = 1.0


def priority_of(raw: str | None, body: Priority | None) -> Priority | None:
    """The ``X-Ember-Priority`` header's priority (it wins over the body's field), or 400."""
    if raw is None:
        return body
    text = raw.strip().lower()
    if text == "batch":
        return "batch"
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -10 <= value <= 10:
        raise BadRequest(f"{PRIORITY_HEADER}: {raw!r} is neither an integer from -10 to 10 "
                         "nor 'batch'", param=PRIORITY_HEADER)
    return value


def timeout_of(raw: str | None) -> float | None:
    """The ``X-Ember-Timeout-S`` header's seconds (a positive number), or 400."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise BadRequest(f"{TIMEOUT_HEADER}: {raw!r} is not a positive number of seconds",
                         param=TIMEOUT_HEADER)
    return value


def check_stops(stops: list[str]) -> list[str]:
    """``stops`` unchanged, or 400 naming the limit for one over ``MAX_STOP_CHARS``."""
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise BadRequest(f"stop: a stop string is {len(stop)} characters, over the limit "
                             f"of {MAX_STOP_CHARS}", param="stop")
    return stops


class _Sampling(BaseModel):
    """OpenAI's sampling fields, with the ranges OpenAI documents."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    # At most 4 strings, as OpenAI; the count applies to the list only (on the union it also
    # refused a single stop string over 4 characters).
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    #: Ember's extension (``X-Ember-Priority`` wins over it): higher is admitted first.
    priority: Priority | None = None
    user: str | None = None
    #: vLLM's extension: decode to max_tokens past the end-of-sequence token, as serving
    #: benchmarks do to control output lengths.
    ignore_eos: bool = False
    #: text, json_object or json_schema (``openai_structured``).
    response_format: ResponseFormat | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    """The body of ``POST /v1/completions`` (one prompt per request)."""

    prompt: str | list[str] = Field(description="A string, or a list holding one string.")
    #: The log-probability of each token and of this many alternatives.
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatCompletionRequest(_Sampling):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class GenerateRequest(BaseModel):
    """What the generation handler receives: a prompt or chat messages, and sampling."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: None: the room the prompt leaves in the model's context (as OpenAI's chat does).
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=4)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    priority: Priority = 0
    #: Seconds from when the replica receives the request: past them, 504.
    timeout_s: float | None = Field(None, gt=0)
    response_format: ResponseFormat | None = None
    #: Report each token's log-probability and this many alternatives (None: none).
    logprobs: int | None = Field(None, ge=0, le=20)
    #: A LoRA adapter over the served model (None: the model itself).
    adapter: str | None = None


class OpenAIGeneration(Protocol):
    """Serve ``deployment.attr`` (a streaming handler) as OpenAI's text generation APIs.

    Example:
        >>> OpenAIGeneration(deployment="TextGen", attr="generate", model="tiny")
        OpenAIGeneration(model='tiny' -> TextGen.generate)
    """

    def __init__(self, *, deployment: str, attr: str, model: str,
                 default_max_tokens: int = 16, adapters: tuple[str, ...] = ()) -> None:
        self.deployment, self.attr, self.model = deployment, attr, model
        self.default_max_tokens = default_max_tokens
        #: LoRA adapters over ``model``: each a ``model`` clients may name.
        self.adapters = adapters

    def __repr__(self) -> str:
        return f"OpenAIGeneration(model={self.model!r} -> {self.deployment}.{self.attr})"

    def validate(self, app: App) -> None:
        try:
            spec = app.spec(self.deployment)
        except KeyError:
            raise ConfigError(f"OpenAIGeneration: no deployment {self.deployment!r}") from None
        route = next((r for r in spec.routes if r.attr == self.attr), None)
        if route is None or not route.is_stream:
            raise ConfigError(f"OpenAIGeneration: {self.deployment}.{self.attr} must be a "
                              "streaming handler (an async generator)")

    def deployments(self) -> tuple[str, ...]:
        return (self.deployment,)

    def install(self, api: FastAPI, gateway: Gateway) -> None:
        metrics = GenerationMetrics(gateway.registry)

        async def completions(request: Request, body: CompletionRequest) -> Any:
            return await self._serve(request, body, gateway, metrics, chat=False)

        async def chat(request: Request, body: ChatCompletionRequest) -> Any:
            return await self._serve(request, body, gateway, metrics, chat=True)

        async def models() -> dict[str, Any]:
            base = {"id": self.model, "object": "model", "created": 0, "owned_by": "ember"}
            return {"object": "list", "data": [base, *(
                {**base, "id": name, "parent": self.model} for name in self.adapters)]}

        api.add_api_route("/v1/completions", completions, methods=["POST"], tags=["openai"])
        api.add_api_route("/v1/chat/completions", chat, methods=["POST"], tags=["openai"])
        api.add_api_route("/v1/models", models, methods=["GET"], tags=["openai"])

    def _generate_request(self, body: CompletionRequest | ChatCompletionRequest,
                          request: Request) -> GenerateRequest:
        fields: dict[str, Any] = {"temperature": body.temperature, "top_p": body.top_p,
                                  "seed": body.seed, "stop": check_stops(body.stops()),
                                  "ignore_eos": body.ignore_eos, "n": body.n,
                                  "timeout_s": timeout_of(request.headers.get(TIMEOUT_HEADER)),
                                  "response_format": body.response_format}
        grammar_of(body.response_format)  # a schema that cannot compile: 400 before dispatch
        priority = priority_of(request.headers.get(PRIORITY_HEADER), body.priority)
        if priority is not None:
            fields["priority"] = priority
        if isinstance(body, ChatCompletionRequest):
            if body.top_logprobs is not None and not body.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
            # Omitted, chat gets the room the prompt leaves in the context, as OpenAI's does.
            fields["messages"] = body.messages
            fields["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
            limit = body.max_completion_tokens or body.max_tokens
        else:
            fields["logprobs"] = body.logprobs
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if len(prompts) != 1:
                raise InvalidBody("prompt: one prompt per request", param="prompt")
            fields["prompt"] = prompts[0]
            limit = body.max_tokens or self.default_max_tokens
        adapter = body.model if body.model != self.model else None
        return GenerateRequest(max_tokens=limit, adapter=adapter, **fields)

    async def _serve(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     gateway: Gateway, metrics: GenerationMetrics, *, chat: bool) -> Any:
        if body.model != self.model and body.model not in self.adapters:
            return JSONResponse({"error": {
                "message": f"The model '{body.model}' does not exist", "type":
                "invalid_request_error", "param": "model", "code": "model_not_found"}}, 404)
        rid = request_id_of(request)
        generate = self._generate_request(body, request)
        timing = RequestTiming(metrics, body.model, n=body.n)
        # The request object itself, as a native route sends its parsed body: the handler
        # receives its annotated type, never a dict. A request for an adapter goes to a
        # replica that holds it (Ray Serve's multiplexing), when one does.
        adapter = {"model_id": body.model} if body.model != self.model else {}
        chunks = gateway.stream(self.deployment, self.attr, generate, rid, **adapter)
        shape = _Shape(model=body.model, chat=chat, request_id=rid, n=body.n)
        first = await _first(chunks, generate.timeout_s)  # a refusal raises here: a real
        if first.get("adapter_load_s") is not None:       # status, before any byte
            seconds = float(first["adapter_load_s"])
            metrics.adapter_load.labels(body.model).observe(seconds)
            note_adapter_load(seconds)
        timing.chunk(first)
        if not body.stream:
            try:
                return await shape.whole(first, chunks, timing)
            finally:
                await _close(chunks)
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(shape.events(first, chunks, timing, usage=usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})


async def _first(chunks: AsyncIterator[dict[str, Any]],
                 timeout_s: float | None) -> dict[str, Any]:
    """The stream's first chunk; 504 if the request's deadline passes before it starts."""
    try:
        async with asyncio.timeout(None if timeout_s is None else
                                   timeout_s + _DEADLINE_GRACE_S):
            return await anext(chunks)
    except TimeoutError:
        await _close(chunks)
        raise DeadlineExceeded(timeout_s=timeout_s,
                               when="before a replica started it") from None


@dataclass
class _Choices:
    """The last chunk and the text so far of each of a request's choices."""

    n: int
    last: dict[int, dict[str, Any]] = field(default_factory=dict)
    text: dict[int, list[str]] = field(default_factory=dict)
    #: Each choice's token logprob entries so far (when the request asked for them).
    entries: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, chunk: dict[str, Any]) -> int:
        index = int(chunk.get("index", 0))
        self.text.setdefault(index, []).append(chunk["text"])
        self.entries.setdefault(index, []).extend(chunk.get("logprobs") or [])
        self.last[index] = chunk
        return index

    @property
    def done(self) -> bool:
        return (len(self.last) == self.n
                and all(c["finish_reason"] is not None for c in self.last.values()))

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the prompt once, every choice's output tokens."""
        any_ = next(iter(self.last.values()))
        prompt = int(any_["prompt_tokens"])
        completion = sum(int(c["completion_tokens"]) for c in self.last.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                # OpenAI's field for prompt tokens served from a prompt cache.
                "prompt_tokens_details": {"cached_tokens": int(any_.get("cached_tokens", 0))}}


@dataclass
class _Shape:
    """OpenAI's response and chunk bodies for one request."""

    model: str
    chat: bool
    request_id: str
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    #: The completions API's text offsets run on from chunk to chunk, per choice.
    legacy: dict[int, LegacyLogprobs] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    async def whole(self, first: dict[str, Any], rest: AsyncIterator[dict[str, Any]],
                    timing: RequestTiming) -> dict[str, Any]:
        choices = _Choices(self.n)
        choices.add(first)
        while not choices.done:
            chunk = await anext(rest)
            timing.chunk(chunk)
            choices.add(chunk)
        asked = first.get("logprobs") is not None
        body = []
        for index in sorted(choices.last):
            text = "".join(choices.text[index])
            entries = choices.entries[index] if asked else None
            choice: dict[str, Any] = {"index": index,
                                      "logprobs": self._logprobs(entries, index),
                                      "finish_reason": choices.last[index]["finish_reason"]}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            body.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": body, "usage": choices.usage()}

    async def events(self, first: dict[str, Any], rest: AsyncIterator[dict[str, Any]],
                     timing: RequestTiming, *, usage: bool) -> AsyncIterator[str]:
        chunk, choices = first, _Choices(self.n)
        try:
            while True:
                opening = int(chunk.get("index", 0)) not in choices.last
                choices.add(chunk)
                yield _event(self._chunk(chunk, opening, usage))
                if choices.done:
                    break
                try:
                    chunk = await anext(rest)
                except EmberError as err:  # the status is sent: report in-band, as OpenAI does
                    yield _event(error_body(err, self.request_id))
                    return
                timing.chunk(chunk)
        finally:  # a caller that left: cancel the replica's stream now, not at GC
            await _close(rest)
        if usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield _event({**self._head(kind), "choices": [], "usage": choices.usage()})
        yield "data: [DONE]\n\n"

    def _chunk(self, chunk: dict[str, Any], opening: bool, usage: bool) -> dict[str, Any]:
        index = int(chunk.get("index", 0))
        choice: dict[str, Any] = {"index": index,
                                  "logprobs": self._logprobs(chunk.get("logprobs"), index),
                                  "finish_reason": chunk["finish_reason"]}
        if self.chat:
            delta: dict[str, Any] = {"content": chunk["text"]}
            if opening:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = chunk["text"]
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {**self._head(kind), "choices": [choice]}
        return {**body, "usage": None} if usage else body

    def _logprobs(self, entries: list[dict[str, Any]] | None,
                  index: int) -> dict[str, Any] | None:
        """The next tokens' logprobs in this API's shape (None when not asked)."""
        if self.chat:
            return chat_logprobs(entries)
        return self.legacy.setdefault(index, LegacyLogprobs()).shape(entries)


async def _close(chunks: AsyncIterator[Any]) -> None:
    """Close a stream (an async generator) now; a no-op once it has finished."""
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
