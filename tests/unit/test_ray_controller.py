"""Ember's hooks in Serve's controller, driven without a cluster.

The scale-up hook runs Ray's own ``DeploymentStateManager.autoscale`` over stand-in
deployment states; the starting-replica hook a stand-in ``check_ready`` whose object ref is
a plain future; the demand hook stand-in reports and applications. On a live controller:
the scale-up in ``tests/integration/test_core.py``, all of them (with Serve's loop stretched
to 3 s) in ``tests/e2e/test_run_command.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from ray.serve._private.deployment_state import DeploymentStateManager, ReplicaStartupStatus

from ember import ray_controller


class _State:
    """One deployment's state, as DeploymentStateManager.autoscale reads and changes it."""

    def __init__(self, target: int) -> None:
        self.target_num_replicas = target

    def autoscale(self, target: int) -> bool:
        changed, self.target_num_replicas = target != self.target_num_replicas, target
        return changed


class _Manager:
    """The controller's DeploymentStateManager as the starting-replica hook calls it."""

    def __init__(self) -> None:
        self.updates: list[Any] = []
        self.updated = threading.Event()

    def update(self, proxy_nodes: Any = None) -> bool:
        self.updates.append(proxy_nodes)
        self.updated.set()
        return False


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ray_controller, "_EMBER_DEPLOYMENTS", {"a", "b"})
    monkeypatch.setattr(ray_controller, "_MANAGER", [])
    yield


def test_a_raised_target_updates_the_deployments_as_soon_as_the_step_yields(
        monkeypatch: pytest.MonkeyPatch) -> None:
    updates: list[Any] = []

    def update(self: Any, proxy_nodes: Any = None) -> bool:
        updates.append(proxy_nodes)
        return False

    # Unwrapped: constructing Ember's policy in this process (test_ray_policy) wraps them.
    monkeypatch.setattr(DeploymentStateManager, "autoscale",
                        inspect.unwrap(DeploymentStateManager.autoscale))
    monkeypatch.setattr(DeploymentStateManager, "update", update)
    assert ray_controller.move_on_at_once("a")
    manager: Any = object.__new__(DeploymentStateManager)
    manager._shutting_down = False
    manager._deployment_states = {"a": _State(0), "b": _State(2), "c": _State(0)}

    async def control_step() -> None:
        manager.update(proxy_nodes={"node-1"})  # the step's own update, before the policies
        assert manager.autoscale("a", 3) and manager.autoscale("b", 4)
        assert updates == [{"node-1"}]  # nothing runs inside the step
        await asyncio.sleep(0)  # the step is over; Serve's loop sleeps
        assert updates == [{"node-1"}, {"node-1"}]  # one more update for both raises
        assert manager.autoscale("a", 1) and not manager.autoscale("b", 4)
        await asyncio.sleep(0)
        assert len(updates) == 2  # a lowered or unchanged target waits for the next step
        assert manager.autoscale("c", 2)
        await asyncio.sleep(0)
        assert len(updates) == 2  # a deployment Ember does not scale keeps Serve's pace

    asyncio.run(control_step())


def _replica(deployment: str) -> Any:
    return SimpleNamespace(_replica_id=SimpleNamespace(deployment_id=deployment),
                           _allocated_obj_ref=None, _ready_obj_ref=None)


def test_a_starting_replica_is_moved_on_when_its_ref_resolves() -> None:
    futures: list[concurrent.futures.Future[Any]] = []
    statuses = iter([ReplicaStartupStatus.PENDING_ALLOCATION] * 2
                    + [ReplicaStartupStatus.PENDING_INITIALIZATION])

    def check_ready(replica: Any) -> tuple[Any, None]:
        return next(statuses), None

    def watched(replica: Any) -> None:  # each ref's future, as Ray would hand it out
        def future() -> concurrent.futures.Future[Any]:
            futures.append(concurrent.futures.Future())
            return futures[-1]
        for name in ("_allocated_obj_ref", "_ready_obj_ref"):
            setattr(replica, name, SimpleNamespace(future=future))

    manager = _Manager()
    ray_controller._MANAGER.append(manager)
    checked = ray_controller._updating_when_started(check_ready)

    async def steps() -> None:
        replica = _replica("a")
        watched(replica)
        checked(replica)
        checked(replica)  # the same pending ref: watched once
        assert len(futures) == 1 and manager.updates == []
        threading.Thread(target=futures[0].set_result, args=(None,)).start()  # Ray's thread
        while not manager.updated.is_set():
            await asyncio.sleep(0.01)
        checked(replica)  # now initialising: its ready ref is watched
        assert len(futures) == 2 and manager.updates == [None]

    asyncio.run(asyncio.wait_for(steps(), timeout=10))


