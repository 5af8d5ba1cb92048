"""Run the whole suite as two lanes of pytest sessions side by side: ``make test``'s runner.

Why lanes: most of the suite's time is spent waiting (Ray and ``ember run`` starting,
replicas scaling to zero, a load test's fixed run time), not computing; one session at a
time left this 2-core machine half idle. Why sessions, not one pytest run: a process joins
one Ray cluster at a time, so the session cluster of the integration tests, the two-node
cluster and every ``ember run`` of the e2e tests and the load test need sessions (or
processes) of their own. Each lane runs its sessions one after another, and no two lanes
share a Ray cluster, a port or a temp folder; the load test and e2e tests start their own
clusters in their own process trees.

Every line a session prints is passed on at once, prefixed with its session's name; each
session prints its ten slowest tests. The exit status is 1 if any session failed; every
session runs to its end either way, so one run shows every failure.

    python tests/lanes.py                    # what `make test` runs after lint and mypy
    python tests/lanes.py --durations=0      # extra arguments go to every session
"""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADTEST = "tests/integration/test_loadtests.py::test_short_run_passes_and_writes_the_report"


@dataclass(frozen=True)
class Session:
    """One pytest run: a name for its lines, and its arguments."""

    name: str
    args: tuple[str, ...]


def lanes() -> list[list[Session]]:
    """The sessions, in two lanes of about equal length (20 and 17 minutes alone here)."""
    two_nodes = tuple(sorted(glob.glob("tests/integration/test_two_nodes*.py", root_dir=ROOT)))
    return [
        [
            # The session cluster's tests (and the unit tests, which need no cluster).
            Session("integration", ("tests/unit", "tests/integration",
                                    "--ignore-glob=tests/integration/test_two_nodes*",
                                    "--deselect", LOADTEST)),
            Session("two-nodes", two_nodes),
        ],
        [
            # Its own `ember run` servers, so its own Ray clusters, in its own process tree.
            Session("loadtest", (LOADTEST,)),
            Session("e2e", ("tests/e2e",)),
        ],
    ]


@dataclass
class Outcome:
    session: Session
    returncode: int
    seconds: float


def run_session(session: Session, basetemp: Path, lock: threading.Lock,
                extra: list[str]) -> Outcome:
    """Run ``session`` to its end, passing each line on with its name."""
    cmd = [sys.executable, "-m", "pytest", *session.args, "--durations=10",
           f"--basetemp={basetemp / session.name}", *extra]
    started = time.monotonic()
    say(lock, f"[{session.name}] start: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        say(lock, f"[{session.name}] {line.rstrip()}")
    returncode = proc.wait()
    seconds = time.monotonic() - started
    say(lock, f"[{session.name}] exit {returncode} after {seconds:.0f} s")
    return Outcome(session, returncode, seconds)


def say(lock: threading.Lock, line: str) -> None:
    with lock:  # whole lines: the lanes' output interleaves line by line, never within one
        print(line, flush=True)


def main() -> int:
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ember-tests-") as tmp:

        def run_lane(lane: list[Session]) -> None:
            for session in lane:
                outcomes.append(run_session(session, Path(tmp), lock, sys.argv[1:]))

        threads = [threading.Thread(target=run_lane, args=(lane,)) for lane in lanes()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    expected = sum(len(lane) for lane in lanes())
    print(f"\n{len(outcomes)} of {expected} sessions in {time.monotonic() - started:.0f} s:")
    for outcome in outcomes:
        verdict = "passed" if outcome.returncode == 0 else f"FAILED ({outcome.returncode})"
        print(f"  {outcome.session.name:<12} {verdict:<12} {outcome.seconds:6.0f} s")
    # A lane that died before its sessions ran (its thread raised) fails the run too.
    passed = len(outcomes) == expected and all(o.returncode == 0 for o in outcomes)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
