"""A stream for a LoRA adapter carries Ray Serve's multiplexed model id, so Serve's router
sends it to a replica holding the adapter; a stream for the base carries none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ember.app.decorator import RouteSpec
from ember.deployments import textgen
from ember.edge._dispatch import Dispatcher
from ember.edge._metrics import Metrics
from ember.edge._state import LoadTracker


class _Stream:
    """A ``DeploymentResponseGenerator`` of two chunks."""

    def __init__(self) -> None:
        self._chunks = iter([{"text": "a"}, {"text": "b"}])

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        """Nothing runs: a no-op, as on a finished stream."""


class _Handle:
    """A handle that records the options each stream was sent with."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._options: dict[str, Any] = {}

    def options(self, **options: Any) -> _Handle:
        handle = _Handle()
        handle.sent, handle._options = self.sent, {**self._options, **options}
        return handle

    def remote(self, *args: Any) -> _Stream:
        self.sent.append(self._options)
        return _Stream()


def test_an_adapter_stream_carries_the_multiplexed_model_id_and_a_base_one_none() -> None:
    options = {spec.name: spec.options for spec in textgen.app.specs}
    tracker = LoadTracker(options, Metrics())
    for load in tracker.loads.values():
        load.running = 1  # a replica runs: no cold start to measure
    handle = _Handle()
    dispatcher = Dispatcher({"TextGen": handle}, options, tracker)  # type: ignore[dict-item]
    route = RouteSpec(path="TextGen.generate", http_method="POST", deployment="TextGen",
                      attr="generate", input_model=None, output_model=None, is_async=True,
                      is_stream=True)

    async def run(model_id: str | None) -> list[Any]:
        return [c async for c in dispatcher.stream(route, {}, "r", model_id=model_id)]

    assert asyncio.run(run("sql")) == [{"text": "a"}, {"text": "b"}]
    asyncio.run(run(None))
    streams = [s for s in handle.sent if s.get("method_name") == "ember_stream"]
    assert [s.get("multiplexed_model_id") for s in streams] == ["sql", None]
