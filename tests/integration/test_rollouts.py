"""Rollouts on a live cluster: a bad candidate rolled back, a good one all the way, specs.

The rollout runs in the cluster's driver actor, judged on what the edges counted; these
tests drive traffic at the edges and read what the driver did.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import httpx
import pytest

from apps import rollouts
from serving import ServeApp
from support import wait_for

pytestmark = pytest.mark.cluster

APP = rollouts.app.name


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(rollouts.app) as base:
        yield base


class Load:
    """Steady requests to ``/embed`` from a thread until the block ends; each answer's
    status, version and cold-start header are kept (transport errors as status 0)."""

    def __init__(self, url: str, workers: int = 2, pause_s: float = 0.02) -> None:
        self.url, self.workers, self.pause_s = url, workers, pause_s
        self.seen: list[tuple[int, str, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(self._worker(client) for _ in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            try:
                reply = await client.post(f"{self.url}/embed", json={"text": "x"})
                self.seen.append((reply.status_code, reply.headers.get("x-ember-version", ""),
                                  "x-ember-cold-start" in reply.headers))
            except httpx.HTTPError:
                self.seen.append((0, "", False))
            await asyncio.sleep(self.pause_s)


def _rollout(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/-/rollout/Embed", timeout=10).json())


def _weights(url: str) -> dict[str, int]:
    return dict(httpx.get(f"{url}/-/traffic/Embed", timeout=10).json()["weights"])


def _every_edge_on(url: str, weights: dict[str, int]) -> bool:
    return all(_weights(url) == weights for _ in range(10))


def _lease(deployment: str) -> dict[str, Any] | None:
    from ember.control.floors import LeaseStore

    return LeaseStore(APP).get(deployment)


@pytest.mark.parametrize(("body", "param"), [
    ({"to": "9"}, "to"), ({"to": "2", "steps": [50, 25, 100]}, "steps"),
    ({"to": "2", "steps": [5, 50]}, "steps"), ({"to": "2", "every_s": -1}, "every_s"),
    ({"to": "2", "max_p99_ratio": 0.9}, "max_p99_ratio")])
def test_bad_rollouts_are_refused_naming_the_field_and_change_nothing(
    url: str, body: dict[str, Any], param: str,
) -> None:
    reply = httpx.put(f"{url}/-/rollout/Embed", json=body, timeout=10)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert _weights(url) == {"1": 100, "2": 0, "3": 0}


def test_a_second_rollout_conflicts_and_the_cli_rolls_the_first_back(
    url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from ember.cli import main
    from ember.cli.serve import render_status

    assert main(["warm", "Embed@2", "--for", "20m", "--url", url]) == 0  # the operator's
    operators = _lease("Embed@2")
    body = {"to": "2", "steps": [50, 100], "every_s": 600}
    assert httpx.put(f"{url}/-/rollout/Embed", json=body, timeout=30).status_code == 200
    wait_for(lambda: _rollout(url)["phase"] == "holding", 60, what="v2 woken, step 1 holding")
    assert _lease("Embed@2") != operators  # the candidate was woken through the rollout's
    again = httpx.put(f"{url}/-/rollout/Embed", json=body, timeout=30)
    assert again.status_code == 409 and "already running" in again.text
    line = "rollout Embed v1 -> v2: running, step 1/2 (50%), holding"
    wait_for(lambda: all(line in render_status(httpx.get(f"{url}/-/status", timeout=10).json())
                         for _ in range(10)), 15, what="every edge's status on step 1")
    assert main(["status", "--url", url]) == 0
    assert line in capsys.readouterr().out
    assert main(["rollback", "Embed", "--url", url]) == 0
    assert capsys.readouterr().out == "Embed: rolled back; v1 100%, v2 0%, v3 0%\n"
    rollout = _rollout(url)
    assert (rollout["state"], rollout["reason"]) == ("rolled_back", "rolled back by the operator")
    assert _lease("Embed@2") == operators  # the operator's lease is back as it was
    assert main(["warm", "Embed@2", "--off", "--url", url]) == 0
    assert _lease("Embed@2") is None
    wait_for(lambda: _every_edge_on(url, {"1": 100, "2": 0, "3": 0}), 15,
             what="every edge back on v1")


def test_a_candidate_failing_30_percent_is_rolled_back_within_two_steps(url: str) -> None:
    body = {"to": "3", "steps": [5, 25, 50, 100], "every_s": 8, "min_requests": 10}
    with Load(url) as load:
        assert httpx.put(f"{url}/-/rollout/Embed", json=body, timeout=30).status_code == 200
        rollout = wait_for(lambda: (r := _rollout(url))["state"] == "failed" and r, 120,
                           what="the bad candidate rolled back")
        wait_for(lambda: _every_edge_on(url, {"1": 100, "2": 0, "3": 0}), 15,
                 what="every edge back on v1")
        sent_after = len(load.seen)
        wait_for(lambda: len(load.seen) > sent_after + 20, 30, what="20 more answers")
    assert rollout["step"] <= 1, rollout["history"]  # rolled back in step 1 or 2
    assert "with 5xx" in rollout["reason"]
    failed = [(status, version) for status, version, _ in load.seen if status != 200]
    assert failed and {version for _, version in failed} == {"3"}
    # Callers lost at most the canary's share of requests (in fact 30% of it).
    share = body["steps"][rollout["step"]] / 100  # type: ignore[index]
    assert len(failed) / len(load.seen) <= share, (len(failed), len(load.seen))
    assert all(version == "1" for _, version, _ in load.seen[sent_after + 10:])
    # Woken before the step: no request to v3 met it cold.
    assert not any(cold for _, version, cold in load.seen if version == "3")
    assert _lease("Embed@3") is None


def test_a_good_candidate_goes_to_100_percent_though_every_edge_is_killed_on_the_way(
    url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    import ray

    from ember.cli import main

    # The two versions run the same code; the p99 bound is wide because edges restarting
    # mid-step slow some requests, which is not what this test is about.
    body = {"to": "2", "steps": [5, 50, 100], "every_s": 4, "min_requests": 10,
            "max_p99_ratio": 20}
    with Load(url) as load:
        assert httpx.put(f"{url}/-/rollout/Embed", json=body, timeout=30).status_code == 200
        wait_for(lambda: _rollout(url)["step"] >= 1, 60, what="the rollout at 50%")
        for edge in _edge_actors():
            ray.kill(edge)
        rollout = wait_for(lambda: (r := _rollout_or_none(url)) and r["state"] != "running"
                           and r, 120, what="the rollout to end after the edges died")
    assert rollout["state"] == "succeeded", (rollout["reason"], rollout["history"])
    assert [e.split(" ", 1)[1] for e in rollout["history"]] == [
        "began: v1 -> v2", "step 1/3: v2 at 5%", "step 2/3: v2 at 50%", "step 3/3: v2 at 100%",
        "succeeded: v2 at 100%"]
    answered = Counter(status for status, _, _ in load.seen if status)
    assert set(answered) == {200}, answered  # edges died, but no answer was an error
    wait_for(lambda: _every_edge_on(url, {"1": 0, "2": 100, "3": 0}), 15,
             what="every edge on v2")
    assert main(["rollout", "Embed", "--status", "--url", url]) == 0
    assert capsys.readouterr().out.startswith("Embed: v1 -> v2 succeeded\n")


def _rollout_or_none(url: str) -> dict[str, Any] | None:
    try:
        return _rollout(url)
    except (httpx.HTTPError, ValueError):  # no edge listening while they are replaced
        return None


def _edge_actors() -> list[Any]:
    import ray
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    edges = client.get_serve_details()["applications"][APP]["deployments"]["ember-edge"]
    return [ray.get_actor(r["actor_name"], namespace="serve") for r in edges["replicas"]]
