"""The flagship MiniLM deployment served by Ember, checked against the model run locally."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from ember.deployments import embeddings
from ember.deployments._minilm import Tokenizer, embed, find_model_files

from serving import ServeApp

pytestmark = pytest.mark.cluster

TEXTS = ["The cat sat on the mat.", "Ray Serve scales replicas.", "", "日本語の文も埋め込む",
         "word " * 400]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    model = embeddings.load_encoder(torch.device("cpu"))
    return embed(model, Tokenizer(find_model_files().tokenizer), TEXTS)


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(embeddings.app, ready_timeout_s=120) as base:
        yield base


def _cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got), want).tolist()


def test_embed_route_matches_the_model_run_locally(url: str, reference: torch.Tensor) -> None:
    reply = httpx.post(f"{url}/embed", json=TEXTS, timeout=180)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert all(c >= 0.9999 for c in _cosines([b["embedding"] for b in body], reference))
    assert body[4]["tokens"] == 256  # truncated at the model's limit
    assert body[2]["tokens"] == 2  # [CLS] [SEP]


def test_openai_client_gets_the_same_vectors(url: str, reference: torch.Tensor) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    result = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    assert all(c >= 0.9999 for c in _cosines([d.embedding for d in result.data], reference))
    tokenizer = Tokenizer(find_model_files().tokenizer)
    assert result.usage.prompt_tokens == tokenizer.count_tokens(TEXTS)
    assert result.model == "all-MiniLM-L6-v2" and len(result.data[0].embedding) == 384


def test_concurrent_callers_each_get_their_own_vector(url: str,
                                                      reference: torch.Tensor) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{url}/embed", json=[TEXTS[i % 4]])
                                          for i in range(32)))

    replies = asyncio.run(run())
    for i, reply in enumerate(replies):
        assert reply.status_code == 200
        got = reply.json()[0]["embedding"]
        assert _cosines([got], reference[i % 4 : i % 4 + 1])[0] >= 0.9999


def test_pipeline_app_gives_the_same_embeddings(serve_app: ServeApp, url: str,
                                                reference: torch.Tensor) -> None:
    from ray import serve

    # Both apps route /embed at the root: the module's app makes way (it is the last test).
    serve.delete(embeddings.app.name)
    with serve_app(embeddings.pipeline_app, ready_timeout_s=120) as base:
        reply = httpx.post(f"{base}/embed", json=TEXTS, timeout=180)
    assert reply.status_code == 200, reply.text
    got = [b["embedding"] for b in reply.json()]
    assert all(c >= 0.9999 for c in _cosines(got, reference))
