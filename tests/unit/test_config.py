"""Decorator and option validation: mistakes surface at import with a useful message."""

from __future__ import annotations

import pytest
import torch
from pydantic import BaseModel

import ember
from ember.app.config import DeploymentOptions, to_ray_options
from ember.app.decorator import get_spec
from ember.errors import ConfigError


class In(BaseModel):
    x: float


def test_bare_decorator_uses_defaults_and_class_name_route() -> None:
    @ember.deployment
    class Doubler:
        def __call__(self, body: In) -> float:
            return body.x * 2

    spec = get_spec(Doubler)
    assert spec.name == "Doubler"
    assert [(r.http_method, r.path) for r in spec.routes] == [("POST", "/doubler")]
    assert spec.options.warm_floor == 0
    assert Doubler()(In(x=2)) == 4  # the class stays a plain class


def test_options_and_extra_routes() -> None:
    @ember.deployment(route="/mlp", warm_floor=1, max_replicas=3)
    class Mlp:
        async def __call__(self, body: In) -> dict[str, float]:
            return {"y": body.x}

        @ember.route("/mlp/meta", method="GET")
        def meta(self) -> dict[str, str]:
            return {}

    routes = {(r.http_method, r.path): r for r in get_spec(Mlp).routes}
    assert routes[("POST", "/mlp")].is_async
    assert routes[("GET", "/mlp/meta")].input_model is None


@pytest.mark.parametrize(("options", "message"), [
    ({"route": "embed"}, "route must start with '/', e.g. '/embed'"),
    ({"route": "/-/admin"}, "reserved"),
    ({"route": "/a/../b"}, "may contain only"),
    ({"warm_floor": 5, "max_replicas": 2}, "warm_floor (5) must not exceed max_replicas (2)"),
    ({"warm_floor": -1}, "warm_floor"),
    ({"target_queue_depth": 8, "max_ongoing_requests": 2}, "max_ongoing_requests (2)"),
    ({"name": "bad name"}, "must start with a letter"),
    ({"max_request_bytes": 0}, "max_request_bytes"),
    ({"colour": "red"}, "colour"),
])
def test_bad_options_are_refused_at_decoration(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        @ember.deployment(**options)  # type: ignore[call-overload]
        class Thing:
            def __call__(self, body: In) -> float:
                return 0.0
    assert message in str(info.value)


def test_body_must_be_annotated() -> None:
    with pytest.raises(ConfigError, match="annotate the body"):
        @ember.deployment
        class Bad:
            def __call__(self, body) -> float:  # type: ignore[no-untyped-def]
                return 0.0


def test_body_kinds() -> None:
    @ember.deployment(batch=ember.Batch(max_size=8))
    class Kinds:
        def __call__(self, items: list[str]) -> list[int]:
            return [len(i) for i in items]

        @ember.route("/kinds/t")
        def t(self, x: torch.Tensor) -> torch.Tensor:
            return x

        @ember.route("/kinds/v")
        def v(self, x: dict[str, int]) -> int:
            return 0

    kinds = {r.attr: (r.kind, r.http_servable) for r in get_spec(Kinds).routes}
    assert kinds == {"__call__": ("batch", True), "t": ("tensor", False), "v": ("value", True)}
    # batching raises the autoscaling target to a batch's worth unless set explicitly
    assert get_spec(Kinds).options.target_queue_depth == 8
    assert get_spec(Kinds).options.ongoing_limit() == 16


def test_class_without_handler_is_refused() -> None:
    with pytest.raises(ConfigError, match="nothing to serve"):
        @ember.deployment
        class Empty:
            pass


def test_setup_taking_arguments_is_refused() -> None:
    with pytest.raises(ConfigError, match="setup must be a method taking only self"):
        @ember.deployment
        class Bad:
            def setup(self, path: str) -> None: ...

            def __call__(self, body: In) -> float:
                return 0.0


def test_app_refuses_duplicate_routes() -> None:
    @ember.deployment(route="/same")
    class A:
        def __call__(self, body: In) -> float:
            return 0.0

    @ember.deployment(route="/same")
    class B:
        def __call__(self, body: In) -> float:
            return 0.0

    with pytest.raises(ConfigError, match="served by both A and B"):
        ember.App([A, B])


def test_app_refuses_undecorated_class() -> None:
    class Plain:
        pass

    with pytest.raises(ConfigError, match=r"decorate it with @ember\.deployment"):
        ember.App([Plain])


def test_ray_options_zero_ray_delays_and_derive_concurrency() -> None:
    opts = DeploymentOptions(target_queue_depth=4, warm_floor=1, max_queue=10)
    ray_opts = to_ray_options(opts, name="m")
    auto = ray_opts["autoscaling_config"]
    assert ray_opts["max_ongoing_requests"] == 8  # not Ray's default of 5
    assert ray_opts["max_queued_requests"] == 10
    assert auto["min_replicas"] == 1 and auto["initial_replicas"] == 1
    assert auto["upscale_delay_s"] == auto["downscale_delay_s"] == 0
    assert auto["policy"]["policy_function"].endswith(":EmberAutoscalingPolicy")


def test_env_override_of_scaledown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_SCALEDOWN_AFTER_S", "3")
    assert DeploymentOptions().with_env_overrides().scaledown_after_s == 3
    monkeypatch.setenv("EMBER_SCALEDOWN_AFTER_S", "soon")
    with pytest.raises(ValueError, match="EMBER_SCALEDOWN_AFTER_S"):
        DeploymentOptions().with_env_overrides()
