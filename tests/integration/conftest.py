"""One local Ray cluster per test session, shut down at the end; one Serve HTTP port."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from support import free_port


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    from ember.platform import runtime

    # Fractional CPUs: every test deployment asks for 0.1-0.25 CPU on this 2-core machine.
    runtime.start_ray(num_cpus=4)
    yield
    runtime.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster: None) -> int:
    from ray import serve
    from ray.serve.config import HTTPOptions

    port = free_port()
    os.environ["EMBER_PORT"] = str(port)
    serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port), proxy_location="HeadOnly")
    return port
