"""LoRA adapters over one base: the engine's greedy tokens are peft's ``generate()``'s, for
an adapter alone and for base and two adapters mixed in one batch, also when an adapter row
starts from the prefix cache; a row only ever hits blocks computed under its own adapter
load; the store's LRU never evicts an adapter a request holds, and an adapter for another
base is refused untouched."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_lora import AdapterStore, fetch
from ember.deployments._textgen_prefix import PrefixCache
from ember.deployments._textgen_sampling import SamplingParams
from ember.errors import BadRequest

import lora_models

# Importing transformers and peft takes a few seconds.
pytestmark = pytest.mark.slow

pytest.importorskip("tokenizers")
pytest.importorskip("peft")
_hf = pytest.importorskip("ember.deployments._textgen_hf")

PROMPTS = ["hello", "a", "the end of the line", "xyz", "0123456789 abcdefghij", "Qq"]
LENGTHS = [7, 12, 3, 9, 15, 5]
# 45 characters, one token each: two full 16-token blocks and more.
SHARED = "You are a careful assistant. Answer briefly. "


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return lora_models.model_dirs(tmp_path_factory.mktemp("lora"))


@pytest.fixture(autouse=True)
def _node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EMBER_REGIONAL_CACHE", raising=False)


def _backend(dirs: dict[str, Path], *adapters: str) -> Any:
    backend = _hf.TransformersBackend.from_directory(dirs["base"])
    backend.eos_token_id = None  # run every sequence to its length
    for name in adapters:
        files = fetch(dirs[name].as_uri())
        backend.lora.check(name, files)
        backend.lora.add(name, files)
    return backend


async def _run(backend: Any, rows: list[tuple[str | None, str, int]]) -> list[list[int]]:
    engine = Engine(backend, EngineConfig(max_num_seqs=4))

    async def one(adapter: str | None, prompt: str, n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        tokens = [t async for c in engine.generate(backend.encode(prompt), params,
                                                   adapter=adapter) for t in c.token_ids]
        return tokens

    try:
        return list(await asyncio.gather(*(one(*row) for row in rows)))
    finally:
        await engine.close()


def test_one_adapter_alone_equals_peft_generate(dirs: dict[str, Path]) -> None:
    rows: list[tuple[str | None, str, int]] = [
        ("a", p, n) for p, n in zip(PROMPTS[:3], LENGTHS[:3], strict=True)]
    got = asyncio.run(_run(_backend(dirs, "a"), rows))
    want = [lora_models.reference(dirs, "a", p, n) for _, p, n in rows]
    assert got == want
    # and the adapter matters: the base's tokens differ
    assert want != [lora_models.reference(dirs, None, p, n) for _, p, n in rows]


def test_base_and_two_adapters_in_one_batch_equal_peft_generate(dirs: dict[str, Path]) -> None:
    # Six sequences through four slots: rows of three kinds share decode steps, and later
    # ones join while others run.
    kinds: list[str | None] = [None, "a", "b", "b", None, "a"]
    rows = list(zip(kinds, PROMPTS, LENGTHS, strict=True))
    backend = _backend(dirs, "a", "b")
    got = asyncio.run(_run(backend, rows))
    assert got == [lora_models.reference(dirs, k, p, n) for k, p, n in rows]
    # every row looked up the prefix cache; none shares a block with another of its kind
    assert backend.prefix.queried_tokens == sum(len(p) for _, p, _ in rows)
    assert backend.prefix.hit_tokens == 0


async def _one(engine: Engine, adapter: str | None, prompt: str, n: int
               ) -> tuple[list[int], int]:
    """One greedy request's tokens and the prompt tokens it found in the prefix cache."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    chunks = [c async for c in engine.generate(engine.backend.encode(prompt), params,
                                               adapter=adapter)]
    return [t for c in chunks for t in c.token_ids], chunks[-1].cached_tokens


