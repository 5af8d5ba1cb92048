"""Core behaviour on a real local Ray cluster over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apps import core
from harness import ControllerLog, by_label, scrape
from serving import ControllerWatch, ServeApp, read_deployment
from support import deployment_status, wait_for, wait_for_scale_down

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def url(serve_app: ServeApp) -> Iterator[str]:
    with serve_app(core.app, ready_timeout_s=60) as base:
        yield base


def test_echo_round_trip(url: str) -> None:
    reply = httpx.post(f"{url}/echo", json={"text": "ab", "repeat": 3}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"] == "ababab"
    assert reply.headers["x-request-id"]


def test_extra_route_with_get(url: str) -> None:
    reply = httpx.get(f"{url}/echo/info", timeout=30)
    assert reply.status_code == 200
    assert reply.json() == {"deployment": "Echo", "cuda_visible_devices": ""}


def test_openapi_describes_bodies(url: str) -> None:
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    assert {"/echo", "/echo/info", "/sleep", "/fault", "/cold"} <= set(spec["paths"])
    body = spec["paths"]["/echo"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"].endswith("/EchoIn")
    assert "text" in spec["components"]["schemas"]["EchoIn"]["properties"]
    assert httpx.get(f"{url}/docs", timeout=30).status_code == 200


def test_malformed_json_is_400(url: str) -> None:
    reply = httpx.post(f"{url}/echo", content=b'{"text": ', timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "MalformedJSON"


def test_wrong_type_is_422_naming_the_field(url: str) -> None:
    reply = httpx.post(f"{url}/echo", json={"text": "a", "repeat": "many"}, timeout=30)
    assert reply.status_code == 422
    fields = [f["field"] for f in reply.json()["error"]["fields"]]
    assert fields == ["body.repeat"]


def test_unknown_route_404_and_wrong_method_405(url: str) -> None:
    assert httpx.get(f"{url}/nowhere", timeout=30).status_code == 404
    assert httpx.get(f"{url}/echo", timeout=30).status_code == 405


def test_body_over_limit_is_413(url: str) -> None:
    reply = httpx.post(f"{url}/echo", json={"text": "x" * 5000}, timeout=30)
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "PayloadTooLarge"


def test_chunked_body_over_limit_is_413(url: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"text": "'
        for _ in range(64):
            yield b"y" * 100
        yield b'"}'

    reply = httpx.post(f"{url}/echo", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413
    # the server is unharmed
    assert httpx.post(f"{url}/echo", json={"text": "ok"}, timeout=30).status_code == 200


def test_user_exception_is_500_with_request_id_and_replica_survives(url: str) -> None:
    reply = httpx.post(f"{url}/fault", json={"fail": True}, timeout=30)
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert error["type"] == "UserCodeError"
    assert error["request_id"] == reply.headers["x-request-id"]
    assert "ValueError" in error["message"]
    assert httpx.post(f"{url}/fault", json={"fail": False}, timeout=30).json() == {"ok": "yes"}


def test_timeout_is_504_and_cancels_the_work(url: str, tmp_path: Path) -> None:
    marker = tmp_path / "cancelled"
    started = time.monotonic()
    reply = httpx.post(f"{url}/sleep", json={"seconds": 10, "marker": str(marker)}, timeout=30)
    assert reply.status_code == 504
    assert time.monotonic() - started < 8  # answered at the deadline, not after the work
    wait_for(marker.exists, 10, what="the handler to see its cancellation")


def test_queue_full_is_fast_503_with_retry_after(url: str) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            calls = [client.post(f"{url}/sleep", json={"seconds": 1.0}) for _ in range(12)]
            return await asyncio.gather(*calls)

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    rejected = [r for r in replies if r.status_code == 503]
    assert rejected, codes
    assert all(r.headers.get("retry-after") for r in rejected)
    assert all(r.elapsed.total_seconds() < 1.0 for r in rejected), "503 must not wait"
    assert set(codes) <= {200, 503, 504}, codes
    # After the burst the deployment serves again.
    wait_for(lambda: httpx.post(f"{url}/sleep", json={"seconds": 0}, timeout=30).status_code
             == 200, 20, what="recovery")


def test_unplaceable_replica_is_a_503_with_its_reason_within_10_s(url: str) -> None:
    sent = time.monotonic()
    reply = httpx.post(f"{url}/huge", timeout=60)
    waited = time.monotonic() - sent
    assert reply.status_code == 503, reply.text
    error = reply.json()["error"]
    assert error["type"] == "WaitingForResources"
    assert error["message"].startswith(
        "deployment 'Huge' is waiting for resources: needs CPU 64.0, "), error
    assert reply.headers["retry-after"] == "5"
    assert waited < 10, f"the caller waited {waited:.1f} s for the reason"
    # While the replica is still asked for, a second caller is refused without waiting for
    # a replica, and the status says why. The margin is for a new connection meeting another
    # edge that has not yet read the states (edges read them about once a second): the
    # first caller's wait, up to 10 s, is what this must not repeat.
    again = httpx.post(f"{url}/huge", timeout=60)
    assert again.status_code == 503 and again.elapsed.total_seconds() < 3.0
    # Each edge reads replica states about once a second: every edge says why, soon.
    wait_for(lambda: all(str(deployment_status(url, "Huge")["waiting_for_resources"])
                         .startswith("waiting for resources: needs CPU 64.0")
                         for _ in range(6)), 15, what="every edge's status to say why")


def _watch_for(windows: int, deployment: str) -> ControllerWatch:
    """The controller's decisions on ``deployment`` over ``windows`` of its scale-down
    windows (plus a second), read every 0.1 s."""
    span_s = windows * core.app.spec(deployment).options.scaledown_after_s + 1
    with ControllerWatch(core.app.name, deployment, interval_s=0.1) as watch:
        wait_for(lambda: watch.samples[-1].at - watch.samples[0].at > span_s, span_s + 30,
                 what=f"{span_s:g} s of {deployment}'s decisions")
    return watch


def test_floor_is_respected_when_idle(url: str) -> None:
    # A claim about a window: every decision the controller makes while Echo idles for
    # three of its scale-down windows keeps the floor (a dip and recovery fails too).
    watch = _watch_for(3, "Echo")
    assert min(s.target for s in watch.samples) >= 1, [s.target for s in watch.samples]
    assert min(s.count("RUNNING") for s in watch.samples) >= 1
    assert deployment_status(url, "Echo")["replicas_running"] >= 1
    assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200


def _cold_at_zero(url: str) -> None:
    """Wake Cold, then see it scale back down to zero replicas."""
    wait_for_scale_down(url, "Cold", to=0, timeout_s=40, wake=lambda: httpx.post(
        f"{url}/cold", json={"item": -1, "seconds": 0}, timeout=60).raise_for_status())


def _burst(url: str, n: int) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=90) as client:
            return await asyncio.gather(*(client.post(f"{url}/cold", json={"item": i})
                                          for i in range(n)))

    return asyncio.run(run())


def test_scale_to_zero_then_burst_of_20_all_answered(url: str) -> None:
    _cold_at_zero(url)
    replies = _burst(url, 20)
    assert [r.status_code for r in replies] == [200] * 20
    assert sorted(r.json()["item"] for r in replies) == list(range(20))
    status = deployment_status(url, "Cold")
    assert status["last_cold_start"] is not None
    assert status["cold_starts"] >= 1


def _controller_log() -> ControllerLog:
    import ray

    context = ray.get_runtime_context()
    return ControllerLog(Path(context.get_temp_dir()) / context.get_session_name())


def test_a_scale_up_creates_its_replica_in_the_control_step_that_decides_it(url: str) -> None:
    # Serve updates deployments before it runs the autoscaling policies, then sleeps one
    # control-loop interval: unwrapped, "Adding" follows "Upscaling" a whole interval later.
    from ray.serve._private.constants import CONTROL_LOOP_INTERVAL_S

    _cold_at_zero(url)
    log = _controller_log()
    assert [r.status_code for r in _burst(url, 1)] == [200]
    cold = f"Deployment(name='Cold', app='{core.app.name}')"

    def decided_and_added() -> tuple[tuple[float, str], tuple[float, str]] | None:
        upscaled = log.first(f"Upscaling {cold} from 0 to")
        added = upscaled and log.first(f"-- Adding 1 replica to {cold}", after=upscaled[0])
        return (upscaled, added) if upscaled and added else None

    upscaled, added = wait_for(decided_and_added, 30, what="the controller's scale-up lines")
    assert added[0] - upscaled[0] < CONTROL_LOOP_INTERVAL_S, (upscaled[1], added[1])


def test_burst_of_16_at_zero_asks_for_8_replicas_before_the_first_runs(url: str) -> None:
    n, options = 16, core.app.spec("Cold").options
    promised = min(math.ceil(n / options.target_queue_depth), options.max_replicas)
    _cold_at_zero(url)
    with ControllerWatch(core.app.name, "Cold") as watch:
        replies = _burst(url, n)
    assert [r.status_code for r in replies] == [200] * n
    first_running = watch.first("RUNNING")
    assert first_running is not None, "no sample saw a running replica of Cold"
    before = [s for s in watch.samples if s.at < first_running.at]
    asked = max(s.target for s in before)
    assert promised == 8, "the app under test must promise 16 / 2 = 8 replicas"
    # One decision, before any replica could serve: what the queue needs, capped.
    assert asked == promised, (
        f"while no replica of Cold ran, the controller asked for {asked} replica(s) for "
        f"{n} queued requests; the policy promises min(ceil({n}/"
        f"{options.target_queue_depth:g}), {options.max_replicas}) = {promised}")
    assert max(s.target for s in watch.samples) <= options.max_replicas
    peak = max(s.count("STARTING", "RUNNING") for s in watch.samples)
    assert peak == promised, f"{peak} replica(s) started, {promised} promised"


def _too_large_by_edge(url: str) -> dict[str, float]:
    """``ember_requests_rejected_total`` for too-large bodies to Echo, by edge, one scrape."""
    return by_label(scrape(url), "ember_requests_rejected_total", "edge", deployment="Echo",
                    reason="too_large")


def test_one_scrape_holds_every_edges_metrics(url: str) -> None:
    before = sum(_too_large_by_edge(url).values())
    assert httpx.post(f"{url}/echo", json={"text": "hi"}, timeout=30).status_code == 200
    sent = 16
    for _ in range(sent):  # each on a new connection, which the kernel gives to either edge
        reply = httpx.post(f"{url}/echo", content=b"x" * 4096, timeout=30)
        assert reply.status_code == 413
    # Edges publish their metrics about once a second; any edge answers for all of them.
    # Each scrape may meet the other edge, whose copy of this one's counters can be a
    # second older: the checks below read the one scrape that showed every rejection.
    def complete() -> dict[str, float] | None:
        by_edge = _too_large_by_edge(url)
        return by_edge if sum(by_edge.values()) >= before + sent else None

    by_edge = wait_for(complete, 15, what=f"{sent} more too-large rejections in one scrape")
    assert sum(by_edge.values()) == before + sent  # none counted twice
    assert len(by_edge) == 2, by_edge  # both edges refused some, and both are in the scrape
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in ("ember_replicas", "ember_requests_ongoing", "ember_requests_queued",
                   "ember_request_duration_seconds_bucket", "ember_requests_rejected_total"):
        assert family + "{" in text, family
    # Declared before the first cold start (which the cold-start tests check).
    for family in ("ember_cold_starts_total counter", "ember_cold_start_duration_seconds "
                   "histogram", "ember_cold_start_phase_seconds histogram"):
        assert f"# TYPE {family}" in text, family


def test_healthz(url: str) -> None:
    assert httpx.get(f"{url}/healthz", timeout=30).json() == {"status": "ok"}


def _cold_in_controller(target: int) -> bool:
    """Serve's controller targets ``target`` Cold replicas and runs that many.

    Read from the controller, not an edge: each edge polls its own view, and the one that
    answers may be a poll behind (one showed the burst's last replica still running).
    """
    sample = read_deployment(core.app.name, "Cold")
    return sample.target == target and sample.count("RUNNING") == target


def test_lease_holds_a_floor_without_traffic_then_ends(url: str) -> None:
    wait_for(lambda: _cold_in_controller(0), 40, what="Cold at zero")
    reply = httpx.post(f"{url}/-/warm/Cold", params={"for": "60"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["floor"] == 1
    wait_for(lambda: _cold_in_controller(1), 60, what="the lease to start a replica")
    # Every controller decision over twice Cold's scale-down window keeps the lease's floor.
    watch = _watch_for(2, "Cold")
    assert min(s.target for s in watch.samples) == 1, [s.target for s in watch.samples]
    assert min(s.count("RUNNING") for s in watch.samples) == 1
    assert httpx.delete(f"{url}/-/warm/Cold", timeout=30).status_code == 200
    wait_for(lambda: _cold_in_controller(0), 40, what="Cold back at zero once the lease ended")


def test_lease_on_unknown_or_unsafe_name_touches_nothing(url: str) -> None:
    assert httpx.post(f"{url}/-/warm/Nope", timeout=30).status_code == 404
    for name in ("..%2F..%2Fetc", "%2e%2e%2f", "Cold%00", "a%5Cb", "%2Fetc%2Fpasswd"):
        reply = httpx.post(f"{url}/-/warm/{name}", timeout=30)
        assert reply.status_code in (400, 404), (name, reply.status_code)
        if reply.status_code == 404:  # the router never matched: no handler ran
            assert reply.json()["error"]["type"] == "NotFound"
    assert httpx.post(f"{url}/-/warm/..", timeout=30).status_code in (400, 404)
    bad = httpx.post(f"{url}/-/warm/Cold%00", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequest"
    bad = httpx.post(f"{url}/-/warm/Cold", params={"for": "forever"}, timeout=30)
    assert bad.status_code == 422 and "10m" in bad.json()["error"]["message"]


HOSTILE = [b'{"fail": NaN}', b'{"fail": 1e999}', b'{"fail": true, "fail": false}',
           b"[" * 100_000 + b"]" * 100_000]


@pytest.mark.parametrize("body", HOSTILE, ids=["nan", "1e999", "duplicate-keys", "deep"])
def test_hostile_json_is_refused_fast_and_the_server_keeps_serving(url: str, body: bytes) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{url}/fault", content=body, timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["status"] == 400
    assert time.monotonic() - started < 5
    assert httpx.post(f"{url}/fault", json={"fail": False}, timeout=30).status_code == 200


def test_compressed_body_is_refused_unread(url: str) -> None:
    import gzip

    reply = httpx.post(f"{url}/echo", content=gzip.compress(b'{"text": "x"}' * 10), timeout=30,
                       headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert reply.status_code == 415


def test_huge_headers_are_refused(url: str) -> None:
    headers = {f"x-filler-{i}": "y" * 1000 for i in range(70)}  # 70 KiB of headers
    try:
        reply = httpx.get(f"{url}/healthz", headers=headers, timeout=30)
    except httpx.RemoteProtocolError:
        pass  # the HTTP server dropped the connection before the app: also a refusal
    else:
        assert reply.status_code in (400, 431)
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200
