"""Serving test apps on the session's cluster, and reading what Serve's controller decided.

``tests/integration`` is on pytest's ``pythonpath``, so test modules import this as
``serving``. The ``serve_app`` fixture of ``conftest.py`` wraps :func:`served`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

import ember

from support import wait_for


class ServeApp(Protocol):
    """The ``serve_app`` fixture: ``with serve_app(app) as url:`` serves ``app`` at ``url``."""

    def __call__(self, app: ember.App, *, ready_timeout_s: float = ...,
                 env: Mapping[str, str] | None = ...) -> AbstractContextManager[str]: ...


@contextmanager
def served(app: ember.App, port: int, *, ready_timeout_s: float = 90,
           env: Mapping[str, str] | None = None) -> Iterator[str]:
    """Deploy ``app`` on ``port``, yield its base URL once ``/readyz`` is 200, then delete it.

    Args:
        app: The app to serve; its deployments are imported by module name in the workers.
        port: The Serve HTTP port of the session.
        ready_timeout_s: How long the app may take to become ready before the test fails.
        env: Environment set while the app is deployed (the ingress reads it then).
    """
    from ray import serve

    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        base: str = ember.serve(app, port=port)
    try:
        wait_for(lambda: _ready(base), ready_timeout_s, what=f"app {app.name!r} to be ready")
        yield base
    finally:
        serve.delete(app.name)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# -- Serve's controller ----------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One reading of a deployment in Serve's controller.

    Attributes:
        at: ``time.time()`` when it was read (the replicas' clock too: one machine).
        target: The controller's target replica count, the autoscaler's last decision.
        replicas: ``(pid, state)`` of every replica the controller holds, stopping included.
    """

    at: float
    target: int
    replicas: tuple[tuple[int | None, str], ...]

    def count(self, *states: str) -> int:
        """Replicas in any of ``states`` (``"RUNNING"``, ``"STARTING"``, ``"STOPPING"``)."""
        return sum(1 for _, state in self.replicas if state in states)

    def pids(self, *states: str) -> set[int]:
        """Process ids of the replicas in any of ``states``."""
        return {pid for pid, state in self.replicas if pid is not None and state in states}


def read_deployment(app: str, deployment: str) -> Sample:
    """What Serve's controller holds for ``deployment`` of ``app`` right now."""
    # Private client, public schema: ``serve.status()`` gives replica counts but not the
    # target count or the replicas' pids, which is what these tests are about.
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None  # raises itself when no controller is running
    details: dict[str, Any] = client.get_serve_details()
    row = details["applications"][app]["deployments"][deployment]
    replicas = tuple((r.get("pid"), _state(r["state"])) for r in row["replicas"])
    return Sample(at=time.time(), target=int(row["target_num_replicas"]), replicas=replicas)


def _state(value: Any) -> str:
    return str(getattr(value, "value", value))


class ControllerWatch:
    """Reads one deployment from Serve's controller every ``interval_s``, in a thread.

    Example:
        >>> with ControllerWatch("core-tests", "Cold") as watch:  # doctest: +SKIP
        ...     send_a_burst()
        >>> max(s.target for s in watch.samples)  # doctest: +SKIP
    """

    def __init__(self, app: str, deployment: str, interval_s: float = 0.05) -> None:
        self.app, self.deployment, self.interval_s = app, deployment, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="controller-watch")
        self._error: BaseException | None = None

    def __enter__(self) -> ControllerWatch:
        self.samples.append(read_deployment(self.app, self.deployment))
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s):
                self.samples.append(read_deployment(self.app, self.deployment))
        except BaseException as exc:  # surfaced in the test by __exit__
            self._error = exc

    def first(self, *states: str, pid: int | None = None) -> Sample | None:
        """The first sample with a replica in one of ``states`` (that replica, if ``pid``)."""
        for sample in self.samples:
            if pid is None and sample.count(*states):
                return sample
            if pid is not None and pid in sample.pids(*states):
                return sample
        return None


# -- logs --------------------------------------------------------------------------------------
def cluster_log_lines(*needles: str) -> list[str]:
    """Lines of the session cluster's log files that contain every one of ``needles``."""
    import ray

    # Ray has no public call for its log directory; the driver's node knows it.
    node = ray._private.worker._global_node
    assert node is not None, "no Ray cluster in this process"
    logs = Path(node.get_logs_dir_path())
    lines: list[str] = []
    for path in logs.rglob("*"):
        if path.suffix not in (".log", ".err", ".out") or not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if all(needle in line for needle in needles):
                lines.append(line)
    return lines
