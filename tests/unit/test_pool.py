"""The warm pool's bounds, run in this process: bytes of model memory, per-deployment caps,
and a failing preload that stays that deployment's problem."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

import ember
from ember.app.decorator import get_spec
from ember.control.pool import EmberPool, PoolAnswer, model_bytes
from ember.errors import ConfigError

T = TypeVar("T")
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a GPU node; restored after each test (the pool empties it in this process).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def _model(name: str, mib: int) -> type:
    @ember.deployment(name=name, max_ongoing_requests=2)
    class Model:
        def setup(self) -> None:
            self.net = torch.nn.Linear(mib * MIB // 4, 1, bias=False)  # mib MiB of float32

        async def __call__(self) -> str:
            await asyncio.sleep(0.05)
            return name

    return Model


@ember.deployment(name="Broken", preload=True)
class Broken:
    def setup(self) -> None:
        raise OSError("weights not found")

    def __call__(self) -> str:
        return "never"


A, B, C = _model("A", 4), _model("B", 4), _model("C", 4)


@ember.deployment(name="Gpu", num_gpus=1, max_ongoing_requests=2)
class Gpu:
    def setup(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Linear(256, 256)  # 257 KiB of float32

    def __call__(self, x: list[float]) -> list[float]:
        with torch.inference_mode():
            return self.net(torch.tensor(x)).tolist()  # type: ignore[no-any-return]


async def _pool(*classes: type, preload: tuple[str, ...] = (), max_bytes: int,
                gpu: bool = False, park_after_s: float = 10.0) -> EmberPool:
    pool = EmberPool.__new__(EmberPool)
    await pool.__init__([get_spec(c) for c in classes], list(preload), max_bytes,  # type: ignore[misc]
                        gpu=gpu, park_after_s=park_after_s)
    return pool


def test_the_pool_process_sees_no_gpu() -> None:
    _run(_pool(A, max_bytes=MIB))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_the_gpu_pool_leaves_the_gpus_visible() -> None:
    _run(_pool(Gpu, max_bytes=MIB, gpu=True))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_gpu_model_is_parked_moved_for_requests_and_parked_again_when_idle() -> None:
    x = [0.5] * 256
    torch.manual_seed(0)
    expected = torch.nn.Linear(256, 256)(torch.tensor(x)).tolist()

    async def scenario() -> list[Any]:
        pool = await _pool(Gpu, preload=("Gpu",), max_bytes=MIB, gpu=True, park_after_s=0.2)
        parked = await pool.ember_ping()
        first = await pool.ember_call("Gpu", "__call__", x)
        served = await pool.ember_ping()
        await asyncio.sleep(0.6)  # idle past park_after_s
        idle = await pool.ember_ping()
        again = await pool.ember_call("Gpu", "__call__", x)
        return [parked, first, served, idle, again]

    parked, first, served, idle, again = _run(scenario())
    assert parked["on_device"] == [] and parked["bytes"] == {"Gpu": (256 * 256 + 256) * 4}
    assert first.value == expected and first.timeline["device_s"] > 0
    assert served["on_device"] == ["Gpu"]
    assert served["moves"]["Gpu"]["bytes"] == (256 * 256 + 256) * 4
    assert served["moves"]["Gpu"]["staged_copies"] == 2  # weight and bias, each in one piece
    assert idle["on_device"] == []
    assert again.value == expected and again.timeline["device_s"] > 0


def test_model_bytes_counts_parameters_and_bare_tensors_once() -> None:
    class Impl:
        def __init__(self) -> None:
            self.net = torch.nn.Linear(256, 4)       # 256*4*4 + 4*4 bytes
            self.table = torch.zeros(100)             # 400 bytes
            self.alias = self.net.weight              # shared storage, not counted twice
            self.name = "not a tensor"

    assert model_bytes(Impl()) == 256 * 4 * 4 + 4 * 4 + 400


def test_least_recently_used_model_goes_when_the_bytes_are_full() -> None:
    async def scenario() -> dict[str, Any]:
        pool = await _pool(A, B, C, max_bytes=9 * MIB)  # room for two 4 MiB models
        for name in ("A", "B", "A", "C"):  # B is the least recently used when C comes
            answer = await pool.ember_call(name, "__call__", None)
            assert answer == PoolAnswer(False, name, answer.timeline)
        return await pool.ember_ping()

    ping = _run(scenario())
    assert ping["models"] == ["A", "C"]
    assert ping["bytes"] == {"A": 4 * MIB, "C": 4 * MIB}


def test_past_its_deployments_concurrency_the_pool_answers_busy() -> None:
    async def scenario() -> list[bool]:
        pool = await _pool(A, max_bytes=64 * MIB)
        answers = await asyncio.gather(*(pool.ember_call("A", "__call__", None)
                                         for _ in range(5)))
        return [a.busy for a in answers]

    # A takes max_ongoing_requests=2 at once, as one of its own replicas would.
    assert sorted(_run(scenario())) == [False, False, True, True, True]


def test_a_failing_preload_marks_only_its_deployment() -> None:
    async def scenario() -> tuple[PoolAnswer, PoolAnswer, dict[str, Any]]:
        pool = await _pool(Broken, A, preload=("Broken", "A"), max_bytes=64 * MIB)
        broken = await pool.ember_call("Broken", "__call__", None)
        fine = await pool.ember_call("A", "__call__", None)
        return broken, fine, await pool.ember_ping()

    broken, fine, ping = _run(scenario())
    assert broken.busy and not fine.busy and fine.value == "A"
    assert ping["failed"] == {
        "Broken": "warm pool preload failed: OSError: weights not found"}
    assert ping["models"] == ["A"]


def test_negative_pool_bytes_are_refused() -> None:
    with pytest.raises(ConfigError, match="warm_pool_bytes"):
        ember.App([A], warm_pool_bytes=-1)
