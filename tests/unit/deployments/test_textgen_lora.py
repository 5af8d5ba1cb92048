"""LoRA adapters over one base: the engine's greedy tokens are peft's ``generate()``'s, for
an adapter alone and for base and two adapters mixed in one batch; the store's LRU never
evicts an adapter a request holds, and an adapter for another base is refused untouched."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_lora import AdapterStore, fetch
from ember.deployments._textgen_sampling import SamplingParams
from ember.errors import BadRequest

# Importing transformers and peft takes a few seconds.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
peft = pytest.importorskip("peft")
_hf = pytest.importorskip("ember.deployments._textgen_hf")

PROMPTS = ["hello", "a", "the end of the line", "xyz", "0123456789 abcdefghij", "Qq"]
LENGTHS = [7, 12, 3, 9, 15, 5]


def _tokenizer() -> Any:
    """One token per printable character, an end-of-sequence token at 127."""
    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _llama(hidden: int = 64) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=128, bos_token_id=None, eos_token_id=127, hidden_size=hidden,
        intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
    return transformers.AutoModelForCausalLM.from_config(config)


def _adapter(base: Any, path: Path, seed: int, targets: list[str]) -> Path:
    """A LoRA adapter with random non-zero A and B, saved as peft saves one."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets,
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # wide enough that the adapter changes the greedy tokens
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base model directory and three adapters: two over it, one over another base."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    _llama().save_pretrained(root / "base")
    _tokenizer().save_pretrained(root / "base")
    load = transformers.AutoModelForCausalLM.from_pretrained
    return {
        "base": root / "base",
        "a": _adapter(load(root / "base"), root / "a", 1, ["q_proj", "v_proj"]),
        "b": _adapter(load(root / "base"), root / "b", 2,
                      ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]),
        "other": _adapter(_llama(hidden=32), root / "other", 3, ["q_proj", "v_proj"]),
    }


@pytest.fixture(autouse=True)
def _node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EMBER_REGIONAL_CACHE", raising=False)


def _reference(dirs: dict[str, Path], adapter: str | None, prompt: str, n: int) -> list[int]:
    """Greedy tokens of ``generate()``: the base's, or peft's over it with ``adapter``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"]).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, dirs[adapter]).eval()
    ids = torch.tensor([[ord(c) for c in prompt]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=127)
    return [int(t) for t in out[0, ids.shape[1]:]]


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
    want = [_reference(dirs, "a", p, n) for _, p, n in rows]
    assert got == want
    # and the adapter matters: the base's tokens differ
    assert want != [_reference(dirs, None, p, n) for _, p, n in rows]


def test_base_and_two_adapters_in_one_batch_equal_peft_generate(dirs: dict[str, Path]) -> None:
    # Six sequences through four slots: rows of three kinds share decode steps, and later
    # ones join while others run.
    kinds: list[str | None] = [None, "a", "b", "b", None, "a"]
    rows = list(zip(kinds, PROMPTS, LENGTHS, strict=True))
    backend = _backend(dirs, "a", "b")
    got = asyncio.run(_run(backend, rows))
    assert got == [_reference(dirs, k, p, n) for k, p, n in rows]
    # the base rows never took or left prefix blocks computed under an adapter
    assert backend.prefix.queried_tokens == sum(len(p) for k, p, _ in rows if k is None)


def test_an_adapter_for_another_base_is_refused_with_400(dirs: dict[str, Path]) -> None:
    backend = _backend(dirs, "a")
    with pytest.raises(BadRequest, match="does not fit the base") as err:
        backend.lora.check("other", fetch(dirs["other"].as_uri()))
    assert err.value.status_code == 400
    assert list(backend.lora.peft.peft_config) == ["a"]


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
        want = {m: decode(_reference(dirs, a, "hello", 6), skip_special_tokens=True)
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