def test_an_adapter_row_hits_only_blocks_of_its_adapter_and_still_equals_peft_generate(
        dirs: dict[str, Path]) -> None:
    # A long base row runs throughout. The first "a" row leaves SHARED's blocks; then, in
    # one batch with the base row, a second "a" row sharing them hits, while a "b" row and
    # a base row with the very same prompt as the first "a" row must not.
    backend = _backend(dirs, "a", "b")
    steps: list[set[str | None]] = []
    decode = backend.decode

    def recording(slots: list[int], tokens: list[int], *,
                  adapters: list[str | None] | None = None) -> Any:
        steps.append(set(adapters or [None]))
        return decode(slots, tokens, adapters=adapters)

    backend.decode = recording
    first: list[tuple[str | None, str, int]] = [(None, "the end of the line", 40),
                                                ("a", SHARED + "one?", 3)]
    then: list[tuple[str | None, str, int]] = [
        ("a", SHARED + "two, longer?", 12), ("b", SHARED + "one?", 10),
        (None, SHARED + "one?", 8)]

    async def scenario() -> list[tuple[list[int], int]]:
        engine, filled = Engine(backend, EngineConfig(max_num_seqs=4)), asyncio.Event()

        async def filling() -> tuple[list[int], int]:
            try:
                return await _one(engine, *first[1])
            finally:
                filled.set()

        async def after(row: tuple[str | None, str, int]) -> tuple[list[int], int]:
            await filled.wait()
            return await _one(engine, *row)

        try:
            return list(await asyncio.gather(_one(engine, *first[0]), filling(),
                                             *(after(row) for row in then)))
        finally:
            await engine.close()

    results, rows = asyncio.run(scenario()), [*first, *then]
    assert [tokens for tokens, _ in results] == [
        lora_models.reference(dirs, k, p, n) for k, p, n in rows]
    # Only the second "a" row hits: SHARED's two full blocks, computed under "a".
    assert [cached for _, cached in results] == [0, 0, 32, 0, 0]
    assert backend.prefix.hit_tokens == 32
    assert backend.prefix.queried_tokens == sum(len(p) for _, p, _ in rows)
    assert {None, "a", "b"} in steps  # the hit row decoded in one batch with base and "b"


def test_an_evicted_adapter_loaded_again_with_other_weights_never_meets_its_old_blocks(
        dirs: dict[str, Path]) -> None:
    from ember.deployments.textgen import Generator

    backend = _hf.TransformersBackend.from_directory(dirs["base"])
    backend.eos_token_id = None
    generator = Generator(backend, EngineConfig(max_num_seqs=2), max_adapters=1,
                          adapters={"x": dirs["a"].as_uri(), "y": dirs["b"].as_uri()})

    async def ask(adapter: str, prompt: str) -> tuple[list[int], int]:
        await generator.acquire(adapter)  # as a request does: held while it runs
        try:
            return await _one(generator.engine, adapter, prompt, 5)
        finally:
            generator.store.release(adapter)

    async def scenario() -> list[tuple[list[int], int]]:
        try:
            out = [await ask("x", SHARED + "one?"), await ask("x", SHARED + "two?")]
            loaded = backend.lora.identity("x")
            assert loaded in backend.prefix.spaces()
            out.append(await ask("y", SHARED + "one?"))  # one adapter per replica: x goes
            assert backend.prefix.spaces() == {backend.lora.identity("y")}  # x's dropped
            generator.adapters["x"] = dirs["b"].as_uri()  # the same name, other weights
            out.append(await ask("x", SHARED + "one?"))
            assert backend.lora.identity("x") != loaded
            return out
        finally:
            await generator.engine.close()

    results = asyncio.run(scenario())
    refs = [("a", "one?"), ("a", "two?"), ("b", "one?"), ("b", "one?")]
    assert [tokens for tokens, _ in results] == [
        lora_models.reference(dirs, name, SHARED + q, 5) for name, q in refs]
    # x's second request hits its first's blocks; the reloaded x starts cold
    assert [cached for _, cached in results] == [0, 32, 0, 0]


