"""The engine runs any ``transformers`` causal LM with one fused forward per decode step, and
its greedy tokens are ``model.generate()``'s, alone or in mixed batches joining mid-run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_sampling import SamplingParams
from ember.deployments._textgen_slots import SlotTable

# Importing transformers alone takes a few seconds.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
_hf = pytest.importorskip("ember.deployments._textgen_hf")
TransformersBackend = _hf.TransformersBackend

PROMPTS = ["hello", "a", "the end of the line", "xyz", "0123456789 abcdefghij", "Qq", "mid"]
LENGTHS = [7, 12, 3, 9, 20, 1, 14]
ARCHS = ["llama", "gpt2", "qwen2", "mistral"]


def _tokenizer() -> Any:
    """One token per printable character, an end-of-sequence token at 127."""
    vocab = {chr(i): i for i in range(32, 127)} | {"<eos>": 127}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _config(arch: str) -> Any:
    small = {"vocab_size": 128, "bos_token_id": None, "eos_token_id": 127}
    if arch == "gpt2":
        return transformers.GPT2Config(n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                       initializer_range=0.2, **small)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    # Two query heads per key/value head, so grouped-query attention is exercised too.
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               initializer_range=0.2, **small)


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded random model and a character tokenizer, saved as a model directory is.

    Weights drawn wide (``initializer_range=0.2``) so greedy outputs vary from token to token
    instead of repeating one character: a wrong position or mask shows at once.
    """
    arch = str(request.param)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(arch)
    transformers.AutoModelForCausalLM.from_config(_config(arch)).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def _backend(path: Path, *, columns: int | None = None) -> Any:
    backend = TransformersBackend.from_directory(path)
    backend.eos_token_id = None  # run every sequence to its length
    if columns is not None:  # a narrow cache: every few steps it grows or packs its rows
        original = backend.allocate

        def allocate(slots: int) -> None:
            original(slots)
            backend.table = SlotTable(backend.n_layers, slots, max_columns=columns,
                                      initial_columns=8)

        backend.allocate = allocate
    return backend


def _reference(backend: Any, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([backend.encode(prompt)])
    out = backend.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
    return list(out[0, ids.shape[1]:].tolist())


async def _generate(backend: Any, max_num_seqs: int, *, stagger: bool = False,
                    lengths: list[int] = LENGTHS) -> list[list[int]]:
    engine = Engine(backend, EngineConfig(max_num_seqs=max_num_seqs))

    async def one(i: int, prompt: str, n: int) -> list[int]:
        if stagger:  # later requests arrive while earlier ones are mid-decode
            deadline = asyncio.get_running_loop().time() + 60
            while engine.steps < 2 * i and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.001)
        params = SamplingParams(max_tokens=n, temperature=0)
        return [t async for c in engine.generate(backend.encode(prompt), params)
                for t in c.token_ids]

    outs = await asyncio.gather(*(one(i, p, n) for i, (p, n) in
                                  enumerate(zip(PROMPTS, lengths, strict=True))))
    await engine.close()
    return list(outs)


