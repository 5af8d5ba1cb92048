"""A replica computes on the CPUs it reserved, even in a worker that ran torch before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A pre-started worker: torch imported and run (its pool sized to every core), then handed a
# replica. A subprocess, so that this test process's own torch keeps its thread count.
_WORKER = """
import torch
import ember.control.torch_warm
before = torch.get_num_threads()
from ember.control.replica import match_torch_threads
match_torch_threads({num_cpus})
print(before, torch.get_num_threads())
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell the counts apart")
@pytest.mark.parametrize(("num_cpus", "want"), [(0.5, 1), (1.0, 1), (1.9, 1)])
def test_a_warm_worker_s_torch_pool_is_cut_to_the_replica_s_cpus(num_cpus: float,
                                                                 want: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _WORKER.format(num_cpus=num_cpus)], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    before, after = map(int, out.split())
    assert before > 1  # the worker's pool had a thread per core
    assert after == want
