"""The warm runtime: idle worker processes that already imported the app's modules (and so
torch, for an app that uses it).

A deployment's own replica from zero spends most of its cold start before ``setup()``: Ray
starts a Python worker (about a second here) and unpickling the replica's class imports
torch and the app (two to five seconds on a small machine). Neither depends on the request.
So Ember keeps a few idle Ray workers that paid both already, and Ray's raylet hands one of
them to the next replica it creates: the replica runs only ``setup()`` (weights mapped from
the node's snapshot) and ``warmup()``.

This is not the warm pool. A warm-runtime process answers for no deployment: it holds no
model, and it becomes a replica only when Serve's controller starts one. A request that
meets it is still a cold start, measured as one (``queue`` covers Serve's scale-up and the
actor's creation; ``start`` and ``import`` are zero).

Two Ray mechanisms, both set when Ember starts the local cluster:

* ``preload_python_modules`` (a raylet setting): every Python worker the raylet starts
  imports these modules before it accepts work. The raylet preloads one gate module,
  ``control/warm_imports.py``, which imports the list unless the worker is a light one:
  the edges and the rollout driver need none of it (``control/warm_env.py``).
  ``bench/coldstart.py`` records an idle worker's resident memory.
* The raylet's ``PrestartWorkers`` call starts idle workers ahead of need, kept alive for
  ``keep_alive_s``. Ray gives a new actor an idle worker of its job whose runtime
  environment matches; replicas of an embedded Ember app have none, so any idle worker fits.
  A worker that became a replica (or an edge, or a task) is gone from the idle set, so
  :class:`Refiller` tops the node's idle workers back up (it counts them every second, less
  often while the count stands still), once the cold start that took one is past: the worker
  it took has gone quiet and the node's cores are not busy (:func:`refill_due`).

Ray offers no public API for either; if the call fails (a Ray upgrade moved it), Ember logs
it once and replicas start from fresh processes, as on plain Ray Serve. On a cluster Ember
joins (``RAY_ADDRESS``), set ``preload_python_modules`` where ``ray start`` runs
(``--system-config``); Ember does not prestart workers there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from ember import ray_internals
from ember.control.backoff import next_interval_s
from ember.control.warm_env import WARM_IMPORTS_ENV

logger = logging.getLogger("ember.warm_runtime")

#: Idle pre-started workers are kept this long (then Ray's idle-worker rules apply again).
KEEP_ALIVE_S = 24 * 3600
_REFILL_EVERY_S = 1.0
#: How often it counts them while the count stands still (``control/backoff``): counting
#: reads every process's parent from /proc. A worker a cold start takes is seen within this;
#: while workers are missing, the count runs at ``_REFILL_EVERY_S`` again.
_STEADY_REFILL_EVERY_S = 4.0
#: A used worker is replaced this long after it was taken (at the latest count that still
#: saw it): a new worker importing torch competes for the cores with the cold start that
#: just took the old one.
_REFILL_AFTER_S = 3.0
#: ...and, past that grace, not while the node's cores are at least this busy: a cold start
#: loading a large model's weights outlasts the grace, and a worker importing torch beside
#: it takes seconds of CPU from it.
_BUSY_SHARE = 0.6
#: ...nor while a worker taken since the last refill uses at least this share of a core:
#: its cold start is still loading or computing its first answer. On a node of many cores a
#: single-threaded first forward leaves the node's share low, and on any node a load that
#: waits on the disk leaves its cores idle, yet a torch import beside either slows it (the
#: 6 GB ladder's first forward, page cache cold, took 5.27 s beside a refill, 4.32 s alone).
_TAKEN_BUSY_CORES = 0.2
#: A busy node defers the refill this long at most (a node busy with traffic still gets it).
_REFILL_DEFER_MAX_S = 20.0


#: What every replica imports whatever the app: Serve's replica actor (1.2 s of imports on
#: its own, measured here) and Ember's replica code. Neither needs torch.
_BASE_MODULES = (*ray_internals.serve_replica_module(), "ember.control.replica")
#: Run after the app's modules, in this order: torch's operators run once if the app's imports
#: brought torch in (an app that uses none saves a second of CPU and about 170 MB per idle
#: worker), the S3 client's model is parsed once they have said whether botocore is there,
#: and the heap is frozen after everything.
_AFTER_APP = ("ember.control.torch_warm", "ember.control.s3_warm", "ember.control.settle_heap")


def preload_modules(modules: Iterable[str]) -> list[str]:
    """Modules a warm-runtime worker imports: Serve's and Ember's replica code, the app's,
    then torch's warm-up (where the app's imports brought torch in), the S3 client's and the
    heap's freeze."""
    wanted = [*_BASE_MODULES, *modules]
    ordered = [m for m in dict.fromkeys(wanted) if m and m != "__main__" and m not in _AFTER_APP]
    return [*ordered, *_AFTER_APP]


