"""Admin is not invoke: ``/-/`` routes take admin keys, or loopback callers when none is set."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from ember.app.config import DeploymentOptions
from ember.edge.auth import ApiKeys, AuthMiddleware
from ember.edge.ingress import IngressState, build_fastapi

INVOKE, ADMIN = "invoke-0123456789abcdef", "admin-0123456789abcdef"


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(keys: ApiKeys, path: str, *, key: str | None = None,
            client: str = "127.0.0.1") -> int:
    async def go() -> int:
        transport = httpx.ASGITransport(app=AuthMiddleware(_ok, keys), client=(client, 5000))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
            return (await http.get(path, headers=headers)).status_code

    return asyncio.run(go())


def test_with_admin_keys_an_invoke_key_is_forbidden_on_admin_routes() -> None:
    keys = ApiKeys([INVOKE], [ADMIN])
    assert _status(keys, "/-/status", key=INVOKE) == 403
    assert _status(keys, "/-/status", key=ADMIN) == 200
    assert _status(keys, "/-/status") == 401
    assert _status(keys, "/-/status", key="wrong-0123456789abcdef") == 401
    # Admin keys reach admin routes from anywhere; invoke routes take either kind of key.
    assert _status(keys, "/-/status", key=ADMIN, client="203.0.113.9") == 200
    assert _status(keys, "/embed", key=INVOKE, client="203.0.113.9") == 200
    assert _status(keys, "/embed", key=ADMIN) == 200


def test_without_admin_keys_admin_routes_answer_loopback_only() -> None:
    open_keys = ApiKeys([])
    assert _status(open_keys, "/-/warm/x", client="127.0.0.1") == 200
    assert _status(open_keys, "/-/warm/x", client="::1") == 200
    assert _status(open_keys, "/-/warm/x", client="203.0.113.9") == 403
    assert _status(open_keys, "/embed", client="203.0.113.9") == 200
    # Invoke auth still applies to loopback callers when it is on.
    invoke_only = ApiKeys([INVOKE])
    assert _status(invoke_only, "/-/status") == 401
    assert _status(invoke_only, "/-/status", key=INVOKE) == 200
    assert _status(invoke_only, "/-/status", key=INVOKE, client="203.0.113.9") == 403


def test_admin_keys_come_from_their_own_variable() -> None:
    keys = ApiKeys.from_env({"EMBER_API_KEYS": INVOKE, "EMBER_ADMIN_KEYS": ADMIN})
    assert keys.admin_enabled and not ApiKeys.from_env({"EMBER_API_KEYS": INVOKE}).admin_enabled
    assert keys.is_admin(keys.match(ADMIN) or "") and not keys.is_admin(keys.match(INVOKE) or "")


@pytest.mark.parametrize(("query", "param", "limit"), [
    ("for=2h", "for", "over the lease limit of 3600s (EMBER_MAX_LEASE_S)"),
    ("for=10m&floor=5", "floor", "over Model's max_replicas of 4"),
])
def test_a_lease_over_its_cap_is_a_400_naming_the_limit(query: str, param: str,
                                                         limit: str) -> None:
    state = IngressState("caps", [], {"Model": DeploymentOptions(max_replicas=4)}, {}, {})

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_fastapi(state), client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as http:
            return await http.post(f"/-/warm/Model?{query}")

    reply = asyncio.run(go())
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert limit in error["message"] and error["param"] == param
