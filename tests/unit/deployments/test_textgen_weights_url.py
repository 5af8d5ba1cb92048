"""A generation model named by a weights URL loads through Ember's loaders: mapped from the
node cache (its parameters are views on the cache's blobs, no copy), restored from the node's
snapshot by the next replica, and generating exactly what the same model loaded with
``from_pretrained`` generates, for every architecture the engine runs."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.deployments._textgen_engine import Engine, EngineConfig
from ember.deployments._textgen_sampling import SamplingParams

import lora_models

pytestmark = pytest.mark.slow  # transformers' import alone takes seconds

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
_hf = pytest.importorskip("ember.deployments._textgen_hf")
TransformersBackend = _hf.TransformersBackend

PROMPTS = ["hello", "the end of the line", "0123456789 abcdefghij", "Qq"]
LENGTHS = [9, 5, 14, 3]


def _config(arch: str) -> Any:
    small = {"vocab_size": 128, "bos_token_id": None, "eos_token_id": 127}
    if arch == "gpt2":  # ties lm_head to the token embedding: the checkpoint holds it once
        return transformers.GPT2Config(n_positions=128, n_embd=32, n_layer=2, n_head=2,
                                       initializer_range=0.2, **small)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               initializer_range=0.2, **small)


@pytest.fixture(scope="module", params=["llama", "gpt2", "qwen2"])
def model_dir(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random model and its tokenizer, saved as ``save_pretrained`` saves them."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(str(request.param))
    transformers.AutoModelForCausalLM.from_config(_config(str(request.param))).save_pretrained(
        path)
    lora_models.tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = tmp_path / "node-cache"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(root))
    yield root


async def _greedy(backend: Any) -> list[list[int]]:
    backend.eos_token_id = None  # every sequence runs to its length
    engine = Engine(backend, EngineConfig(max_num_seqs=2))

    async def one(prompt: str, n: int) -> list[int]:
        params = SamplingParams(max_tokens=n, temperature=0)
        return [t async for c in engine.generate(backend.encode(prompt), params)
                for t in c.token_ids]

    outs = await asyncio.gather(*(one(p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)))
    await engine.close()
    return list(outs)


def _mapped_files() -> list[tuple[int, int, str]]:
    """This process's file mappings: (start, end, path)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end, fields[5]))
    return spans


def test_a_weights_url_generates_what_from_pretrained_does_from_mapped_cache_pages(
        model_dir: Path, cache: Path) -> None:
    got = TransformersBackend.from_url(model_dir.as_uri() + "/")
    want = TransformersBackend.from_directory(model_dir)
    outs = asyncio.run(_greedy(got))
    assert outs == asyncio.run(_greedy(want))
    assert len({t for out in outs for t in out}) > 4  # not one repeated token
    # Built in bf16 on meta, holding the float32 checkpoint's tensors: the config says so,
    # as from_pretrained's does.
    assert got.model.config.dtype == want.model.config.dtype == torch.float32
    assert {p.dtype for p in got.model.parameters()} == {torch.float32}
    # Every parameter lies in a mapping of a blob of the node cache: the loaders mapped
    # them, nothing copied them (from_pretrained's own tensors would fail this).
    blobs = [(s, e) for s, e, path in _mapped_files() if path.startswith(str(cache))]
    assert blobs
    for name, param in got.model.named_parameters():
        ptr = param.untyped_storage().data_ptr()
        assert any(s <= ptr < e for s, e in blobs), name
    report = got.load_report
    assert report is not None and not report.restored
    assert report.weights_bytes == (model_dir / "model.safetensors").stat().st_size
    assert {"check", "map", "construct", "pages_wait", "assign"} <= set(report.phases_s)


def test_the_next_load_of_the_url_is_restored_from_the_nodes_snapshot(
        model_dir: Path, cache: Path) -> None:
    from ember.loaders import wait_for_cache_writes

    url = model_dir.as_uri() + "/"
    first = TransformersBackend.from_url(url)
    assert wait_for_cache_writes(timeout_s=60)  # the snapshot is recorded once filled
    again = TransformersBackend.from_url(url)
    assert first.load_report is not None and not first.load_report.restored
    assert again.load_report is not None and again.load_report.restored
    assert asyncio.run(_greedy(again)) == asyncio.run(_greedy(first))


