"""A GPU deployment on a cluster without GPUs: only the GPU warm pool can answer for it."""

from __future__ import annotations

import torch
from pydantic import BaseModel

import ember

SIZE = 512  # a 1 MiB weight: a move through the staging buffers that takes measurable time


class Vector(BaseModel):
    values: list[float]


def build() -> torch.nn.Linear:
    torch.manual_seed(7)
    return torch.nn.Linear(SIZE, 4)


# A short grace: its own replica never gets a GPU here, and Serve gives a replica it removes
# before it started the whole grace period (20 s by default) before killing it.
@ember.deployment(route="/gpu-model", warm_floor=0, max_replicas=1, num_cpus=0.05, num_gpus=1,
                  preload=True, graceful_shutdown_s=1)
class GpuModel:
    def setup(self) -> None:
        self.net = build()

    def __call__(self, body: Vector) -> list[float]:
        with torch.inference_mode():
            return [float(v) for v in self.net(torch.tensor(body.values))]


app = ember.App([GpuModel], name="gpu-pool-tests", warm_pool=1)
