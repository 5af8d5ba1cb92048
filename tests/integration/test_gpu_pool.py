"""The GPU warm pool, live: a GPU deployment on a cluster without GPUs is answered from the
pool's parked host copy while its own replica waits for a GPU.

A module of its own: the app must not share the edges' port with another module's app.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from apps import gpu_pool
from serving import ServeApp
from support import deployment_status, wait_for

pytestmark = pytest.mark.cluster


def _phases(header: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in header.split(";"))


def test_a_gpu_deployment_is_served_by_the_gpu_pool_from_its_parked_host_copy(
    serve_app: ServeApp,
) -> None:
    from ray import serve

    values = [0.25] * gpu_pool.SIZE
    with torch.inference_mode():
        expected = [float(v) for v in gpu_pool.build()(torch.tensor(values))]
    with serve_app(gpu_pool.app, env={"EMBER_GPU_POOL_PARK_AFTER_S": "1"}) as base:
        pool_handle = serve.get_deployment_handle("ember-pool-gpu", gpu_pool.app.name)
        assert pool_handle.ember_ping.remote().result(timeout_s=30)["on_device"] == []
        first = httpx.post(f"{base}/gpu-model", json={"values": values}, timeout=60)
        assert first.status_code == 200 and first.json() == pytest.approx(expected)
        phases = _phases(first.headers["x-ember-cold-start"])
        # Preloaded, so nothing was built for it (a warm hit); its parked copy moved.
        assert phases["path"] == "pool-warm" and phases["weights"] == "0" and "device" in phases
        moved = pool_handle.ember_ping.remote().result(timeout_s=30)["moves"]["GpuModel"]
        assert moved["bytes"] == (gpu_pool.SIZE * 4 + 4) * 4 and moved["staged_copies"] == 2
        # Its own replica needs a GPU this cluster lacks: the status says so meanwhile.
        wait_for(lambda: "GPU" in (deployment_status(base, "GpuModel")["waiting_for_resources"]
                                   or ""), 30, what="the GPU replica reported unplaceable")
        wait_for(lambda: pool_handle.ember_ping.remote().result(timeout_s=30)["on_device"] == [],
                 30, what="the idle model parked again")
        again = httpx.post(f"{base}/gpu-model", json={"values": values}, timeout=60)
        assert again.status_code == 200 and again.json() == pytest.approx(expected)
        assert "device" in _phases(again.headers["x-ember-cold-start"])