def test_weights_without_a_tokenizer_are_refused_naming_what_was_looked_for(
        model_dir: Path, cache: Path, tmp_path: Path) -> None:
    from ember.errors import WeightsNotFound

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    with pytest.raises(WeightsNotFound, match="no tokenizer beside the weights") as err:
        TransformersBackend.from_url(bare.as_uri() + "/")
    assert err.value.status_code == 404 and "tokenizer.json" in str(err.value)


def test_the_textgen_app_loads_a_weights_url_through_the_loaders(
        model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.deployments.textgen import load_backend, served_model

    url = model_dir.as_uri() + "/"
    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", url)
    assert served_model() == (url, model_dir.name)
    backend = load_backend(url)
    assert isinstance(backend, TransformersBackend) and backend.load_report is not None
    monkeypatch.setenv("EMBER_TEXTGEN_MODEL", (model_dir / "model.safetensors").as_uri())
    assert served_model()[1] == model_dir.name
    # A plain directory is still read with from_pretrained, as before.
    plain = load_backend(str(model_dir))
    assert isinstance(plain, TransformersBackend) and plain.load_report is None


def test_a_checkpoint_missing_an_untied_weight_is_refused_by_name(
        model_dir: Path, cache: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from ember.errors import HeaderInvalid

    partial = tmp_path / "partial"
    shutil.copytree(model_dir, partial)
    tensors = load_file(partial / "model.safetensors")
    dropped = sorted(name for name in tensors if name.endswith("mlp.c_fc.weight")
                     or name.endswith("mlp.up_proj.weight"))[0]
    del tensors[dropped]
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HeaderInvalid, match=re.escape(dropped)):
        TransformersBackend.from_url(partial.as_uri() + "/")


def test_the_output_head_gets_its_input_laid_out_densely(model_dir: Path, cache: Path) -> None:
    # The last position as a slice of the prompt's hidden states takes a far slower CPU path
    # in torch's linear for weights that need no grad (_textgen_hf._dense_input).
    backend = TransformersBackend.from_url(model_dir.as_uri() + "/")
    seen: list[tuple[torch.Size, tuple[int, ...]]] = []
    head = backend.model.get_output_embeddings()
    head.register_forward_pre_hook(lambda _, args: seen.append((args[0].shape,
                                                                args[0].stride())))
    backend.allocate(1)
    backend.prefill(0, backend.encode("0123456789 abc"))
    assert seen and seen[-1][0][1] == 1  # only the last position reaches the head
    shape, stride = seen[-1]
    assert stride == torch.empty(shape).stride()


def test_warmup_leaves_the_grammar_tokenizer_to_an_idle_engine_and_a_request_waits_for_it(
        model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ember.deployments import _textgen_grammar as grammar
    from ember.deployments.textgen import ENGINE, Generator

    release, builds = threading.Event(), []
    real = grammar._hf_tokenizer

    def slow(tokenizer: Any) -> Any:  # a vocabulary walk that takes as long as the test says
        builds.append(threading.current_thread().name)
        assert release.wait(30)
        return real(tokenizer)

    monkeypatch.setattr(grammar, "_hf_tokenizer", slow)
    generator = Generator(TransformersBackend.from_url(model_dir.as_uri() + "/"), ENGINE)
    warmed = threading.Thread(target=generator.warmup)
    warmed.start()
    warmed.join(20)
    assert not warmed.is_alive(), "warmup waited for the grammar tokenizer"
    deadline = time.monotonic() + 30  # the engine is idle: the thread starts the build
    while not builds and time.monotonic() < deadline:
        time.sleep(0.05)
    asked: list[Any] = []
    request = threading.Thread(target=lambda: asked.append(
        grammar.tokenizer_for(generator.backend)))
    request.start()
    release.set()
    request.join(30)
    assert asked and builds == ["ember-grammar-tokenizer"]  # built once, by the thread


def test_the_grammar_tokenizer_is_not_built_while_the_engine_has_work(
        model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from ember.deployments import _textgen_grammar as grammar
    from ember.deployments import textgen
    from ember.deployments.textgen import ENGINE, Generator

    built = threading.Event()
    monkeypatch.setattr(grammar, "_hf_tokenizer", lambda tokenizer: built.set())
    monkeypatch.setattr(textgen, "GRAMMAR_AFTER_IDLE_S", 0.3)
    generator = Generator(TransformersBackend.from_url(model_dir.as_uri() + "/"), ENGINE)
    busy = [object()]
    monkeypatch.setattr(generator.engine, "_waiting", busy)  # a request waits
    generator.warmup()
    assert not built.wait(1.5)  # five idle periods: nothing built while the request waits
    busy.clear()
    assert built.wait(10)


def test_a_missing_persistent_buffer_is_refused_not_rebuilt_at_random() -> None:
    from ember.deployments.causal_lm import assign_weights
    from ember.errors import HeaderInvalid

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2))  # persistent: in the checkpoint

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(HeaderInvalid, match="scale"):
        assign_weights(model, {"lin.weight": torch.ones(2, 2), "lin.bias": torch.zeros(2)})


def test_warmup_on_cpu_runs_no_forward_pass_but_torchs_exercise(
        model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ember.deployments import textgen
    from ember.deployments.textgen import ENGINE, Generator

    backend = TransformersBackend.from_url(model_dir.as_uri() + "/")
    forwards: list[int] = []
    real = backend.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        forwards.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.model, "forward", counted)
    monkeypatch.delitem(sys.modules, "ember.control.torch_warm", raising=False)
    # No tokenizer build here: a thread left waiting would build under a later test's patches.
    monkeypatch.setattr(Generator, "_grammar_when_idle", lambda self: None)
    Generator(backend, ENGINE).warmup()
    assert forwards == []  # a request at zero would have waited for them
    assert "ember.control.torch_warm" in sys.modules
    assert not textgen._on_accelerator(backend)
    assert textgen._on_accelerator(TransformersBackend(backend.model.to("meta"),
                                                       backend.tokenizer))


def test_the_kv_caches_at_full_load_are_the_bytes_the_fit_check_counts(
        model_dir: Path, cache: Path) -> None:
    backend = TransformersBackend.from_url(model_dir.as_uri() + "/")
    asyncio.run(_greedy(backend))  # two slots; every prompt's full blocks cached
    # The checkpoint's config, which the fit check reads (its dtype is the tensors').
    table, config = backend.table, transformers.AutoConfig.from_pretrained(model_dir)
    assert table is not None and backend.prefix is not None and len(backend.prefix)
    table._grow(table.max_columns)  # every row at the table's full width
    held = sum(t.untyped_storage().nbytes() for t in (*table.keys, *table.values))
    assert held == _hf.cache_bytes(config, slots=2, max_len=1024, prefix_blocks=0)
    block = next(iter(backend.prefix._blocks.values()))
    assert sum(t.nbytes for t in (*block.keys, *block.values)) == _hf.cache_bytes(
        config, slots=0, max_len=1024, prefix_blocks=1)


def test_a_replica_whose_kv_caches_cannot_fit_beside_its_weights_is_refused_before_loading(
        model_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.deployments import causal_lm
    from ember.errors import InsufficientMemory

    url = model_dir.as_uri() + "/"
    weights = (model_dir / "model.safetensors").stat().st_size
    config = transformers.AutoConfig.from_pretrained(model_dir)
    kv = _hf.cache_bytes(config, slots=16, max_len=1024)
    assert kv > weights  # a small model's caches at full load outweigh it
    monkeypatch.setattr(causal_lm, "free_memory_bytes", lambda: weights + kv - 1)
    with pytest.raises(InsufficientMemory) as caught:
        TransformersBackend.from_url(url, slots=16)
    message = str(caught.value)
    assert caught.value.status_code == 503 and str(weights + kv) in message
    assert f"KV caches at full load ({kv}: 16 sequences" in message, message
    assert not list(cache.glob("*/blobs/*")), "weights were fetched before the refusal"
    # Without the engine's slots the weights alone fit: the caches made the difference.
    assert TransformersBackend.from_url(url).load_report.reserved_bytes == 0
    monkeypatch.setattr(causal_lm, "free_memory_bytes", lambda: weights + kv)
    fits = TransformersBackend.from_url(url, slots=16)
    assert fits.load_report is not None and fits.load_report.reserved_bytes == kv
