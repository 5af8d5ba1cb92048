"""Triton's own HTTP client works against Ember's Open Inference route, JSON and binary.

The edge app is served by uvicorn on 127.0.0.1 (real HTTP, what ``tritonclient.http`` talks
to); only Ray's handles are faked, as in the other edge tests.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import uvicorn
from serve_fakes import FakeHandle, as_handle, replica_of

import ember
from ember.edge.auth import ApiKeys
from ember.edge.ingress import IngressState, build_fastapi
from ember.protocols import OpenInferenceProtocol, TensorModel, TensorSpec

tritonclient_http = pytest.importorskip("tritonclient.http")


@ember.deployment(name="Doubler", batch=ember.Batch(max_size=8, max_wait_ms=1))
class Doubler:
    @ember.route()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


APP = ember.App([Doubler], name="triton", warm_pool=0, protocols=[OpenInferenceProtocol([
    TensorModel(name="double", deployment="Doubler", attr="forward",
                input=TensorSpec("x", "FP32", (-1, 4)), output=TensorSpec("y", "FP32", (-1, 4)))])])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    fake = FakeHandle(replica_of(Doubler))
    state = IngressState(APP.name, list(APP.routes()), {s.name: s.options for s in APP.specs},
                         {"Doubler": as_handle(fake)}, APP.timeouts(), APP.protocols, None,
                         frozenset(), ApiKeys([]), None)
    state.tracker.loads["Doubler"].running = 1
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_fastapi(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize(("binary_in", "binary_out"), [
    (False, False), (True, True), (True, False), (False, True)])
def test_triton_client_infers(url: str, binary_in: bool, binary_out: bool) -> None:
    client = tritonclient_http.InferenceServerClient(url=url)
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    given = tritonclient_http.InferInput("x", [2, 4], "FP32")
    given.set_data_from_numpy(data, binary_data=binary_in)
    wanted = tritonclient_http.InferRequestedOutput("y", binary_data=binary_out)
    result = client.infer("double", inputs=[given], outputs=[wanted])
    np.testing.assert_array_equal(result.as_numpy("y"), data * 2)
    assert result.get_output("y")["datatype"] == "FP32"
    client.close()


def test_triton_client_reads_metadata_and_readiness(url: str) -> None:
    client = tritonclient_http.InferenceServerClient(url=url)
    assert client.is_server_live() and client.is_model_ready("double")
    assert client.get_model_metadata("double")["inputs"][0]["shape"] == [-1, 4]
    client.close()


@pytest.mark.parametrize(("length", "size", "extra", "says"), [
    ("9999", 32, b"", "Inference-Header-Content-Length must be a byte count"),
    ("-3", 32, b"", "Inference-Header-Content-Length must be a byte count"),
    (None, 64, b"", "binary_data_size=32"),
    (None, 16, b"", "binary_data_size=32"),
    (None, 32, b"\0", "binary_data_size=32"),
])
def test_a_malformed_binary_request_is_a_400_that_says_why(url: str, length: str | None,
                                                           size: int, extra: bytes,
                                                           says: str) -> None:
    import json

    import httpx

    header = json.dumps({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}]}).encode()
    raw = np.zeros(size // 4, dtype=np.float32).tobytes() + extra
    headers = {"Inference-Header-Content-Length": length or str(len(header))}
    reply = httpx.post(f"http://{url}/v2/models/double/infer", content=header + raw,
                       headers=headers, timeout=10)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]
