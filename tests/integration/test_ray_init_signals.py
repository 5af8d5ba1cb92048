"""``ray.init`` leaves the process's SIGTERM handler in charge (``ray_init_keeps_handlers``).

A real local Ray starts in a child process whose handler only counts signals. A thread sends
SIGTERM every 0.3 s while ``ray.init`` starts the node's processes (up to the core worker's
constructor, whose inside is the one window left: see the module), then once more after
``ray.init``: every one must reach the handler, none Ray's ``sys.exit`` or Abseil's handler.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, threading, time
    import ray, ray._raylet
    from ember.cluster.lifecycle import ray_init_keeps_handlers

    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    initialized = threading.Event()
    core_worker = ray._raylet.CoreWorker

    def connecting(*args, **kwargs):
        initialized.set()
        return core_worker(*args, **kwargs)

    ray._raylet.CoreWorker = connecting

    def pester():
        while not initialized.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)

    threading.Thread(target=pester, daemon=True).start()
    with ray_init_keeps_handlers():
        ray.init(address="local", num_cpus=1, include_dashboard=False,
                 _node_ip_address="127.0.0.1",
                 logging_level="WARNING")
    during = len(got)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    print("handled", during, len(got) - during, flush=True)
    ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_during_and_after_ray_init_reaches_the_process_handler() -> None:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "*** SIGTERM received" not in output, output[-3000:]
    during, after = (int(n) for n in output.split("handled ")[1].split()[:2])
    assert during >= 1 and after == 1, output[-3000:]
