"""One local Ray cluster per test session, one HTTP port for its apps, one way to serve one."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager

import pytest

import ember

from serving import ServeApp, served
from support import free_port


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from ember.cluster import runtime

    # Set before Ray starts so that every worker inherits it (see apps/faults.py).
    os.environ["EMBER_TEST_STATE_DIR"] = str(tmp_path_factory.mktemp("replica-state"))
    # Fractional CPUs: every test deployment asks for 0.1-0.25 CPU on this 2-core machine.
    # No warm runtime: preloading torch in every worker of this shared cluster would cost each
    # test app's edges and replicas seconds and 300 MB; tests/e2e covers it under `ember run`.
    runtime.start_ray(num_cpus=4, warm=False)
    yield
    runtime.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster: None) -> int:
    from ray import serve

    port = free_port()
    os.environ["EMBER_PORT"] = str(port)
    # Ember's edges listen on the port; Serve's proxy is not started, as under `ember run`.
    serve.start(proxy_location="Disabled")
    return port


@pytest.fixture(scope="session")
def serve_app(serve_port: int) -> ServeApp:
    """Serve an app for as long as a ``with`` block: ``with serve_app(app) as url: ...``."""

    def serve(app: ember.App, *, ready_timeout_s: float = 90,
              env: Mapping[str, str] | None = None) -> AbstractContextManager[str]:
        return served(app, serve_port, ready_timeout_s=ready_timeout_s, env=env)

    return serve
