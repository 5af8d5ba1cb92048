"""What an idle edge polls and writes: less while nothing changes, at once after a change.

The live figure is ``bench/idle_cpu.py``; these pin the edge's own decisions. The phase the
edge would read from Ray's KV store is fed to its gate, and the board that would write to
the store records what it is given.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from test_drain import _ask, _state

from ember.edge import drain, ingress
from ember.edge.drain import DRAINING, SERVING, STARTING, DrainGate
from ember.edge.ingress import _REPUBLISH_S


class _Stop(Exception):
    pass


def test_the_phase_is_read_fast_while_starting_or_draining_and_slower_while_it_stands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    phases = iter([STARTING, STARTING, SERVING, SERVING, SERVING, SERVING, SERVING, DRAINING,
                   DRAINING])
    gate, periods = DrainGate(), []

    def sync(app: str, edge: str) -> None:
        gate.phase = next(phases)

    async def sleep(seconds: float) -> None:
        periods.append(seconds)
        if len(periods) == 9:
            raise _Stop

    monkeypatch.setattr(gate, "_sync", sync)
    monkeypatch.setattr(asyncio, "sleep", sleep)  # the watch loop's, not asyncio.run's
    with pytest.raises(_Stop):
        asyncio.run(gate.watch("app", "edge"))
    fast, steady = drain.WATCH_PERIOD_S, drain.STEADY_WATCH_PERIOD_S
    assert periods == [fast, fast, fast, 2 * fast, 4 * fast, steady, steady, fast, fast]


class _Board:
    def __init__(self) -> None:
        self.texts: list[bytes] = []

    def publish(self, text: bytes, status: dict[str, Any]) -> None:
        self.texts.append(text)


def test_an_idle_edge_publishes_its_report_again_only_when_it_changed_or_goes_stale() -> None:
    state, _ = _state()
    board = _Board()
    state.board = board  # type: ignore[assignment]
    asyncio.run(state._publish(100.0))
    asyncio.run(state._publish(101.0))
    assert len(board.texts) == 1  # nothing changed: nothing rewritten

    assert _ask(state, ("POST", "/echo"))[0].status_code == 200
    asyncio.run(state._publish(102.0))
    assert len(board.texts) == 2 and board.texts[1] != board.texts[0]

    asyncio.run(state._publish(102.0 + _REPUBLISH_S))
    assert len(board.texts) == 3  # unchanged, but the other edges would drop it as stale


def test_the_replica_poll_backs_off_while_the_states_stand_and_is_fast_again_on_a_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state, _ = _state()
    one, two = ({"Echo": SimpleNamespace(replica_states={"RUNNING": n}, status="HEALTHY",
                                         message="")} for n in (1, 2))
    reads = iter([one, one, one, one, two, two])
    waits: list[float] = []

    async def next_poll(timeout_s: float) -> None:
        waits.append(timeout_s)
        if len(waits) == 6:
            raise _Stop

    monkeypatch.setattr(ingress, "read_replica_states", lambda app: next(reads))
    monkeypatch.setattr(state.tracker, "next_poll", next_poll)
    with pytest.raises(_Stop):
        asyncio.run(state.poll_replicas())
    assert waits == [1.0, 2.0, 3.0, 3.0, 1.0, 2.0]
    assert (ingress._STATUS_POLL_S, ingress._STEADY_POLL_S) == (1.0, 3.0)


def test_a_request_that_finds_a_deployment_cold_cuts_the_polls_wait_short() -> None:
    state, _ = _state()
    state.tracker.loads["Echo"].running = 0

    async def go() -> None:
        waiting = asyncio.ensure_future(state.tracker.next_poll(60.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        with state.tracker.track("Echo"):
            await asyncio.wait_for(waiting, 5.0)  # not the 60 s it was asked to wait

    asyncio.run(go())