def test_spaces_share_one_lru_and_dropping_one_takes_only_its_blocks() -> None:
    cache, tokens = PrefixCache(block_tokens=2, max_blocks=4), [1, 2, 3, 4]
    kv = [torch.zeros(1, 1, 4, 2)]
    cache.insert(tokens, kv, kv)
    cache.insert(tokens, kv, kv, space=("a", 1))
    assert cache.match([*tokens, 5], space=("a", 2)) == []  # another load of "a"
    assert len(cache.match([*tokens, 5], space=("a", 1))) == 2  # now used last
    cache.insert(tokens, kv, kv, space=("b", 1))
    # Over the limit: the least recently used leaves went, the base's leaf then its parent.
    assert cache.spaces() == {("a", 1), ("b", 1)} and len(cache) == 4
    cache.drop(("a", 1))
    assert cache.spaces() == {("b", 1)} and len(cache) == 2
    assert len(cache.match([*tokens, 5], space=("b", 1))) == 2


def test_an_adapter_for_another_base_is_refused_with_400(dirs: dict[str, Path]) -> None:
    backend = _backend(dirs, "a")
    with pytest.raises(BadRequest, match="does not fit the base") as err:
        backend.lora.check("other", fetch(dirs["other"].as_uri()))
    assert err.value.status_code == 400
    assert list(backend.lora.peft.peft_config) == ["a"]
    # Past the check (as a later peft might fail), a failed add leaves nothing behind.
    with pytest.raises(RuntimeError, match="size mismatch"):
        backend.lora.add("other", fetch(dirs["other"].as_uri()))
    assert list(backend.lora.peft.peft_config) == ["a"]
    assert asyncio.run(_run(backend, [("a", "hello", 5)])) == [
        lora_models.reference(dirs, "a", "hello", 5)]


def test_the_lru_never_evicts_an_adapter_a_request_holds() -> None:
    loaded: list[str] = []

    def load(name: str) -> str:
        loaded.append(name)
        return name

    store = AdapterStore(2, load=load, unload=lambda n, _: loaded.remove(n))
    store.acquire("a")  # held by a running sequence
    with store.hold("b"):
        pass
    with store.hold("c"):  # over the limit: b (free) goes, a (held, older) stays
        assert loaded == ["a", "c"]
        with store.hold("d"):  # a and c held: over the limit until one is released
            assert loaded == ["a", "c", "d"]
        assert loaded == ["a", "c"]  # d released: back to the limit, a still held
    store.release("a")
    with store.hold("e"):
        assert loaded == ["c", "e"]  # now a, least recently used and free, goes


def test_a_failed_load_evicts_nothing() -> None:
    def load(name: str) -> str:
        if name == "bad":
            raise BadRequest("does not fit")
        return name

    store = AdapterStore(1, load=load, unload=lambda n, _: None)
    store.acquire("a")
    store.release("a")
    with pytest.raises(BadRequest):
        store.acquire("bad")
    assert store.names() == ["a"]


def _client(dirs: dict[str, Path], **adapters: str) -> tuple[Any, Any, Any]:
    """The OpenAI routes over a generator with ``adapters`` (name to directory), in-process."""
    import httpx
    import openai
    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry

    from ember.deployments.textgen import Generator
    from ember.edge._asgi import install_error_handlers
    from ember.protocols import OpenAIGeneration

    class Gateway:
        registry = CollectorRegistry()
        model_ids: list[str | None] = []

        async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any:
            raise AssertionError("generation streams; it never calls")

        async def stream(self, deployment: str, attr: str, body: Any, request_id: str, *,
                         model_id: str | None = None) -> Any:
            self.model_ids.append(model_id)
            async for chunk in generator.stream(body):
                yield chunk

        def ready(self) -> bool:
            return True

    backend = _hf.TransformersBackend.from_directory(dirs["base"])
    generator = Generator(backend, EngineConfig(max_num_seqs=4), max_adapters=2,
                          adapters={n: dirs[d].as_uri() for n, d in adapters.items()})
    gateway, api = Gateway(), FastAPI()
    install_error_handlers(api, lambda path, reason: None)
    OpenAIGeneration(deployment="TextGen", attr="generate", model="base",
                     adapters=(*adapters, "ghost")).install(api, gateway)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t")
    client = openai.AsyncOpenAI(api_key="none", base_url="http://t/v1",
                                http_client=http)  # type: ignore[arg-type]
    return client, gateway, generator