def test_replicas_of_other_deployments_are_not_watched() -> None:
    ray_controller._MANAGER.append(_Manager())
    replica = _replica("c")
    asked = []
    replica._allocated_obj_ref = SimpleNamespace(future=lambda: asked.append(1))
    checked = ray_controller._updating_when_started(
        lambda r: (ReplicaStartupStatus.PENDING_ALLOCATION, None))

    async def step() -> None:
        checked(replica)

    asyncio.run(step())
    assert asked == []


class _DeploymentID(NamedTuple):
    name: str
    app_name: str = "app"


class _App:
    def __init__(self) -> None:
        self.autoscaled = 0

    def should_autoscale(self) -> bool:
        return True

    def autoscale(self) -> bool:
        self.autoscaled += 1
        return True


def test_a_report_of_a_request_at_zero_runs_the_autoscaling_as_soon_as_the_call_yields(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = _App()
    targets = {"a": 0, "b": 1, "c": 0}
    deployments = {name: _DeploymentID(name) for name in targets}
    monkeypatch.setattr(ray_controller, "_EMBER_DEPLOYMENTS", {deployments["a"], deployments["b"]})
    monkeypatch.setattr(ray_controller, "_MANAGER", [SimpleNamespace(
        get_deployment_target_num_replicas=lambda d: targets[d.name])])
    monkeypatch.setattr(ray_controller, "_APPS", [SimpleNamespace(
        _application_states={"app": app})])
    recorded: list[Any] = []
    record = ray_controller._deciding_on_demand(lambda self, report: recorded.append(report))

    def columnar(name: str, queued: list[float]) -> dict[str, Any]:
        return {"deployment_id": deployments[name], "q_val": queued}

    def report(name: str, queued: list[float]) -> Any:
        return SimpleNamespace(deployment_id=deployments[name],
                               queued_requests=[SimpleNamespace(value=v) for v in queued])

    async def controller_calls() -> None:
        record(None, columnar("a", [0.0, 0.0]))  # nothing queued
        record(None, columnar("b", [1.0]))  # a replica is asked for already
        record(None, columnar("c", [1.0]))  # not Ember's: Serve's pace
        await asyncio.sleep(0)
        assert app.autoscaled == 0
        record(None, columnar("a", [0.0, 1.0]))
        record(None, report("a", [2.0]))
        assert app.autoscaled == 0  # nothing runs inside the call
        await asyncio.sleep(0)
        assert app.autoscaled == 1  # once for both reports
        record(None, report("a", []))
        await asyncio.sleep(0)
        assert app.autoscaled == 1

    asyncio.run(controller_calls())
    assert len(recorded) == 6  # Serve recorded every report first


def test_the_copies_serve_makes_of_a_deployments_info_share_its_replica_class() -> None:
    # Serve copies the info on every autoscaling decision; each copy used to make (and Ray
    # to export: disassemble and pickle) the replicas' actor class again.
    from ray.serve._private.config import DeploymentConfig, ReplicaConfig
    from ray.serve._private.deployment_info import DeploymentInfo

    class Model:
        pass

    assert ray_controller.move_on_at_once("a")
    info = DeploymentInfo(deployment_config=DeploymentConfig(),
                          replica_config=ReplicaConfig.create(Model), start_time_ms=0,
                          deployer_job_id="job", actor_name="ServeReplica:app:Model")
    first = info.actor_def
    assert copy.copy(info).actor_def is first
    assert copy.copy(copy.copy(info)).actor_def is first
    other = DeploymentInfo(deployment_config=DeploymentConfig(),
                           replica_config=ReplicaConfig.create(Model), start_time_ms=0,
                           deployer_job_id="job", actor_name="ServeReplica:app:Other")
    assert other.actor_def is not first  # one class per name
