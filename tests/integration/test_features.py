"""Batching, pipelines, streaming, OpenAI and Open Inference v2, on a real cluster."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest

from apps import features
from serving import ServeApp
from support import every_edge_sees, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(features.app) as base:
        yield base


def _concurrently(url: str, path: str, bodies: Sequence[object]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}{path}", json=b) for b in bodies))

    return asyncio.run(run())


def test_concurrent_requests_form_batches_and_answers_are_not_mixed(url: str) -> None:
    bodies = [[{"values": [float(i), 0.5]}] for i in range(32)]
    replies = _concurrently(url, "/sum", bodies)
    assert [r.status_code for r in replies] == [200] * 32
    assert [r.json()[0]["total"] for r in replies] == [i + 0.5 for i in range(32)]
    # 32 concurrent clients: batches larger than Ray Serve's default concurrency cap of 5.
    assert httpx.get(f"{url}/sum/batches", timeout=30).json()["max"] > 5


def test_batch_size_counts_items_not_requests(url: str) -> None:
    reply = httpx.post(f"{url}/sum", json=[{"values": [1]}] * 10, timeout=30)
    assert reply.status_code == 200
    assert [t["batch_size"] >= 10 for t in reply.json()] == [True] * 10


def test_one_bad_item_fails_only_its_own_request(url: str) -> None:
    bodies: list[object] = [[{"values": [i]}] for i in range(12)]
    bodies[5] = [{"values": [5], "fail": True}]
    replies = _concurrently(url, "/sum", bodies)
    codes = [r.status_code for r in replies]
    assert codes[5] == 500 and "ValueError" in replies[5].json()["error"]["message"]
    assert codes[:5] + codes[6:] == [200] * 11
    assert [r.json()[0]["total"] for i, r in enumerate(replies) if i != 5] == [
        float(i) for i in range(12) if i != 5]


def test_sse_stream_sends_chunks_as_produced(url: str) -> None:
    arrivals: list[float] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/count", json={"n": 3, "delay_s": 1.0}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                arrivals.append(time.monotonic() - started)
    assert lines == ['data: {"i": 0}', 'data: {"i": 1}', 'data: {"i": 2}']
    assert arrivals[0] < arrivals[-1] - 1.0, arrivals  # the first did not wait for the last


def test_openai_client_works_unchanged(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    result = client.embeddings.create(model="fake-8", input=["a b c", "hello"])
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) == 8
    assert result.usage.prompt_tokens == 4
    single = client.embeddings.create(model="fake-8", input="hello")
    assert single.data[0].embedding == result.data[1].embedding


def test_openai_base64_and_errors(url: str) -> None:
    raw = httpx.post(f"{url}/v1/embeddings", timeout=30, json={
        "model": "fake-8", "input": "hello", "encoding_format": "base64"}).json()
    floats = struct.unpack("<8f", base64.b64decode(raw["data"][0]["embedding"]))
    plain = httpx.post(f"{url}/v1/embeddings", json={"model": "fake-8", "input": "hello"},
                       timeout=30).json()["data"][0]["embedding"]
    assert list(floats) == pytest.approx(plain, abs=1e-6)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-nothing", input="x")
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model="fake-8", input=[])


def test_open_inference_protocol_v2(url: str) -> None:
    assert httpx.get(f"{url}/v2/health/live", timeout=30).json() == {"live": True}
    assert httpx.get(f"{url}/v2/health/ready", timeout=30).status_code == 200
    meta = httpx.get(f"{url}/v2/models/doubler", timeout=30).json()
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    body = {"id": "r1", "inputs": [{"name": "INPUT0", "shape": [2, 4], "datatype": "FP32",
                                    "data": [1, 2, 3, 4, 5, 6, 7, 8]}]}
    reply = httpx.post(f"{url}/v2/models/doubler/infer", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["id"] == "r1" and out["model_name"] == "doubler"
    assert out["outputs"][0]["shape"] == [2, 4]
    assert out["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]


@pytest.mark.parametrize(("change", "status"), [
    ({"shape": [2, 3]}, 400), ({"datatype": "INT64"}, 400), ({"name": "X"}, 400),
    ({"data": [1, 2]}, 400)])
def test_open_inference_protocol_bad_tensors(url: str, change: dict[str, object],
                                             status: int) -> None:
    tensor = {"name": "INPUT0", "shape": [2, 4], "datatype": "FP32", "data": list(range(8))}
    reply = httpx.post(f"{url}/v2/models/doubler/infer", timeout=30,
                       json={"inputs": [{**tensor, **change}]})
    assert reply.status_code == status
    assert isinstance(reply.json()["error"], str)
    assert httpx.post(f"{url}/v2/models/nope/infer", timeout=30,
                      json={"inputs": [tensor]}).status_code == 404


def test_concurrent_oip_requests_are_stacked_and_split(url: str) -> None:
    bodies = [{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                           "data": [i, i, i, i]}]} for i in range(16)]
    replies = _concurrently(url, "/v2/models/doubler/infer", bodies)
    assert [r.json()["outputs"][0]["data"] for r in replies] == [[2.0 * i] * 4
                                                                  for i in range(16)]


def test_cold_pipeline_wakes_every_stage_at_once(url: str) -> None:
    for name in ("Mid", "Post"):  # as every edge sees it: the one that answers wakes them
        wait_for(lambda n=name: every_edge_sees(url, n, 0), 60,  # type: ignore[misc]
                 what=f"{name} at zero")
    reply = httpx.post(f"{url}/pipe", json={"text": "abc"}, timeout=120)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["text"] == "ABC" and out["stages"] == ["pre", "mid", "post"]
    # Post's replica was loading while Mid's was: the cold starts overlapped.
    assert out["post"]["setup_started"] < out["mid"]["setup_done"], out


def test_pipeline_timeout_is_504_and_cancels_the_downstream_stage(url: str,
                                                                 tmp_path: Path) -> None:
    marker = tmp_path / "stuck-cancelled"
    reply = httpx.post(f"{url}/stuck", json={"marker": str(marker)}, timeout=60)
    assert reply.status_code == 504
    wait_for(marker.exists, 15, what="the downstream stage to be cancelled")


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, True)])
def test_tritonclient_infers_on_the_live_server_json_and_binary(url: str, binary_in: bool,
                                                                binary_out: bool) -> None:
    """Triton's own HTTP client, through the edges to the Doubler replica (not a fake)."""
    import numpy as np
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=url.removeprefix("http://"))
    try:
        assert client.is_server_live() and client.is_model_ready("doubler")
        assert client.get_model_metadata("doubler")["inputs"][0]["shape"] == [-1, 4]
        data = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
        given = triton.InferInput("INPUT0", [3, 4], "FP32")
        given.set_data_from_numpy(data, binary_data=binary_in)
        wanted = triton.InferRequestedOutput("OUTPUT0", binary_data=binary_out)
        result = client.infer("doubler", inputs=[given], outputs=[wanted])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        assert result.get_output("OUTPUT0")["datatype"] == "FP32"
    finally:
        client.close()
