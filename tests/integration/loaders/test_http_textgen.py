"""A generation model on an HTTP origin (a stdlib server on loopback): every file it needs is
fetched once on a cold start, since each fetch is a round trip on the cold path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.loaders import LoaderConfig

from loaders.origins import HttpOrigin

transformers = pytest.importorskip("transformers")
_hf = pytest.importorskip("ember.deployments._textgen_hf")


def test_config_json_is_fetched_once_for_the_fit_check_the_model_and_the_tokenizer(
        http_origin: HttpOrigin, tmp_path: Path, config: LoaderConfig) -> None:
    import lora_models

    folder = tmp_path / "model"
    torch.manual_seed(0)
    lora_models.llama().save_pretrained(folder)
    lora_models.tokenizer().save_pretrained(folder)
    for path in folder.iterdir():
        url = http_origin.put(path.name, path.read_bytes())
    # slots: the fit check counts the KV caches, so it reads config.json before the weights.
    backend = _hf.TransformersBackend.from_url(url.rpartition("/")[0] + "/model.safetensors",
                                               config=config, slots=2)
    assert backend.load_report is not None and backend.load_report.reserved_bytes > 0
    assert len(http_origin.ranged_gets("config.json")) == 1
    assert len(http_origin.ranged_gets("tokenizer.json")) == 1
    # The tokenizer got the same config: it encodes as the folder's own does.
    want = transformers.AutoTokenizer.from_pretrained(folder)
    assert backend.tokenizer("hello")["input_ids"] == want("hello")["input_ids"]
