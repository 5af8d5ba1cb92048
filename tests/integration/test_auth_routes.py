"""With invoke and admin keys set: every route but /healthz and /readyz needs a key, admin
routes (``/-/...``) an admin key; a walk of every route the edge serves for the app."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from apps import features
from serving import ServeApp

pytestmark = pytest.mark.cluster

KEY = "test-key-0123456789abcdef"
ADMIN = "admin-key-0123456789abcdef"
#: Read by the ingress when the app is deployed. ``another-key`` (admin) is the rate test's.
ENV = {"EMBER_API_KEYS": KEY, "EMBER_ADMIN_KEYS": f"{ADMIN},another-key-0123456789",
       "EMBER_RATE_LIMIT_RPS": "2", "EMBER_RATE_LIMIT_BURST": "6"}
#: Values for the path parameters of the app's routes.
PATH_VALUES = {"deployment": "Summer", "name": "doubler", "model_name": "doubler"}


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(features.app, env=ENV) as base:
        yield base


async def _never_called(attr: str, *args: object) -> object:
    raise AssertionError("only the routes are read; no handle is called")


def _every_route() -> list[tuple[str, str]]:
    """Every (method, path) the edge serves for the app, read from the FastAPI app that the
    ingress builds (not a hand list, so a new route is walked too), path parameters filled."""
    from serve_fakes import FakeHandle, as_handle

    from ember.edge.auth import ApiKeys
    from ember.edge.ingress import IngressState, build_fastapi

    app = features.app
    handles = {s.name: as_handle(FakeHandle(_never_called)) for s in app.specs}
    state = IngressState(app.name, list(app.routes()), {s.name: s.options for s in app.specs},
                         handles, app.timeouts(), app.protocols, None, frozenset(),
                         ApiKeys([]), None)
    routes = []
    for route in build_fastapi(state).routes:
        path = getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                routes.append((method, path.format(**PATH_VALUES)))  # KeyError: a new param
    return [*routes, ("GET", "/nowhere")]


def _call(method: str, path: str, url: str, key: str | None) -> httpx.Response:
    """One request, retried while the per-key rate limit (which runs after auth) says 429."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + 60
    while True:
        reply = httpx.request(method, f"{url}{path}", headers=headers, json={}, timeout=30)
        if reply.status_code != 429 or time.monotonic() > deadline:
            return reply
        time.sleep(float(reply.headers["retry-after"]))


def test_every_route_refuses_without_a_valid_key(url: str) -> None:
    routes = _every_route()
    assert len(routes) >= 20 and any(p.startswith("/-/") for _, p in routes)
    for method, path in routes:
        if path in ("/healthz", "/readyz"):
            continue
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
            reply = httpx.request(method, f"{url}{path}", headers=headers, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.status_code)
            assert reply.headers["www-authenticate"].startswith("Bearer")
            assert KEY not in reply.text


def test_invoke_keys_are_refused_on_every_admin_route_and_admin_keys_pass_everywhere(
        url: str) -> None:
    walked = 0
    for method, path in _every_route():
        admin_route = path.startswith("/-/")
        invoke = _call(method, path, url, KEY)
        if admin_route:
            assert invoke.status_code == 403, (method, path, invoke.status_code, invoke.text)
            assert "invoke key cannot call admin routes" in invoke.text
        else:
            assert invoke.status_code not in (401, 403), (method, path, invoke.text)
        admin = _call(method, path, url, ADMIN)
        assert admin.status_code not in (401, 403), (method, path, admin.text)
        walked += admin_route
    assert walked >= 8, walked  # status, warm, traffic, shadow, rollout, rollback...
    # The walk spent this key's bucket, so the cleanup retries on 429 like every other call.
    assert _call("DELETE", "/-/warm/Summer", url, ADMIN).status_code in (200, 404)


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
