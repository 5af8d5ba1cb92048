"""``ember run``: serve an app until SIGTERM or SIGINT, then drain and stop.

The order that keeps every moment safe: signal handlers (``_signals.py``, installed before the
heavy imports) and the watchdog (``cluster/watchdog.py``) before Ray starts; ``/readyz``
200 only once the app is fully up; on a signal, a drain (503 to new requests, in-flight ones
finish within the deployments' ``graceful_shutdown_s``), then Serve and Ray shut down, the
watchdog kills whatever of the process tree is left, and the process ends without the
interpreter's teardown (:func:`leave`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any, NoReturn

from ember import ray_internals, settings
from ember.app.app import App
from ember.app.targets import load_app
from ember.cli._signals import (
    EXIT_DRAIN_TIMEOUT,
    EXIT_FORCED,
    EXIT_OK,
    STOP,
    StopSignals,
)
from ember.cluster import watchdog
from ember.control.store import default_state_dir


def cmd_run(args: argparse.Namespace, signals: StopSignals = STOP) -> int:
    signals.install()
    guard = watchdog.start()

    def stop_now() -> None:
        # No Serve or Ray shutdown: the watchdog kills the tree as recorded now once this
        # process is gone (killing it first would have Ray's threads here report the loss).
        guard.record()
        os._exit(EXIT_FORCED)

    signals.on_second = stop_now
    try:
        if signals.stop.is_set():
            return EXIT_OK
        app = load_app(args.target)
        guard.wait_started()  # before the first process it must not leave behind
        if signals.stop.is_set():
            return EXIT_OK
        code = _serve(app, args, signals)
    finally:
        guard.reap()
    leave(code)


def leave(code: int) -> NoReturn:
    """End the process with ``code`` now that the app, Serve, Ray and the tree are down.

    What would be left is the interpreter's own teardown: a full collection of a heap that
    holds Ray's, Serve's and the app's modules, then their native destructors. On 2 cores
    that took seconds after the port was long free, and whatever waits for the exit (a pod
    being ended, systemd, a rolling restart, the tests) waited for nothing. Output and
    logs are flushed first; no exit handler is left with work (Ray's ran in
    ``runtime.shutdown``, the watchdog's pipe closes with the process).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _serve(app: App, args: argparse.Namespace, signals: StopSignals) -> int:
    from ember.cluster import runtime

    drained = True
    key_note = _local_admin_key()
    try:
        url = runtime.serve_app(app, host=args.host, port=args.port, stop=signals.stop,
                                dashboard_port=args.dashboard_port,
                                state_dir=args.state_dir or default_state_dir(app.name))
        if not signals.stop.is_set():
            print(f"Ember is serving {app.name} at {url}  (docs: {url}/docs)", flush=True)
            example = (app.curl or "ember status --url {url}").format(url=url)
            print(f"Try: {example}", flush=True)
            if key_note:
                print(key_note, flush=True)
            for line in ray_access_lines(_this_cluster()):
                print(line, flush=True)
            print("Press Ctrl-C to stop.", flush=True)
        signals.stop.wait()
        print("Shutting down...", flush=True)
        drained = runtime.drain(app)
        if not drained:
            print("the drain ran out of time with requests in flight", flush=True)
    finally:
        runtime.shutdown()
    return EXIT_OK if drained else EXIT_DRAIN_TIMEOUT


def admin_key_path() -> Path:
    """Where ``ember run`` keeps the admin key it made for this machine's CLI."""
    cache = settings.load().cache_dir or Path.home() / ".cache" / "ember"
    return cache / "admin-key"


def _local_admin_key() -> str | None:
    """With no admin key set and no loopback opt-in, give the edges one and keep it (mode
    0600) where this machine's ``ember status|warm|plan|rollout`` read it; a note to print.

    Admin routes take no call without an admin key (see ``edge/auth.py``), and the quickstart
    must still show ``ember status``.
    """
    config = settings.load()
    if config.admin_keys is not None or config.admin_loopback:
        return None
    path = admin_key_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another `ember run` made it just now
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
    os.environ[settings.variable("admin_keys")] = path.read_text().strip()
    return f"Admin key (for /-/ routes; the ember CLI reads it): {path}"


def ray_access_lines(access: dict[str, Any] | None) -> list[str]:
    """Where the app's Ray cluster is, and the lines that reach it from another shell."""
    if not access:
        return []
    lines = [f"Ray cluster (GCS): {access['gcs_address']}", f"  {access['ray_status']}"]
    if access.get("serve_status"):
        lines += [f"  {access['serve_status']}", f"  dashboard: {access['dashboard']}"]
    return lines


def _this_cluster() -> dict[str, Any] | None:
    """How another shell reaches the cluster this process serves on."""
    import os

    import ray

    from ember.control.listeners import cluster_access

    return dict(cluster_access(ray.get_runtime_context().gcs_address,
                               token_auth=os.environ.get("RAY_AUTH_MODE") == "token",
                               dashboard=ray_internals.dashboard_address()))