def test_greedy_equals_generate_one_at_a_time(model_dir: Path) -> None:
    backend = _backend(model_dir)
    alone = asyncio.run(_generate(backend, 1))
    want = [_reference(backend, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    assert alone == want
    assert len({t for out in want for t in out}) > 8  # the outputs are not one repeated token


def test_greedy_equals_generate_in_mixed_batches_joining_mid_run(model_dir: Path) -> None:
    lengths = [7, 30, 3, 9, 20, 1, 34]  # long enough that the 44 columns run out
    backend = _backend(model_dir, columns=44)
    batched = asyncio.run(_generate(backend, 3, stagger=True, lengths=lengths))
    want = [_reference(backend, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    assert batched == want and [len(t) for t in batched] == lengths
    assert backend.table.compactions > 0 and backend.table.capacity == 44


def test_greedy_equals_generate_when_prompts_arrive_together_and_are_packed(
        model_dir: Path) -> None:
    backend = _backend(model_dir)
    backend.max_pack_tokens = 24  # the seven prompts (54 tokens) make three packed forwards
    together = asyncio.run(_generate(backend, len(PROMPTS)))
    want = [_reference(backend, p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    assert together == want


def test_a_step_is_one_forward_for_every_running_sequence_and_one_for_new_prompts(
        model_dir: Path) -> None:
    backend = _backend(model_dir)
    calls: list[tuple[int, int]] = []
    forward = backend.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    backend.model.forward = counted
    engine = Engine(backend, EngineConfig(max_num_seqs=4))

    async def run() -> None:
        params = SamplingParams(max_tokens=6, temperature=0)
        await asyncio.gather(*(_drain(engine.generate(backend.encode(p), params))
                               for p in PROMPTS[:4]))
        await engine.close()

    asyncio.run(run())
    # The four prompts admitted together are laid end to end in one prefill forward.
    packed = sum(len(backend.encode(p)) for p in PROMPTS[:4])
    assert calls[0] == (1, packed), calls
    assert calls[1:] == [(4, 1)] * 5 and engine.steps == 6  # 4 rows in each decode step


async def _drain(chunks: Any) -> None:
    async for _ in chunks:
        pass


def test_missing_model_directory_is_not_downloaded(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        TransformersBackend.from_directory(tmp_path / "nothing-here")


def test_the_textgen_app_serves_the_model_ember_textgen_model_names(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.deployments.textgen import load_backend, served_model

    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", str(model_dir))
    where, name = served_model()
    assert (where, name) == (str(model_dir), model_dir.name)
    assert isinstance(load_backend(where), TransformersBackend)
    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", "hf://org/tiny@main")
    assert served_model() == ("hf://org/tiny@main", "org/tiny")


SHARED = "You are a careful assistant. Answer briefly. "  # 45 tokens: two full blocks and more


def test_greedy_equals_generate_with_and_without_a_prefix_cache_hit(model_dir: Path) -> None:
    backend = _backend(model_dir)
    prompts = [SHARED + "first?", SHARED + "second, longer question?", SHARED[:20] + "z",
               SHARED + "first?"]
    lengths = [9, 6, 11, 9]

    async def run() -> list[list[int]]:
        engine = Engine(backend, EngineConfig(max_num_seqs=2))
        params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
        outs = []
        for prompt, p in zip(prompts, params, strict=True):  # one after another: later ones hit
            outs.append([t async for c in engine.generate(backend.encode(prompt), p)
                         for t in c.token_ids])
        await engine.close()
        return outs

    got = asyncio.run(run())
    want = [_reference(backend, p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert got == want
    assert backend.prefix.block_tokens == 16
    # Each prompt hits the full blocks it shares with an earlier one (never its last token,
    # which must be computed): with a byte-level tokenizer 2nd: SHARED's two full blocks,
    # 3rd: its first block, 4th: all three of the 1st's. Counted from the tokens, as a BPE
    # tokenizer may split SHARED[:20] + "z" differently.
    ids = [backend.encode(p) for p in prompts]
    block = backend.prefix.block_tokens
    expected = sum(
        block * (min(max(_common(ids[i], ids[j]) for j in range(i)), len(ids[i]) - 1) // block)
        for i in range(1, len(ids)))
    assert expected >= 2 * block  # the test exercises hits at all
    assert backend.prefix.hit_tokens == expected
    assert got[0] == got[3]


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _Gateway:
    """What the edge gives a protocol adapter, with the replica's generator in-process."""

    def __init__(self, generator: Any) -> None:
        from prometheus_client import CollectorRegistry

        self.generator, self.registry = generator, CollectorRegistry()

    async def call(self, deployment: str, attr: str, body: Any, request_id: str) -> Any:
        raise AssertionError("generation streams; it never calls")

    async def stream(self, deployment: str, attr: str, body: Any, request_id: str, *,
                     model_id: str | None = None) -> Any:
        async for chunk in self.generator.stream(body):
            yield chunk

    def ready(self) -> bool:
        return True


def test_prefix_hits_reach_the_openai_usage_and_the_metrics(model_dir: Path) -> None:
    import httpx
    import openai
    from fastapi import FastAPI
    from prometheus_client import generate_latest

    from ember.deployments.textgen import Generator
    from ember.protocols import OpenAIGeneration

    gateway = _Gateway(Generator(_backend(model_dir), EngineConfig(max_num_seqs=2)))
    api = FastAPI()
    OpenAIGeneration(deployment="TextGen", attr="generate", model="m").install(api, gateway)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://t")
    oa = openai.AsyncOpenAI(api_key="none", base_url="http://t/v1",
                            http_client=http)  # type: ignore[arg-type]

    async def ask(question: str) -> Any:
        reply = await oa.completions.create(model="m", prompt=SHARED + question,
                                            max_tokens=3, temperature=0)
        return reply.usage

    first, second = asyncio.run(ask("one?")), asyncio.run(ask("two?"))
    # The full blocks the two prompts share (32 tokens with a byte-level tokenizer).
    backend = _backend(model_dir)  # the same tokenizer
    a, b = backend.encode(SHARED + "one?"), backend.encode(SHARED + "two?")
    shared = 16 * (min(_common(a, b), len(b) - 1) // 16)
    assert shared >= 16
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == shared
    metrics = generate_latest(gateway.registry).decode()
    assert f'ember_prefix_cache_hit_tokens_total{{model="m"}} {float(shared)}' in metrics
    assert f'ember_prompt_tokens_total{{model="m"}} {float(len(a) + len(b))}' in metrics


def test_n_greedy_choices_forked_from_one_prefill_each_equal_generate(model_dir: Path) -> None:
    # A running sequence first, so the prompt is placed (and forked) under a column that
    # another row already uses.
    backend = _backend(model_dir)

    async def run() -> dict[int, list[int]]:
        engine = Engine(backend, EngineConfig(max_num_seqs=4))
        first = engine.generate(backend.encode("a"), SamplingParams(max_tokens=20,
                                                                    temperature=0))
        await anext(first)
        choices: dict[int, list[int]] = {}
        async for c in engine.generate(backend.encode("hello"),
                                       SamplingParams(max_tokens=9, temperature=0), n=3):
            choices.setdefault(c.index, []).extend(c.token_ids)
        await _drain(first)
        await engine.close()
        return choices

    choices = asyncio.run(run())
    want = _reference(backend, "hello", 9)
    assert choices == {0: want, 1: want, 2: want}
