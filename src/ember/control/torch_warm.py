"""Imported by warm-runtime workers after the app's modules (``warm_runtime.preload_modules``):
run torch once, if the app uses it.

A process that imported torch but never ran an operator pays for it on its first forward
pass: the intra-op thread pool, the CPU kernels' dispatch and their first allocations. On
the MiniLM flagship that first pass took 0.02-0.42 s in a pre-started worker, the largest
and least steady part of its replica's own start. Running the operators transformer
encoders use, on tiny tensors, when the worker starts moves that cost out of the request.
Nothing here touches a GPU.

An app whose modules did not import torch gets none: importing it here would cost every
idle worker a second of CPU and its memory for nothing. (An app that imports torch only in
``setup()`` is told to name it in ``ember.App(preload_modules=...)``: see
``control/replica.py``.)
"""

from __future__ import annotations

import sys
from typing import Any


def _exercise(torch: Any) -> None:
    with torch.inference_mode():
        ids = torch.randint(0, 16, (2, 8))
        hidden = torch.nn.functional.embedding(ids, torch.randn(16, 32))
        hidden = torch.nn.functional.layer_norm(hidden, (32,))
        weight = torch.randn(32, 32)
        scores = torch.nn.functional.linear(hidden, weight) @ hidden.transpose(1, 2)
        hidden = torch.softmax(scores / 4.0, dim=-1) @ hidden
        hidden = torch.nn.functional.gelu(torch.nn.functional.linear(hidden, weight))
        (hidden * torch.ones(2, 8, 1)).sum(dim=1).div(8).norm(dim=-1)


_torch = sys.modules.get("torch")
if _torch is not None:
    _exercise(_torch)
