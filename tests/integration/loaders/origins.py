"""Weights and loopback origins for the loader integration tests.

The HTTP origin serves files from a dict, honours Range and If-Match (unless told not to),
and counts requests so tests can assert how many origin fetches happened. Test modules
import this as ``loaders.origins`` (``tests/integration`` is on pytest's ``pythonpath``);
the fixtures that start the servers are in ``conftest.py`` beside it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import ember.loaders

from harness import s3_options as s3_options  # re-exported: the loader tests import it here

#: The ``src`` directory of this checkout, for child processes that import ``ember``.
SRC_DIR = str(Path(ember.loaders.__file__).parents[2])


def subprocess_env() -> dict[str, str]:
    """The environment for child Python processes: this checkout's ``src`` importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC_DIR, env.get("PYTHONPATH")) if p)
    return env


def make_weights(path: Path, n: int = 16, width: int = 4096) -> dict[str, torch.Tensor]:
    """Write ``n`` float32 tensors of ``width`` elements with safetensors itself."""
    gen = torch.Generator().manual_seed(n)
    tensors = {f"layer.{i:02d}.weight": torch.randn(width, generator=gen) for i in range(n)}
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path))
    return tensors


@dataclass
class HttpOrigin:
    """State shared with the handler threads."""

    files: dict[str, bytes] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    ignore_range: bool = False
    short_by: int = 0
    delay_s: float = 0.0
    #: What HEAD answers for a file it does not hold (an S3 website or CDN may say 403).
    missing_status: int = 404
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

    def heads(self, name: str) -> int:
        with self.lock:
            return sum(1 for m, p, _ in self.log if m == "HEAD" and p == f"/{name}")


def handler_for(origin: HttpOrigin) -> type[BaseHTTPRequestHandler]:
    """A request handler class that serves ``origin``'s files."""

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
            with origin.lock:
                origin.log.append(("HEAD", self.path, ""))
            if name not in origin.files:
                self._head(origin.missing_status, 0, {})
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
