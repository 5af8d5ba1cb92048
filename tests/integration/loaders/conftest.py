"""Fixtures of the loader integration tests: a loader config and loopback origins.

moto's S3 server (one per session, a fresh bucket per test) and a plain HTTP server
(``loaders.origins.HttpOrigin``) on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ember.loaders import LoaderConfig

from harness import S3Log, moto_s3
from loaders.origins import HttpOrigin, handler_for


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "env-cache"))
    monkeypatch.delenv("EMBER_REGIONAL_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


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
        # The cache tests check the node cache right after a load returns; write-behind
        # (the default) has its own tests, which wait for the write.
        cache_write="through",
    )


# -- S3 on loopback ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def s3_log() -> S3Log:
    """Every request the session's S3 server received (filter by the test's bucket)."""
    return S3Log()


@pytest.fixture(scope="session")
def s3_endpoint(s3_log: S3Log) -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1, one per test session."""
    with moto_s3(s3_log) as endpoint:
        yield endpoint


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


# -- plain HTTP on loopback ----------------------------------------------------------------
@pytest.fixture
def http_origin() -> Iterator[HttpOrigin]:
    """A threaded stdlib HTTP server on 127.0.0.1 serving :class:`HttpOrigin` files."""
    origin = HttpOrigin()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(origin))
    server.daemon_threads = True
    origin.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield origin
    server.shutdown()
    server.server_close()
