"""Loopback servers for the loader integration tests: moto's S3 server and a plain HTTP server.

The HTTP server serves files from a dict, honours Range and If-Match (unless told not to),
and counts requests so tests can assert how many origin fetches happened.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from ember.loaders import LoaderConfig

SRC_DIR = str(Path(__import__("ember.loaders", fromlist=["_"]).__file__).parents[2])


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.delenv("EMBER_REGIONAL_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def subprocess_env() -> dict[str, str]:
    """The environment for child Python processes: this checkout's ``src`` importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture
def config(tmp_path: Path) -> LoaderConfig:
    return LoaderConfig(
        cache_dir=tmp_path / "node",
        range_bytes=16 << 10,
        max_concurrency=4,
        min_free_bytes=0,
        lease_timeout_s=5.0,
        lease_heartbeat_s=0.5,
        poll_interval_s=0.02,
    )


def make_weights(path: Path, n: int = 16, width: int = 4096) -> dict[str, torch.Tensor]:
    """Write ``n`` float32 tensors of ``width`` elements with safetensors itself."""
    gen = torch.Generator().manual_seed(n)
    tensors = {f"layer.{i:02d}.weight": torch.randn(width, generator=gen) for i in range(n)}
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path))
    return tensors


# -- S3 on loopback ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1, one per test session."""
    from moto.server import ThreadedMotoServer

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint: str, request: pytest.FixtureRequest) -> Any:
    """An s3fs filesystem on the moto server with a fresh bucket for this test."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": s3_endpoint},
        skip_instance_cache=True,
    )
    bucket = "b-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    fs.mkdir(bucket)
    fs.bucket = bucket
    return fs


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "skip_instance_cache": True,
    }


# -- plain HTTP on loopback ----------------------------------------------------------------
@dataclass
class HttpOrigin:
    """State shared with the handler threads."""

    files: dict[str, bytes] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    ignore_range: bool = False
    short_by: int = 0
    delay_s: float = 0.0
    log: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""

    def put(self, name: str, data: bytes) -> str:
        self.files[name] = data
        self.etags[name] = '"' + hashlib.md5(data).hexdigest() + '"'
        return f"{self.url}/{name}"

    def ranged_gets(self, name: str) -> list[str]:
        with self.lock:
            return [r for m, p, r in self.log if m == "GET" and p == f"/{name}"]


def _handler(origin: HttpOrigin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _head(self, code: int, length: int, extra: dict[str, str]) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(length))
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()

        def do_HEAD(self) -> None:
            name = self.path.lstrip("/")
            if name not in origin.files:
                self._head(404, 0, {})
                return
            self._head(200, len(origin.files[name]), {"ETag": origin.etags[name]})

        def do_GET(self) -> None:
            name = self.path.lstrip("/")
            rng = self.headers.get("Range", "")
            with origin.lock:
                origin.log.append(("GET", self.path, rng))
            time.sleep(origin.delay_s)
            data = origin.files.get(name)
            if data is None:
                self._head(404, 0, {})
                return
            etag = origin.etags[name]
            match = self.headers.get("If-Match")
            if match and match != etag:
                self._head(412, 0, {})
                return
            m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
            if origin.ignore_range or not m:
                self._head(200, len(data), {"ETag": etag})
                self.wfile.write(data)
                return
            start, end = int(m.group(1)), min(int(m.group(2)), len(data) - 1)
            body = data[start : end + 1]
            body = body[: max(0, len(body) - origin.short_by)]
            self._head(
                206, len(body), {"ETag": etag, "Content-Range": f"bytes {start}-{end}/{len(data)}"}
            )
            self.wfile.write(body)

    return Handler


@pytest.fixture
def http_origin() -> Iterator[HttpOrigin]:
    """A threaded stdlib HTTP server on 127.0.0.1 serving :class:`HttpOrigin` files."""
    origin = HttpOrigin()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(origin))
    server.daemon_threads = True
    origin.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield origin
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


Loader = Callable[..., dict[str, torch.Tensor]]
