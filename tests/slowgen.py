"""A generation backend slowed on purpose: every model step sleeps first, so tests of
priorities and deadlines count in steps of a known length, never in this machine's speed."""

from __future__ import annotations

import time

import torch

from ember.deployments._textgen_backend import Backend, Detokenizer


class SlowBackend(Backend):
    """``inner`` with ``step_s`` of sleep before every prefill and decode step; counts them."""

    def __init__(self, inner: Backend, step_s: float) -> None:
        self.inner, self.step_s = inner, step_s
        self.eos_token_id, self.max_len = inner.eos_token_id, inner.max_len
        #: Prompts prefilled and forks made (a request that expired waiting adds neither).
        self.prefills: list[list[int]] = []
        self.forks = 0

    def allocate(self, slots: int) -> None:
        self.inner.allocate(slots)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def detokenizer(self) -> Detokenizer:
        return self.inner.detokenizer()

    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        time.sleep(self.step_s)
        self.prefills.append(list(tokens))
        logits = self.inner.prefill(slot, tokens)
        self.cached_tokens = self.inner.cached_tokens
        return logits

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        time.sleep(self.step_s)
        return self.inner.decode(slots, tokens)

    def move(self, src: int, dst: int) -> None:
        self.inner.move(src, dst)

    def fork(self, src: int, dst: int) -> None:
        self.forks += 1
        self.inner.fork(src, dst)

    def free(self, slot: int) -> None:
        self.inner.free(slot)
