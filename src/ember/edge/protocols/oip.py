"""The Open Inference Protocol v2 (KServe / Triton REST) for tensor-in, tensor-out models.

Routes: ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``,
``GET /v2/models/{name}``, ``GET /v2/models/{name}/ready`` and
``POST /v2/models/{name}/infer``. A model is a deployment handler written for a tensor
(``def forward(self, x: torch.Tensor) -> torch.Tensor``); each row of the input is one batch
item, so concurrent infer requests are stacked into one forward pass when the deployment
batches. Errors use the protocol's shape, ``{"error": "<message>"}``.

Triton's binary tensor extension works both ways, as Triton's own client uses it by default:
a request whose ``Inference-Header-Content-Length`` header is N holds N bytes of JSON, then
the raw little-endian bytes of each input that names its ``binary_data_size``; an output
asked for with ``"parameters": {"binary_data": true}`` (or the request parameter
``binary_data_output``) comes back the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ember.app.config import NAME_PATTERN
from ember.edge._asgi import request_id_of
from ember.edge._strict_json import parse_json
from ember.edge.protocols import Gateway, Protocol
from ember.errors import ConfigError, EmberError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ember.app.app import App

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
    data: list[Any] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[RequestedOutput] = Field(default_factory=list)
    parameters: dict[str, Any] = Field(default_factory=dict)


#: Triton's binary tensor extension: the length of the JSON part of a body.
HEADER_LENGTH = "Inference-Header-Content-Length"


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

    def deployments(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.deployment for m in self.models.values()))

    def deployment_for(self, path_params: Mapping[str, Any]) -> str | None:
        model = self.models.get(str(path_params.get("name", "")))
        return model.deployment if model is not None else None

    def install(self, api: FastAPI, gateway: Gateway) -> None:
        oip = _Routes(self.models, gateway)
        get: dict[str, Callable[..., Any]] = {
            "/v2/health/live": oip.live, "/v2/health/ready": oip.ready, "/v2": oip.server,
            "/v2/models/{name}": oip.metadata, "/v2/models/{name}/ready": oip.model_ready}
        for path, fn in get.items():
            api.add_api_route(path, fn, methods=["GET"], tags=["open-inference-v2"])
        api.add_api_route("/v2/models/{name}/infer", oip.infer, methods=["POST"],
                          tags=["open-inference-v2"], openapi_extra=_INFER_BODY)


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

    async def infer(self, name: str, request: Request) -> Any:
        if not NAME_PATTERN.match(name):
            return _error(400, "model name must be letters, digits, '_' or '-'")
        model = self.models.get(name)
        if model is None:
            return _error(404, f"unknown model '{name}'")
        try:
            body, blobs = read_infer_body(await request.body(), request.headers.get(HEADER_LENGTH))
            tensor = decode_input(model, body, blobs)
        except ValueError as exc:
            return _error(400, str(exc))
        try:
            output = await self.gateway.call(model.deployment, model.attr, tensor,
                                             request_id_of(request))
        except EmberError as err:
            return _error(err.status_code, str(err), err.headers())
        head = {"model_name": model.name, "model_version": model.version, "id": body.id or ""}
        if not wants_binary_output(body, model.output.name):
            return {**head, "outputs": [encode_output(model.output, output)]}
        entry, raw = encode_binary_output(model.output, output)
        header = json.dumps({**head, "outputs": [entry]}).encode()
        return Response(header + raw, media_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(header))})


#: The body's schema in OpenAPI (the route reads the body itself, for the binary extension).
_INFER_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": InferRequest.model_json_schema()}}}}


def read_infer_body(raw: bytes, header_length: str | None) -> tuple[InferRequest, bytes]:
    """The JSON part of an infer body, and the binary tensor bytes after it (if any).

    Raises:
        ValueError: the header length or the JSON is malformed, or the JSON is not an
            inference request.
    """
    size = len(raw)
    if header_length is not None:
        if not header_length.isdigit() or not 0 < int(header_length) <= len(raw):
            raise ValueError(f"{HEADER_LENGTH} must be a byte count within the body "
                             f"({len(raw)} bytes), got {header_length!r}")
        size = int(header_length)
    try:
        return InferRequest.model_validate(parse_json(raw[:size])), raw[size:]
    except EmberError as exc:
        raise ValueError(str(exc)) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"invalid inference request: {where}: {first['msg']}") from None


def wants_binary_output(body: InferRequest, name: str) -> bool:
    """Whether the caller asked for the output as raw bytes (Triton's binary extension)."""
    asked = next((o for o in body.outputs if o.name == name), None)
    if asked is not None and "binary_data" in asked.parameters:
        return bool(asked.parameters["binary_data"])
    return bool(body.parameters.get("binary_data_output", False))


def encode_binary_output(spec: TensorSpec, tensor: Any) -> tuple[dict[str, Any], bytes]:
    """An output's JSON entry (with ``binary_data_size``) and its raw little-endian bytes."""
    raw = tensor.detach().cpu().contiguous().numpy().astype(_numpy_dtype(spec.datatype)).tobytes()
    entry = {"name": spec.name, "datatype": spec.datatype, "shape": list(tensor.shape),
             "parameters": {"binary_data_size": len(raw)}}
    return entry, raw


def _numpy_dtype(datatype: str) -> str:
    # Little-endian, as the extension specifies; BOOL is one byte per value.
    return "?" if datatype == "BOOL" else "<" + _NUMPY[datatype]


_NUMPY = {"FP32": "f4", "FP64": "f8", "FP16": "f2", "INT64": "i8", "INT32": "i4",
          "INT16": "i2", "INT8": "i1", "UINT8": "u1"}


def decode_input(model: TensorModel, body: InferRequest, blobs: bytes = b"") -> Any:
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
    if given.data is None:
        return _decode_binary(given, blobs)
    if blobs:
        raise ValueError(f"{len(blobs)} bytes of binary data follow the JSON, but input "
                         f"'{given.name}' has its data inline")
    flat = _flatten(given.data)
    if len(flat) != math.prod(given.shape):
        raise ValueError(f"input '{given.name}' has {len(flat)} values for shape {given.shape}")
    dtype = getattr(torch, DATATYPES[spec.datatype])
    try:
        return torch.tensor(flat, dtype=dtype).reshape(given.shape)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"input '{given.name}' data is not {spec.datatype}: {exc}") from None


def _decode_binary(given: InferInput, blobs: bytes) -> Any:
    """An input sent as raw bytes after the JSON header."""
    import numpy as np
    import torch

    size = given.parameters.get("binary_data_size")
    want = math.prod(given.shape) * np.dtype(_numpy_dtype(given.datatype)).itemsize
    if not isinstance(size, int) or size != len(blobs) or size != want:
        raise ValueError(f"input '{given.name}' has no data: send 'data', or "
                         f"binary_data_size={want} ({given.datatype} x {given.shape}) with "
                         f"exactly that many bytes after the JSON (got {size!r} and "
                         f"{len(blobs)} bytes)")
    array = np.frombuffer(blobs, dtype=_numpy_dtype(given.datatype)).astype(
        _numpy_dtype(given.datatype)[1:] if given.datatype != "BOOL" else "?")
    return torch.from_numpy(array.copy()).reshape(given.shape)


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