#: The one module the raylet preloads: it imports :func:`preload_modules` unless the worker
#: is a light one (the edges; see ``control/warm_env.py``).
GATE_MODULE = "ember.control.warm_imports"


def system_config() -> dict[str, Any]:
    """The raylet settings of a local cluster with the warm runtime."""
    return {"preload_python_modules": [GATE_MODULE]}


def worker_env(modules: Iterable[str]) -> dict[str, str]:
    """The environment, inherited by every worker, that names what the gate imports."""
    return {WARM_IMPORTS_ENV: ",".join(preload_modules(modules))}


def prestart(count: int, keep_alive_s: int = KEEP_ALIVE_S) -> None:
    """Ask this node's raylet to start ``count`` idle Python workers of this job now.

    Must run in the process that started the local cluster.

    Raises:
        Exception: whatever Ray raises when its internals differ from 2.60's.
    """
    ray_internals.prestart_workers(count, keep_alive_s)


def _raylet_children() -> list[Any]:
    """Processes of the raylet this process started (its local cluster's only one)."""
    import psutil
    import ray

    node = f"--node_id={ray.get_runtime_context().get_node_id()}"
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.name() == "raylet" and node in process.cmdline():
                return list(process.children())
    return []


def _is_worker(process: Any) -> bool:
    return any("default_worker.py" in part for part in process.cmdline())


def idle_workers() -> int:
    """Python workers of this node's raylet that are idle or still starting.

    Ray names a worker's process ``ray::IDLE`` once it has registered, ``ray::<task>`` once
    it runs something, and leaves the interpreter's name before it registers. Only the
    process that started the local cluster can see its raylet.
    """
    return len(idle_worker_processes())


def idle_worker_processes() -> list[Any]:
    """The processes :func:`idle_workers` counts (``psutil.Process``)."""
    import psutil

    found = []
    for child in _raylet_children():
        try:
            name = child.name()
            idle = name == ray_internals.IDLE_WORKER_TITLE
            if idle or (not name.startswith("ray::") and _is_worker(child)):
                found.append(child)
        except psutil.Error:  # exited meanwhile
            continue
    return found


def settled_idle_workers(sample_s: float = 0.3) -> int:
    """Idle workers that have finished their imports.

    A worker takes the name ``ray::IDLE`` before it imports the preloaded modules, so the
    name alone does not say it is ready; one that is still importing is busy on a core. One
    that used under 2% of a core over ``sample_s`` has settled.
    """
    import psutil

    before: dict[int, tuple[Any, float]] = {}
    for child in _raylet_children():
        with contextlib.suppress(psutil.Error):
            if child.name() == ray_internals.IDLE_WORKER_TITLE:
                before[child.pid] = (child, _cpu_s(child))
    time.sleep(sample_s)
    settled = 0
    for child, cpu_s in before.values():
        with contextlib.suppress(psutil.Error):
            used = _cpu_s(child) - cpu_s
            settled += child.name() == ray_internals.IDLE_WORKER_TITLE and used < 0.02 * sample_s
    return settled


