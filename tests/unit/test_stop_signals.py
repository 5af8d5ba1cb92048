"""``ember run``'s signal handler, in a child process: drain on the first, exit 4 on a second."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from ember.cli._signals import StopSignals

    signals = StopSignals().install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.stop.wait(10), "the first signal did not ask for a stop"
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("still here", flush=True)
""")


def test_first_signal_asks_for_a_drain_and_a_second_exits_4_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["SIGTERM: draining (a second signal stops at once)",
                                        "stopping"]
    assert done.stderr.strip() == "SIGINT again: stopping now"
