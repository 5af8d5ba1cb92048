"""The S3 source's botocore client, against moto's server on loopback: a process that
warmed it (as a warm-runtime worker does) builds a load's client without parsing botocore's
S3 model again, and the load still reads every byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ember.loaders import LoaderConfig, load, warm_s3_client

from loaders.origins import make_weights, s3_options


def test_a_warmed_process_builds_the_loads_client_without_reading_botocores_model_files(
    s3: Any, s3_endpoint: str, tmp_path: Path, config: LoaderConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import botocore.loaders

    assert warm_s3_client()
    local = tmp_path / "up" / "model.safetensors"
    tensors = make_weights(local, n=4)
    s3.put_file(str(local), f"{s3.bucket}/warm/model.safetensors")
    reads: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counting(self: Any, file_path: str) -> Any:
        reads.append(file_path)
        return real(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counting)
    # A region no other test uses: the source must build a client of its own.
    options = {**s3_options(s3_endpoint),
               "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "eu-north-1"}}
    got = load(f"s3://{s3.bucket}/warm/", config=config.model_copy(
        update={"storage_options": options}))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert reads == [], f"the client parsed botocore's model files again: {reads}"
