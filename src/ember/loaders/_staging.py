"""Host-to-device copies through a pinned, reused staging buffer.

Copying a pageable (mmapped) tensor to a GPU makes the driver stage it through its own
pinned memory synchronously. Ember stages through two pinned buffers it owns instead: the
host copy into one buffer overlaps the asynchronous device copy out of the other, and
both overlap the range reads, which run on other threads.
"""

from __future__ import annotations

import torch


def select_device(device: str | torch.device) -> torch.device:
    """Pick the device at run time: ``"auto"`` means CUDA when present, else CPU.

    Raises:
        ValueError: a CUDA device was asked for on a machine without one.
    """
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(device)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} was requested but CUDA is not available; "
            "use device='cpu' or device='auto'"
        )
    return chosen


class StagingCopier:
    """Copies tensors to ``device`` through ``slots`` reused staging buffers.

    Args:
        device: the destination device.
        buffer_bytes: size of each staging buffer.
        pin: page-lock the buffers (default: when the device is CUDA).
        slots: number of buffers used round-robin (2 = double buffering).
    """

    def __init__(
        self, device: torch.device, buffer_bytes: int, *, pin: bool | None = None, slots: int = 2
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        pin = cuda if pin is None else pin
        self.buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)
        ]
        self._stream: torch.cuda.Stream | None = None
        if cuda:
            self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0
        self.copies = 0

    def _wait_slot(self) -> torch.Tensor:
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()  # the device copy out of this buffer has finished
        return self.buffers[self._slot]

    def _device_copy(self, dst: torch.Tensor, staged: torch.Tensor) -> None:
        if self._stream is None:
            dst.copy_(staged)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        self._events[self._slot] = event

    def copy(self, src: torch.Tensor) -> torch.Tensor:
        """Return a copy of ``src`` on the device, moved in buffer-sized pieces."""
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        if src.numel() == 0:
            return out
        src_bytes = src.contiguous().reshape(-1).view(torch.uint8)
        dst_bytes = out.reshape(-1).view(torch.uint8)
        size = self.buffers[0].numel()
        for start in range(0, src_bytes.numel(), size):
            end = min(start + size, src_bytes.numel())
            staged = self._wait_slot()[: end - start]
            staged.copy_(src_bytes[start:end])
            self._device_copy(dst_bytes[start:end], staged)
            self._slot = (self._slot + 1) % len(self.buffers)
            self.copies += 1
        if self._stream is not None:
            # Work queued later on the caller's stream must see the finished copy, and the
            # allocator must not reuse ``out`` while the side stream still writes it.
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            out.record_stream(self._stream)
        return out

    def synchronize(self) -> None:
        """Wait for every device copy issued so far."""
        if self._stream is not None:
            self._stream.synchronize()
