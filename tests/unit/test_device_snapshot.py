"""A GPU deployment's model parked in host memory and moved back through the staging
buffers. No GPU here: the device is the CPU, pinning is skipped and the copies are plain,
which exercises every step but the page-locking."""

from __future__ import annotations

import math

import torch

from ember.control.coldstart import ReplicaTimeline, report
from ember.control.device_snapshot import DeviceSnapshot

KIB = 1024


class Impl:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
        self.scale = torch.full((32,), 2.0)
        self.device = torch.device("cpu")
        self.name = "not a tensor"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x) * self.scale
        return out

    def weight_ptr(self) -> int:
        linear = self.net[0]
        assert isinstance(linear, torch.nn.Linear)
        return linear.weight.data_ptr()


def _pieces(impl: Impl, size: int) -> int:
    tensors = [*impl.net.parameters(), *impl.net.buffers(), impl.scale]
    return sum(math.ceil(t.numel() * t.element_size() / size) for t in tensors)


def test_a_parked_model_answers_the_same_after_the_move_back() -> None:
    impl, x = Impl(), torch.randn(3, 64)
    expected = impl(x)
    snapshot = DeviceSnapshot(impl, staging_bytes=KIB)
    assert not snapshot.on_device
    move = snapshot.to_device()
    assert move is not None and move.nbytes == (64 * 32 + 32 + 32 + 32 + 32) * 4
    assert torch.equal(impl(x), expected)
    assert impl.device == torch.device("cpu") and impl.name == "not a tensor"


def test_every_tensor_goes_through_the_staging_buffers_in_buffer_sized_pieces() -> None:
    impl = Impl()
    snapshot = DeviceSnapshot(impl, staging_bytes=KIB)
    snapshot.to_device()
    assert snapshot.staged_copies == _pieces(impl, KIB)  # 8 KiB weight = 8 pieces, + 4 small


def test_a_model_already_on_its_device_is_not_moved_again() -> None:
    snapshot = DeviceSnapshot(Impl(), staging_bytes=KIB)
    assert snapshot.to_device() is not None
    copies = snapshot.staged_copies
    assert snapshot.to_device() is None and snapshot.staged_copies == copies


def test_parking_again_restores_the_host_copy_and_the_next_move_copies_it_again() -> None:
    impl, x = Impl(), torch.randn(2, 64)
    expected = impl(x)
    snapshot = DeviceSnapshot(impl, staging_bytes=KIB)
    host = impl.weight_ptr()
    snapshot.to_device()
    moved = impl.weight_ptr()
    snapshot.park()
    assert moved != host and impl.weight_ptr() == host  # the moved copy dropped
    assert snapshot.to_device() is not None
    assert snapshot.staged_copies == 2 * _pieces(impl, KIB)
    assert torch.equal(impl(x), expected)


def test_the_gpu_pools_move_is_a_phase_of_its_own_in_the_cold_start_header() -> None:
    moved = ReplicaTimeline(process_started_at=1.0, imported_at=2.0, init_started_at=3.0,
                            setup_s=0.2, warmup_s=0.05, prewarmed=True, device_s=0.012)
    header = report(10.0, 10.5, moved, "pool").header()
    assert header == ("total=500;path=pool;queue=0;start=0;import=0;weights=0;warmup=0;"
                      "device=12")
    stayed = ReplicaTimeline(process_started_at=1.0, imported_at=2.0, init_started_at=3.0,
                             prewarmed=True)
    assert "device" not in report(10.0, 10.5, stayed, "pool").header()
