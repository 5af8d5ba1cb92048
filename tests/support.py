"""Helpers shared by the test layers (on sys.path through pytest's ``pythonpath``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.2,
             what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def deployment_status(url: str, name: str) -> dict[str, Any]:
    """One deployment's row of ``/-/status``."""
    reply = httpx.get(f"{url}/-/status", timeout=10)
    reply.raise_for_status()
    for row in reply.json()["deployments"]:
        if row["deployment"] == name:
            return dict(row)
    raise KeyError(name)
