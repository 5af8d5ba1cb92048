"""The Open Inference Protocol v2 (KServe / Triton REST) for tensor-in, tensor-out models.

Routes: ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``,
``GET /v2/models/{name}``, ``GET /v2/models/{name}/ready`` and
``POST /v2/models/{name}/infer``. A model is a deployment handler written for a tensor
(``def forward(self, x: torch.Tensor) -> torch.Tensor``); each row of the input is one batch
item, so concurrent infer requests are stacked into one forward pass when the deployment
batches. Errors use the protocol's shape, ``{"error": "<message>"}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ember.errors import ConfigError, EmberError
from ember.platform.config import NAME_PATTERN
from ember.platform.http._asgi import request_id_of
from ember.platform.http.protocols import Gateway, Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ember.platform.app import App

#: Protocol datatypes Ember accepts, with their torch dtype names.
DATATYPES = {"FP32": "float32", "FP64": "float64", "FP16": "float16", "INT64": "int64",
             "INT32": "int32", "INT16": "int16", "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorSpec:
    """Name, datatype and shape (-1 for the batch dimension) of a model input or output."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class TensorModel:
    """One model served under OIP: which handler, and its tensor signature."""

    name: str
    deployment: str
    attr: str
    input: TensorSpec
    output: TensorSpec
    version: str = "1"


class InferInput(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    shape: list[int] = Field(min_length=1, max_length=8)
    datatype: str
    data: list[Any]


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    inputs: list[InferInput] = Field(min_length=1)


class OpenInferenceProtocol(Protocol):
    """Serve tensor models over the Open Inference Protocol v2."""

    def __init__(self, models: list[TensorModel]) -> None:
        self.models = {m.name: m for m in models}

    def validate(self, app: App) -> None:
        for model in self.models.values():
            try:
                spec = app.spec(model.deployment)
            except KeyError:
                raise ConfigError(
                    f"OIP model {model.name}: no deployment {model.deployment!r}") from None
            route = next((r for r in spec.routes if r.attr == model.attr), None)
            if route is None or route.kind != "tensor":
                raise ConfigError(f"OIP model {model.name}: {model.deployment}.{model.attr} "
                                  "must be a route taking torch.Tensor")
            if model.input.datatype not in DATATYPES:
                raise ConfigError(f"OIP model {model.name}: unknown datatype")

    def install(self, api: FastAPI, gateway: Gateway) -> None:
        oip = _Routes(self.models, gateway)
        get: dict[str, Callable[..., Any]] = {
            "/v2/health/live": oip.live, "/v2/health/ready": oip.ready, "/v2": oip.server,
            "/v2/models/{name}": oip.metadata, "/v2/models/{name}/ready": oip.model_ready}
        for path, fn in get.items():
            api.add_api_route(path, fn, methods=["GET"], tags=["open-inference-v2"])
        api.add_api_route("/v2/models/{name}/infer", oip.infer, methods=["POST"],
                          tags=["open-inference-v2"])


class _Routes:
    def __init__(self, models: dict[str, TensorModel], gateway: Gateway) -> None:
        self.models = models
        self.gateway = gateway

    async def live(self) -> dict[str, bool]:
        return {"live": True}

    async def ready(self) -> JSONResponse:
        ready = self.gateway.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def server(self) -> dict[str, Any]:
        return {"name": "ember", "version": "0.1.0", "extensions": []}

    async def metadata(self, name: str) -> Any:
        if not NAME_PATTERN.match(name):
            return _error(400, "model name must be letters, digits, '_' or '-'")
        model = self.models.get(name)
        if model is None:
            return _error(404, f"unknown model '{name}'")
        return {"name": model.name, "versions": [model.version], "platform": "pytorch",
                "inputs": [model.input.as_dict()], "outputs": [model.output.as_dict()]}

    async def model_ready(self, name: str) -> Any:
        # A model at zero replicas is still ready: the next request starts it.
        if not NAME_PATTERN.match(name):
            return _error(400, "model name must be letters, digits, '_' or '-'")
        if name not in self.models:
            return _error(404, f"unknown model '{name}'")
        return {"name": name, "ready": True}

    async def infer(self, name: str, request: Request, body: InferRequest) -> Any:
        if not NAME_PATTERN.match(name):
            return _error(400, "model name must be letters, digits, '_' or '-'")
        model = self.models.get(name)
        if model is None:
            return _error(404, f"unknown model '{name}'")
        try:
            tensor = decode_input(model, body)
        except ValueError as exc:
            return _error(400, str(exc))
        try:
            output = await self.gateway.call(model.deployment, model.attr, tensor,
                                             request_id_of(request))
        except EmberError as err:
            return _error(err.status_code, str(err), err.headers())
        return {"model_name": model.name, "model_version": model.version, "id": body.id or "",
                "outputs": [encode_output(model.output, output)]}


def decode_input(model: TensorModel, body: InferRequest) -> Any:
    """The request's tensor, checked against the model's signature.

    Raises:
        ValueError: naming the input and what is wrong with it.
    """
    import torch

    if len(body.inputs) != 1 or body.inputs[0].name != model.input.name:
        raise ValueError(f"model {model.name} takes exactly one input named '{model.input.name}'")
    spec, given = model.input, body.inputs[0]
    if given.datatype != spec.datatype:
        raise ValueError(f"input '{given.name}' must be {spec.datatype}, got {given.datatype}")
    if len(given.shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, given.shape, strict=True)
    ) or any(dim < 1 for dim in given.shape):
        raise ValueError(f"input '{given.name}' must have shape {list(spec.shape)}, "
                         f"got {given.shape}")
    flat = _flatten(given.data)
    if len(flat) != math.prod(given.shape):
        raise ValueError(f"input '{given.name}' has {len(flat)} values for shape {given.shape}")
    dtype = getattr(torch, DATATYPES[spec.datatype])
    try:
        return torch.tensor(flat, dtype=dtype).reshape(given.shape)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"input '{given.name}' data is not {spec.datatype}: {exc}") from None


def encode_output(spec: TensorSpec, tensor: Any) -> dict[str, Any]:
    """An output tensor in the protocol's JSON form (row-major flat data)."""
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(tensor.shape),
            "data": tensor.reshape(-1).tolist()}


def _flatten(data: list[Any]) -> list[Any]:
    # Clients send either flat row-major data or nested lists; accept both.
    if data and isinstance(data[0], list):
        return [x for row in data for x in _flatten(row)]
    return data


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)
