"""A GPU deployment's model, parked in pinned host memory while the warm pool holds it.

The GPU warm pool (``pool.py``) keeps GPU deployments constructed, like the CPU pool does,
but a model that sat on the device between cold starts would hold GPU memory that the
deployment's own replica needs. So once a GPU deployment is built, its tensors are parked:
copied to page-locked host memory, the device copies freed. The first request it serves
moves them back through the loaders' pinned staging buffers (``loaders/_staging.py``: the
host copy into one buffer overlaps the device copy out of the other), and a model idle for
a while is parked again. The host copy is never written (inference does not change weights),
so parking after the first time only drops the device copies.

What moves is what the pool can see: the torch modules (parameters and buffers) and bare
tensors held as the deployment instance's attributes, the same state ``model_bytes`` counts.
Attributes that name a device (``self.device``) keep naming the one the model serves on.

On a machine without CUDA the device is the CPU: pinning is skipped and the staging copies
are plain copies, which is how the path is tested there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ember.loaders import StagingCopier

#: Size of each of the two staging buffers used for host-to-device moves.
STAGING_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Move:
    """One host-to-device move of a parked model."""

    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"bytes": self.nbytes, "seconds": round(self.seconds, 6),
                "gb_per_s": round(self.gb_per_s, 3)}


def _state(impl: Any) -> Iterator[tuple[str, Any]]:
    for name, value in vars(impl).items():
        if isinstance(value, torch.nn.Module | torch.Tensor):
            yield name, value


def _apply(impl: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every tensor the instance holds by ``fn(tensor)``, in a fixed order."""
    for name, value in list(_state(impl)):
        if isinstance(value, torch.nn.Module):
            value._apply(fn)  # type: ignore[no-untyped-call]  # what Module.to() runs
        else:
            setattr(impl, name, fn(value))


class DeviceSnapshot:
    """Parks and restores one constructed deployment's tensors (see the module doc).

    Args:
        impl: the constructed deployment instance; its tensors are where its setup put them.
        staging_bytes: size of each staging buffer for the moves back to the device.
    """

    def __init__(self, impl: Any, staging_bytes: int = STAGING_BYTES) -> None:
        self.impl = impl
        self.device = self._device_of(impl)
        self._pin = torch.cuda.is_available()
        self._host: list[torch.Tensor] = []
        self._staging_bytes = staging_bytes
        self._copier: StagingCopier | None = None
        self.on_device = True
        self.park()

    @staticmethod
    def _device_of(impl: Any) -> torch.device:
        for _, value in _state(impl):
            tensors = ([*value.parameters(), *value.buffers()]
                       if isinstance(value, torch.nn.Module) else [value])
            if tensors:
                return tensors[0].device
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._host)

    def park(self) -> None:
        """Keep only the host copy; the device copies are freed."""
        if not self.on_device:
            return
        if not self._host:
            _apply(self.impl, self._keep_on_host)
        else:
            hosts = iter(self._host)
            _apply(self.impl, lambda _: next(hosts))
        self.on_device = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the memory goes back to the device, not to our cache

    def _keep_on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.detach().to("cpu")
        if self._pin and not host.is_pinned():
            host = host.pin_memory()
        self._host.append(host)
        return host

    def to_device(self) -> Move | None:
        """Move the parked tensors to the device; None when they are there already."""
        if self.on_device:
            return None
        if self._copier is None:
            self._copier = StagingCopier(self.device, self._staging_bytes)
        copier = self._copier
        started = time.perf_counter()
        _apply(self.impl, copier.copy)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.on_device = True
        return Move(self.nbytes, time.perf_counter() - started)

    @property
    def staged_copies(self) -> int:
        """Buffer-sized copies made through the staging buffers so far."""
        return self._copier.copies if self._copier is not None else 0
