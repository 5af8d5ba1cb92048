"""OpenAI-compatible ``POST /v1/embeddings`` over a batch-form embedding handler.

The target handler takes ``list[str]`` and returns, per text, an object with an
``embedding`` (list of floats) and a ``tokens`` count. Every input string is one batch
item, so a request with 10 inputs counts 10 towards the deployment's batch size. Errors use
OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``) so the official
``openai`` client raises its usual exceptions.
"""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ember.edge._asgi import request_id_of
from ember.edge.protocols import Gateway, Protocol
from ember.errors import ConfigError, InvalidBody

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ember.app.app import App

MAX_INPUTS = 2048


class EmbeddingsRequest(BaseModel):
    """The body of ``POST /v1/embeddings`` (OpenAI's fields; ``user`` is accepted, unused)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] = Field(description="A string or a list of strings.")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not 1 <= len(value) <= MAX_INPUTS:
            raise ValueError(f"input must hold between 1 and {MAX_INPUTS} strings")
        return value


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


def encode_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes, base64: what OpenAI sends for ``encoding_format=base64``."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class OpenAIEmbeddings(Protocol):
    """Serve ``deployment.attr`` as OpenAI's embeddings API under model name ``model``.

    Example:
        >>> OpenAIEmbeddings(deployment="MiniLM", attr="embed", model="all-MiniLM-L6-v2")
        OpenAIEmbeddings(model='all-MiniLM-L6-v2' -> MiniLM.embed)
    """

    def __init__(self, *, deployment: str, attr: str, model: str, dimensions: int) -> None:
        self.deployment = deployment
        self.attr = attr
        self.model = model
        self.dimensions = dimensions

    def __repr__(self) -> str:
        return f"OpenAIEmbeddings(model={self.model!r} -> {self.deployment}.{self.attr})"

    def validate(self, app: App) -> None:
        try:
            spec = app.spec(self.deployment)
        except KeyError:
            raise ConfigError(f"OpenAIEmbeddings: no deployment {self.deployment!r}") from None
        route = next((r for r in spec.routes if r.attr == self.attr), None)
        if route is None or route.kind != "batch":
            raise ConfigError(
                f"OpenAIEmbeddings: {self.deployment}.{self.attr} must be a route taking list[str]"
            )

    def deployments(self) -> tuple[str, ...]:
        return (self.deployment,)

    def install(self, api: FastAPI, gateway: Gateway) -> None:
        async def embeddings(request: Request, body: EmbeddingsRequest) -> Any:
            return await self._embeddings(request, body, gateway)

        api.add_api_route("/v1/embeddings", embeddings, methods=["POST"],
                          response_model=EmbeddingsResponse, tags=["openai"])

        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "ember"}]}

        api.add_api_route("/v1/models", models, methods=["GET"], tags=["openai"])

    async def _embeddings(self, request: Request, body: EmbeddingsRequest,
                          gateway: Gateway) -> Any:
        if body.model != self.model:
            return _openai_error(404, f"The model '{body.model}' does not exist", "model",
                                 "model_not_found")
        if body.dimensions is not None and body.dimensions != self.dimensions:
            raise InvalidBody(f"{self.model} has {self.dimensions} dimensions only")
        texts = [body.input] if isinstance(body.input, str) else body.input
        results = await gateway.call(self.deployment, self.attr, texts, request_id_of(request))
        tokens = sum(int(_field(r, "tokens")) for r in results)
        data = [EmbeddingData(index=i, embedding=self._encode(_field(r, "embedding"),
                                                              body.encoding_format))
                for i, r in enumerate(results)]
        return EmbeddingsResponse(data=data, model=self.model,
                                  usage=Usage(prompt_tokens=tokens, total_tokens=tokens))

    @staticmethod
    def _encode(vector: list[float], encoding: str) -> list[float] | str:
        return encode_base64(vector) if encoding == "base64" else vector


def _field(item: Any, name: str) -> Any:
    return item[name] if isinstance(item, dict) else getattr(item, name)


def _openai_error(status: int, message: str, param: str | None, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": param, "code": code}}, status_code=status)
