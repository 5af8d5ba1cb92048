"""LoRA adapters over two replicas of the textgen deployment, on a real cluster through the
official ``openai`` client: a request naming an adapter as its ``model`` goes to the replica
that holds the adapter, so each adapter is loaded once in the cluster.

The replicas run TextGen's own ``generate`` (apps/lora.py); which replica loaded an adapter
shows in the header of the request that met the load (``X-Ember-Cold-Start: adapter=<ms>``),
and what each replica holds in a probe route of the test app.

Breaks tried (each failed this test, then was restored):
- the edge sending no multiplexed model id (``Dispatcher.stream`` skipping
  ``handle.options(multiplexed_model_id=...)``): both adapters loaded on both replicas;
- ``PrefixRouter.choose_replicas`` returning one random candidate: the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

import lora_models
from apps import lora
from serving import ServeApp
from support import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
pytest.importorskip("peft")

#: Requests per adapter after the first (each prompt starts differently, so that prefix
#: routing alone would spread them over both replicas).
REPEATS = 6


def held(url: str) -> dict[str, list[str]]:
    """Replica -> adapters its store holds, once both replicas have answered the probe."""
    seen: dict[str, list[str]] = {}

    def both() -> bool:
        answer = httpx.get(f"{url}/lora-gen/held", timeout=30).json()
        seen[answer["replica"]] = answer["adapters"]
        return len(seen) == 2

    wait_for(both, 240, interval_s=0.1, what="answers from both LoraGen replicas")
    return seen


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    lora_models.model_dirs(lora.model_root())
    with serve_app(lora.app, ready_timeout_s=240) as base:
        assert all(names == [] for names in held(base).values())  # both up, none loaded
        yield base


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    """A short completion's ``X-Ember-Cold-Start`` header ("" when none)."""
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True})
    assert raw.parse().model == model
    return raw.headers.get("x-ember-cold-start") or ""


def test_each_adapter_is_loaded_once_and_served_where_it_is(url: str) -> None:
    client = openai.AsyncOpenAI(api_key="none", base_url=f"{url}/v1", timeout=120,
                                max_retries=0)

    async def scenario() -> dict[str, list[str]]:
        headers = {m: [await _complete(client, m, f"{m} warm up")] for m in lora.ADAPTERS}
        later = await asyncio.gather(*(
            _complete(client, m, f"{n:02d} {m}: pick the rows") for n in range(REPEATS)
            for m in lora.ADAPTERS))
        for i, header in enumerate(later):
            headers[list(lora.ADAPTERS)[i % len(lora.ADAPTERS)]].append(header)
        return headers

    headers = asyncio.run(scenario())
    # The warming request of each adapter met its load (X-Ember-Cold-Start: adapter=<ms>);
    # every later one found it loaded where it was sent.
    loads = {m: [i for i, h in enumerate(hs) if "adapter=" in h] for m, hs in headers.items()}
    assert loads == {m: [0] for m in lora.ADAPTERS}, headers
    where = held(url)
    holders = {m: [r for r, names in where.items() if m in names] for m in lora.ADAPTERS}
    assert all(len(h) == 1 for h in holders.values()), where