def _cpu_s(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def refill_due(missing: int, idle: int, short_for_s: float, busy_share: float,
               taken_busy: bool = False) -> bool:
    """Whether to prestart the ``missing`` workers now.

    Args:
        missing: Idle workers short of ``idle``.
        idle: How many the node keeps.
        short_for_s: How long they have been missing, at most (since the last count that
            saw them all).
        busy_share: How busy the node's cores were since the last count, 0 to 1.
        taken_busy: Whether a worker taken since the last refill was busy since the last
            count (its replica still starting or answering its first request).

    Example:
        >>> refill_due(1, 2, short_for_s=4.0, busy_share=0.9)  # a cold start still loading
        False
        >>> refill_due(1, 2, short_for_s=4.0, busy_share=0.2)
        True
        >>> refill_due(1, 2, short_for_s=4.0, busy_share=0.2, taken_busy=True)
        False
        >>> refill_due(2, 2, short_for_s=0.0, busy_share=0.9)  # none left for the next one
        True
    """
    if missing <= 0:
        return False
    if missing >= idle or short_for_s >= _REFILL_DEFER_MAX_S:
        return True
    return short_for_s >= _REFILL_AFTER_S and busy_share < _BUSY_SHARE and not taken_busy


def cpu_seconds() -> tuple[float, float]:
    """The node's busy and total CPU seconds so far, all cores (``/proc/stat`` on Linux; in a
    container, the host's cores: a busy neighbour defers a refill too, up to the cap)."""
    import psutil

    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(times)
    return total - idle, total


class _BusyMeter:
    """How busy the node's cores were between two calls of :meth:`share`."""

    def __init__(self) -> None:
        self._last = cpu_seconds()

    def share(self) -> float:
        busy, total = cpu_seconds()
        (last_busy, last_total), self._last = self._last, (busy, total)
        return (busy - last_busy) / (total - last_total) if total > last_total else 0.0


class _Taken:
    """The workers that left the idle set since the last refill, and the CPU each used
    between counts: the cold starts that took them."""

    def __init__(self) -> None:
        self._idle: dict[int, tuple[Any, float]] = {}
        self._taken: dict[int, tuple[Any, float]] = {}
        self._at = time.monotonic()

    def busy(self, idle: list[Any]) -> bool:
        """Whether a taken worker used ``_TAKEN_BUSY_CORES`` of a core since the last call;
        ``idle`` is this count's idle workers."""
        import psutil

        now = time.monotonic()
        elapsed, self._at = now - self._at, now
        idle_now = {p.pid: p for p in idle}
        self._taken.update({pid: seen for pid, seen in self._idle.items() if pid not in idle_now})
        for pid in idle_now:  # back in the idle set (a count that missed it)
            self._taken.pop(pid, None)
        busy = False
        for pid, (process, cpu_s) in list(self._taken.items()):
            try:
                used = _cpu_s(process)
            except psutil.Error:  # exited: its cold start is over
                del self._taken[pid]
                continue
            busy |= used - cpu_s >= _TAKEN_BUSY_CORES * elapsed
            self._taken[pid] = (process, used)
        self._idle = {}
        for pid, process in idle_now.items():
            with contextlib.suppress(psutil.Error):
                self._idle[pid] = (process, _cpu_s(process))
        return busy

    def clear(self) -> None:
        self._taken.clear()


class Refiller:
    """Keeps ``idle`` workers idle or starting on the node: the ones new replicas take.

    Runs in the process that started the local cluster, in a daemon thread.
    """

    def __init__(self, idle: int) -> None:
        self.idle = idle
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ember-warm-runtime")

    def start(self) -> None:
        if self.idle > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until ``idle`` workers have finished their imports; False after ``timeout_s``.

        Called before a server says it is up, so that its first cold start meets the warm
        runtime rather than workers still importing torch.
        """
        deadline = time.monotonic() + timeout_s
        try:
            while self.idle > 0 and self._thread.is_alive() and not self._failing:
                if settled_idle_workers() >= self.idle:
                    return True
                if time.monotonic() >= deadline:
                    return False
        except Exception:  # the raylet's processes unreadable: serve without waiting
            logger.debug("cannot see the raylet's workers", exc_info=True)
            return False
        return self.idle == 0

    def _run(self) -> None:
        short_since: float | None = None
        period, last, counted_at = _REFILL_EVERY_S, None, time.monotonic()
        busy, taken = _BusyMeter(), _Taken()
        while True:
            try:
                workers = idle_worker_processes()
                missing = self.idle - len(workers)
                period = next_interval_s(period, changed=missing != last or missing > 0,
                                         fast_s=_REFILL_EVERY_S, slow_s=_STEADY_REFILL_EVERY_S)
                now, last = time.monotonic(), missing
                # A worker found missing may have been taken any time since the last count:
                # the grace runs from then, so a backed-off count does not delay the refill.
                seen_before = short_since is not None
                short_since = (short_since or counted_at) if missing > 0 else None
                counted_at = now
                share = busy.share()
                if short_since is not None and not seen_before:
                    # That share is mostly from before the worker went (a backed-off count
                    # spans 4 s): the next count, a second on, says what the cores do now.
                    share = 1.0
                taken_busy = taken.busy(workers)
                if short_since is not None and refill_due(missing, self.idle,
                                                          now - short_since, share, taken_busy):
                    prestart(missing)
                    short_since = None
                if short_since is None:  # none missing, or just replaced: none to wait for
                    taken.clear()
                self._failing = False
            except Exception:  # a busy raylet may time out; retry, but say so only once
                if not self._failing:
                    logger.warning("warm runtime: prestarting Ray workers failed; new "
                                   "replicas start fresh processes meanwhile", exc_info=True)
                self._failing = True
            if self._stop.wait(period):
                return
