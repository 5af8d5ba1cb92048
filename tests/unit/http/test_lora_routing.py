"""A stream for a LoRA adapter carries Ray Serve's multiplexed model id, so Serve's router
sends it to a replica holding the adapter; a stream for the base carries none. TextGen's
replica count comes from the environment, one replica by default."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ember import settings
from ember.app.decorator import RouteSpec, get_spec
from ember.deployments import textgen
from ember.edge._dispatch import Dispatcher
from ember.edge._metrics import Metrics
from ember.edge._state import LoadTracker
from ember.errors import ConfigError


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


def test_textgen_runs_one_replica_scaled_to_zero_unless_told_otherwise() -> None:
    options = get_spec(textgen.TextGen).options
    assert (options.warm_floor, options.max_replicas, options.router) == (0, 1, "prefix")
    assert textgen.replica_bounds(settings.load({})) == (0, 1)
    assert textgen.replica_bounds(settings.load({
        "EMBER_TEXTGEN_MAX_REPLICAS": "4", "EMBER_TEXTGEN_WARM_FLOOR": "2"})) == (2, 4)


def test_a_textgen_floor_above_its_most_replicas_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"EMBER_TEXTGEN_WARM_FLOOR=3 is above "
                                          r"EMBER_TEXTGEN_MAX_REPLICAS=2"):
        textgen.replica_bounds(settings.load({"EMBER_TEXTGEN_MAX_REPLICAS": "2",
                                              "EMBER_TEXTGEN_WARM_FLOOR": "3"}))
