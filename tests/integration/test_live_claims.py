"""Claims proven on a live cluster rather than on fakes: bisection of a poisoned batch in a
replica, each pipeline stage scaling on its own load, and cold-start metric values."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from apps import proof
from harness import scrape
from serving import ControllerWatch, ServeApp
from support import wait_for, wait_for_scale_down

pytestmark = pytest.mark.cluster

APP = proof.app.name


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(proof.app) as base:
        yield base


def _concurrently(url: str, path: str, bodies: list[Any]) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as client:
            return await asyncio.gather(*(client.post(f"{url}{path}", json=b) for b in bodies))

    return asyncio.run(run())


def test_one_poisoned_item_among_64_fails_alone_in_at_most_13_forwards(url: str) -> None:
    assert httpx.post(f"{url}/bisect/reset", timeout=30).status_code == 200
    bodies: list[Any] = [[{"value": i}] for i in range(64)]
    bodies[37] = [{"value": 37, "poison": True}]
    replies = _concurrently(url, "/bisect", bodies)
    codes = [r.status_code for r in replies]
    assert codes[37] == 500 and "ValueError" in replies[37].json()["error"]["message"]
    assert codes[:37] + codes[38:] == [200] * 63, codes
    assert [r.json()[0] for i, r in enumerate(replies) if i != 37] == [
        2 * i for i in range(64) if i != 37]
    forwards = httpx.get(f"{url}/bisect/forwards", timeout=30).json()["forwards"]
    # One batch of 64 (the replica's own count of calls and sizes), then the halving.
    assert forwards[0] == 64, forwards
    assert len(forwards) <= 1 + 2 * math.log2(64), forwards
    # Every good item was answered by a call that did not hold the poisoned one.
    assert sorted(forwards[1:], reverse=True)[:2] == [32, 32], forwards


class _Load:
    """``workers`` callers posting to ``/chain`` back to back until the block ends."""

    def __init__(self, url: str, workers: int) -> None:
        self.url, self.workers = url, workers
        self.codes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:

            async def worker(i: int) -> None:
                # Staggered starts: callers meet at the slow stage, not all at once at the
                # first one (a burst there would be a real reason for it to scale).
                await asyncio.sleep(0.25 * i)
                while not self._stop.is_set():
                    reply = await client.post(f"{self.url}/chain", json={"n": i})
                    self.codes.append(reply.status_code)

            await asyncio.gather(*(worker(i) for i in range(self.workers)))


def test_pipeline_stages_scale_separately_under_load(url: str) -> None:
    assert httpx.post(f"{url}/chain", json={"n": 1}, timeout=60).json() == {"n": 2}
    watches = {stage: ControllerWatch(APP, stage, interval_s=0.1)
               for stage in ("Front", "SlowMiddle", "Back")}
    for watch in watches.values():
        watch.__enter__()
    try:
        # Four callers keep about four requests at the slow stage (1 s each: two replicas'
        # worth at a target of 3) and a fraction of one at each fast stage. Were a request
        # counted at every stage while in the pipeline, the fast ones would scale too.
        with _Load(url, workers=4) as load:
            wait_for(lambda: watches["SlowMiddle"].samples[-1].count("RUNNING") >= 2, 90,
                     what="the slow middle stage to scale out")
    finally:
        for watch in watches.values():
            watch.__exit__(None, None, None)
    assert load.codes and set(load.codes) == {200}, set(load.codes)
    # The fast stages carried the same requests and stayed at one replica all along.
    for stage in ("Front", "Back"):
        assert max(s.target for s in watches[stage].samples) == 1, stage
    assert max(s.target for s in watches["SlowMiddle"].samples) >= 2


def _cold_sums(url: str, deployment: str) -> dict[str, float]:
    """Sums and counts of the cold-start histograms of ``deployment``, in one scrape."""
    sums: dict[str, float] = {}
    for s in scrape(url):
        if s.labels.get("deployment") != deployment:
            continue
        if s.name in ("ember_cold_start_duration_seconds_sum",
                      "ember_cold_start_duration_seconds_count"):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
        elif s.name == "ember_cold_start_phase_seconds_sum":
            key = f"phase:{s.labels['phase']}"
            sums[key] = sums.get(key, 0.0) + s.value
    return sums


def test_cold_start_metric_values_match_the_header_of_the_same_request(url: str) -> None:
    wait_for_scale_down(url, "ColdOne", to=0, timeout_s=60, wake=lambda: httpx.post(
        f"{url}/cold-one", json={"n": 0}, timeout=60).raise_for_status())
    before = _cold_sums(url, "ColdOne")
    reply = httpx.post(f"{url}/cold-one", json={"n": 7}, timeout=90)
    assert reply.status_code == 200 and reply.json()["n"] == 7
    header = dict(p.split("=", 1) for p in reply.headers["x-ember-cold-start"].split(";"))
    count = "ember_cold_start_duration_seconds_count"
    # Edges publish their metrics about once a second; any edge answers for all of them.

    def counted() -> dict[str, float] | None:
        now = _cold_sums(url, "ColdOne")
        return now if now.get(count, 0.0) >= before.get(count, 0.0) + 1 else None

    after = wait_for(counted, 30, what="the cold start's metrics")
    assert after[count] == before.get(count, 0.0) + 1  # this request, and only it
    delta_s = after["ember_cold_start_duration_seconds_sum"] - before.get(
        "ember_cold_start_duration_seconds_sum", 0.0)
    # The header rounds to milliseconds.
    assert delta_s == pytest.approx(int(header.pop("total")) / 1000, abs=0.0015), header
    header.pop("path")
    assert header, "the header names no phase"
    for phase, ms in header.items():
        observed = after.get(f"phase:{phase}", 0.0) - before.get(f"phase:{phase}", 0.0)
        assert observed == pytest.approx(int(ms) / 1000, abs=0.0015), (phase, ms, observed)


def test_a_fresh_replica_loads_with_the_heap_it_imported_frozen(url: str) -> None:
    # This session's cluster has no warm runtime: each replica is a fresh worker, and a full
    # collection over what it imported (Ray, Serve, the app) would stall setup()'s load.
    reply = httpx.post(f"{url}/cold-one", json={"n": 1}, timeout=90)
    assert reply.status_code == 200, reply.text
    assert reply.json()["frozen_at_setup"] > 10_000, reply.json()