def test_the_openai_routes_serve_adapters_and_refuse_unknown_and_misfit_ones(
        dirs: dict[str, Path]) -> None:
    import openai
    from prometheus_client import generate_latest

    client, gateway, generator = _client(dirs, sql="a", chat="b", wrong="other")

    async def text(model: str) -> str:
        reply = await client.completions.create(model=model, prompt="hello", max_tokens=6,
                                                temperature=0, extra_body={"ignore_eos": True})
        assert reply.model == model
        return str(reply.choices[0].text)

    async def scenario() -> None:
        listed = await client.models.list()
        parents = {m.id: getattr(m, "parent", None) for m in listed.data}
        assert parents == {"base": None, "sql": "base", "chat": "base", "wrong": "base",
                           "ghost": "base"}
        got = {m: await text(m) for m in ("sql", "chat", "base")}
        decode = generator.backend.tokenizer.decode
        want = {m: decode(lora_models.reference(dirs, a, "hello", 6), skip_special_tokens=True)
                for m, a in (("sql", "a"), ("chat", "b"), ("base", None))}
        assert got == want
        assert gateway.model_ids == ["sql", "chat", None]  # routed by adapter, base not
        with pytest.raises(openai.NotFoundError, match="nowhere"):
            await text("nowhere")
        with pytest.raises(openai.NotFoundError, match="ghost"):  # listed at the edge only
            await text("ghost")
        with pytest.raises(openai.BadRequestError, match="does not fit the base"):
            await text("wrong")
        assert generator.store.names() == ["sql", "chat"]  # the misfit evicted nothing

    asyncio.run(scenario())
    metrics = generate_latest(gateway.registry).decode()
    for model in ("sql", "chat"):
        assert f'ember_lora_adapter_load_seconds_count{{model="{model}"}} 1.0' in metrics
    assert 'ember_lora_adapter_load_seconds_count{model="wrong"}' not in metrics


def test_adapter_prefix_hits_reach_the_openai_usage_and_the_hit_rate_metric(
        dirs: dict[str, Path]) -> None:
    from prometheus_client import generate_latest

    client, gateway, _ = _client(dirs, sql="a")

    async def cached(model: str, question: str) -> int:
        reply = await client.completions.create(model=model, prompt=SHARED + question,
                                                max_tokens=3, temperature=0)
        return int(reply.usage.prompt_tokens_details.cached_tokens)

    async def scenario() -> list[int]:
        return [await cached("sql", "one?"), await cached("sql", "two?"),
                await cached("base", "one?")]

    assert asyncio.run(scenario()) == [0, 32, 0]  # the base never hits the adapter's blocks
    metrics = generate_latest(gateway.registry).decode()
    assert 'ember_prefix_cache_hit_tokens_total{model="sql"} 32.0' in metrics
    assert 'ember_prefix_cache_hit_tokens_total{model="base"} 0.0' in metrics


def test_a_cold_load_never_holds_up_a_request_for_a_loaded_adapter() -> None:
    started, slow = threading.Event(), threading.Event()

    def load(name: str) -> str:
        if name == "slow":
            started.set()
            assert slow.wait(60)
        return name

    store = AdapterStore(2, load=load, unload=lambda n, _: None)
    store.acquire("a")
    store.release("a")
    loading = threading.Thread(target=store.acquire, args=("slow",))
    loading.start()
    got: list[tuple[str, float | None]] = []
    try:
        assert started.wait(30)
        warm = threading.Thread(target=lambda: got.append(store.acquire("a")))
        warm.start()
        warm.join(10)  # generous: it waits for nothing
        assert got == [("a", None)]  # while "slow" is still loading
    finally:
        slow.set()
        loading.join(60)
    assert store.names() == ["a", "slow"]
