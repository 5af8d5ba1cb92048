"""The serving process's side of start-up and drain, and its signal handlers across ``ray.init``.

The phase (``starting``, ``serving``, ``draining``) is written where every edge reads it
(``http/drain.py``). :func:`drain` asks the edges to refuse new requests and waits until they
have none left in flight.

``ray.init`` takes over two signal handlers of the calling process:

- in Python, it sets ``SIGTERM`` to ``sys.exit`` as its first step
  (``ray._private.worker.init`` through ``ray._private.utils.set_sigterm_handler``);
- in C++, the driver's core worker (``ray._raylet.CoreWorker``, created by
  ``ray._private.worker.connect``) installs Abseil's failure signal handler for ``SIGTERM``
  among others: it prints a ``*** SIGTERM received`` stack and treats the process as failing
  (what ``ember run`` once died of, by SIGABRT).

:func:`ray_init_keeps_handlers` keeps the process's own handlers in charge through both: Ray's
Python-level swap is skipped, and the process's handlers are put back (replacing Abseil's) the
moment the core worker's constructor returns. What remains is the inside of that constructor,
after Abseil's handler went in (it connects to the raylet: a fraction of a second); a signal
there still meets Abseil's handler. Blocking the signals around it would not close that
window: the threads Ray started before (its GCS client's) would take the signal instead, and
blocking them from the start would hand the blocked mask down to every process Ray starts.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ember import ray_internals
from ember.edge.drain import (
    DRAINING,
    NAMESPACE,
    SERVING,
    STARTING,
    drained,
    phase_key,
    report_prefix,
)

__all__ = ["DRAINING", "SERVING", "STARTING", "drain", "ray_init_keeps_handlers", "set_phase"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def set_phase(app: str, phase: str) -> None:
    """Publish ``phase`` to the edges of ``app``; a new start also forgets old drain reports."""
    ray_internals.kv_put(phase_key(app), phase.encode(),
                           namespace=NAMESPACE)
    if phase != DRAINING:
        for key in ray_internals.kv_list(report_prefix(app), namespace=NAMESPACE):
            ray_internals.kv_delete(key, namespace=NAMESPACE)


def clear_phase(app: str) -> None:
    """Forget ``app``'s phase (once it is shut down, on a cluster that lives on)."""
    ray_internals.kv_delete(phase_key(app), namespace=NAMESPACE)


def drain_reports(app: str) -> dict[str, Any]:
    """Each edge's last drain report (``in_flight``), by edge id."""
    reports: dict[str, Any] = {}
    prefix = report_prefix(app)
    for key in ray_internals.kv_list(prefix, namespace=NAMESPACE):
        raw = ray_internals.kv_get(key, namespace=NAMESPACE)
        with contextlib.suppress(ValueError, TypeError):
            reports[key.decode()[len(prefix):]] = json.loads(raw or b"")
    return reports


def drain(app: str, *, edges: int, timeout_s: float,
          interrupted: Callable[[], bool] = lambda: False) -> bool:
    """Have ``app``'s edges refuse new requests, then wait for those in flight to finish.

    Returns:
        True once ``edges`` edges reported no request in flight; False when ``timeout_s``
        passed first or ``interrupted()`` turned true.
    """
    set_phase(app, DRAINING)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not interrupted():
        if drained(drain_reports(app), edges):
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def ray_init_keeps_handlers() -> Iterator[None]:
    """Around ``ray.init``: keep this process's SIGTERM and SIGINT handlers (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread has signal handlers to keep
        return
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    with ray_internals.driver_keeps_signal_handlers(lambda: _restore(handlers)):
        try:
            yield
        finally:
            _restore(handlers)


def _restore(handlers: dict[signal.Signals, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
