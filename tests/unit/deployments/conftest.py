"""Fixtures shared by the generation engine's unit tests."""

from __future__ import annotations

import pytest
import torch

from ember.deployments._tinylm import TinyLM, TinyLMConfig


@pytest.fixture(scope="module")
def model() -> TinyLM:
    """A seeded TinyLM with random weights drawn wide.

    Equality must hold for any weights, and a random model's logits are far from ties less
    often than a trained one's, so this is the harder case to pass.
    """
    torch.manual_seed(1)
    model = TinyLM(TinyLMConfig(dim=64, n_layers=2, n_heads=4, max_len=128)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    return model
