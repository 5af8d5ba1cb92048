"""With API keys set, every route but /healthz and /readyz needs one; a walk of all routes."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from apps import features
from serving import ServeApp

pytestmark = pytest.mark.cluster

KEY = "test-key-0123456789abcdef"
#: Read by the ingress when the app is deployed.
ENV = {"EMBER_API_KEYS": f"{KEY},another-key-0123456789", "EMBER_RATE_LIMIT_RPS": "2",
       "EMBER_RATE_LIMIT_BURST": "6"}


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(features.app, env=ENV) as base:
        yield base


def _every_route(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json", timeout=30,
                     headers={"authorization": f"Bearer {KEY}"}).json()
    routes = [(m.upper(), p) for p, item in spec["paths"].items() for m in item]
    routes += [("GET", p) for p in ("/docs", "/openapi.json", "/metrics", "/-/status",
                                    "/nowhere")]
    return [*routes, ("POST", "/-/warm/Summer"), ("DELETE", "/-/warm/Summer")]


def test_every_route_refuses_without_a_valid_key(url: str) -> None:
    routes = _every_route(url)
    assert len(routes) >= 12
    for method, path in routes:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
            reply = httpx.request(method, f"{url}{path.replace('{name}', 'doubler')}",
                                  headers=headers, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.status_code)
            assert reply.headers["www-authenticate"].startswith("Bearer")
            assert KEY not in reply.text


def test_valid_key_is_let_in_and_health_stays_open(url: str) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
    assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", headers=auth, timeout=30).status_code == 200
    reply = httpx.post(f"{url}/sum", json=[{"values": [1, 2]}], headers=auth, timeout=30)
    assert reply.status_code == 200 and reply.json()[0]["total"] == 3


def test_rate_limit_answers_429_with_retry_after(url: str) -> None:
    auth = {"authorization": "Bearer another-key-0123456789"}
    replies = [httpx.get(f"{url}/-/status", headers=auth, timeout=30) for _ in range(20)]
    limited = [r for r in replies if r.status_code == 429]
    assert limited, "20 requests in a second or two should exceed a burst of 6 at 2/s"
    assert int(limited[0].headers["retry-after"]) >= 1
    assert [r.status_code for r in replies[:6]] == [200] * 6  # the burst itself is served
