"""LoRA adapters on the served textgen app: ``ember run ember.deployments.textgen:app`` with
``EMBER_TEXTGEN_MODEL`` and ``EMBER_TEXTGEN_ADAPTERS``, called with the official client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

import lora_models
from harness import EmberRun

pytest.importorskip("peft")

PROMPT, TOKENS = "hello", 8
# 45 characters, one token each: two full 16-token prefix-cache blocks and more.
SHARED = "You are a careful assistant. Answer briefly. "


async def _complete(client: openai.AsyncOpenAI, model: str) -> tuple[str, str | None]:
    """A greedy completion's text and its ``X-Ember-Cold-Start`` header."""
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    reply = raw.parse()
    assert reply.model == model
    return str(reply.choices[0].text), raw.headers.get("x-ember-cold-start")


async def _cached(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, int]:
    """A greedy completion's text and the prompt tokens it found in the prefix cache."""
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS,
                                            temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return str(reply.choices[0].text), int(reply.usage.prompt_tokens_details.cached_tokens or 0)


@pytest.mark.slow
def test_two_adapters_and_the_base_through_the_official_client(tmp_path: Path) -> None:
    dirs = lora_models.model_dirs(tmp_path / "models")
    decode = lora_models.tokenizer().decode
    want = {model: decode(lora_models.reference(dirs, name, PROMPT, TOKENS),
                          skip_special_tokens=True)
            for model, name in (("sql", "a"), ("chat", "b"), ("base", None))}
    assert len(set(want.values())) == 3  # each adapter changes the output
    shared = [("sql", "a", "one?"), ("sql", "a", "two?"), ("chat", "b", "two?")]
    want_shared = [decode(lora_models.reference(dirs, name, SHARED + q, TOKENS),
                          skip_special_tokens=True) for _, name, q in shared]
    adapters = ",".join(f"{m}={dirs[n].as_uri()}" for m, n in
                        (("sql", "a"), ("chat", "b"), ("wrong", "other")))
    # The base by its URL: mapped from the node cache by the loaders, adapters over it.
    env = {"EMBER_TEXTGEN_MODEL": dirs["base"].as_uri() + "/",
           "EMBER_TEXTGEN_ADAPTERS": adapters,
           "EMBER_TEXTGEN_MAX_ADAPTERS": "2", "EMBER_WARM_POOL": "0"}
    with EmberRun("ember.deployments.textgen:app", tmp_path, env=env) as run:
        run.wait_ready(240, http=True)
        client = openai.AsyncOpenAI(api_key="none", base_url=f"{run.url}/v1", timeout=180,
                                    max_retries=0)

        async def scenario() -> None:
            listed = {m.id: getattr(m, "parent", None) for m in (await client.models.list()).data}
            assert listed == {"base": None, "sql": "base", "chat": "base", "wrong": "base"}
            first = {m: await _complete(client, m) for m in ("base", "sql", "chat")}
            assert {m: text for m, (text, _) in first.items()} == want, run.tail()
            for model in ("sql", "chat"):  # a cold adapter load is a cold-start phase
                assert "adapter=" in (first[model][1] or ""), first[model]
            with pytest.raises(openai.BadRequestError, match="does not fit the base"):
                await _complete(client, "wrong")
            with pytest.raises(openai.NotFoundError, match="nowhere"):
                await _complete(client, "nowhere")
            # Both adapters are still loaded: the misfit evicted neither, so no cold load.
            again = await asyncio.gather(_complete(client, "sql"), _complete(client, "chat"),
                                         _complete(client, "base"))
            assert [text for text, _ in again] == [want["sql"], want["chat"], want["base"]]
            assert not any("adapter=" in (header or "") for _, header in again), again
            # The second "sql" prompt starts from the first's blocks (SHARED's two); "chat"
            # with the very same prompt as the second finds none of them.
            got = [await _cached(client, m, SHARED + q) for m, _, q in shared]
            assert got == list(zip(want_shared, [0, 32, 0], strict=True)), run.tail()

        asyncio.run(scenario())
