"""Ember's hooks inside Serve's controller: a cold start's replica is moved on when it is ready.

Part of :mod:`ember.ray_internals` (the private parts of Ray, each checked before it is
trusted; this module uses only those its ``controller_hooks`` check covers), kept apart
because it runs in one process only: Serve's controller, where Ember's autoscaling policy
installs it (``control/ray_policy.py``).

Serve's controller walks a replica through its start one control-loop step at a time, and
sleeps ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S`` (0.1 s) between steps. Each step updates the
deployments before the applications, whose autoscaling policies set the targets; a
replica's constructor is sent only in the step that sees its worker allocated, and the
replica serves only from the step that sees its constructor done. So a request at zero
replicas waited up to three loops beyond the work itself: a whole one between the decision
and the replica's creation, and up to one at each of the other two. Here each of those
events schedules one more update of the deployments on the controller's event loop, where
it runs as soon as the current step yields (a step never awaits):

* a raised target (the autoscaling decision), for the replicas it asks for;
* a starting replica's allocation, and its constructor's end (Ray resolves the object
  refs Serve polls; their futures call back).

And the decision itself waited for the next step's autoscaling, up to a loop after the
router's report of a request at zero replicas reached the controller. Such a report now
schedules the application's autoscaling at once, for an Ember deployment whose target is
zero.

Each scale-up also made Ray export the replicas' actor class again: Serve copies the
deployment's info on every autoscaling decision, the copy drops the cached actor class, and
a new class is exported (disassembled and pickled, about 30 ms of the controller's CPU) before
the replica is created. The class depends only on its name (a subclass of Serve's
``ReplicaActor`` named for the deployment), so the controller now keeps one per name; being
a cache of the same class, it is kept for every deployment on the controller.

Only Ember's deployments (the policy names its own each tick); other deployments sharing
the controller keep Serve's pace. Wrapping the controller's step itself would not do: its
actor class is a copy of the module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from ember.ray_internals import available

logger = logging.getLogger("ember.ray_controller")

#: The deployments whose replicas are moved on at once. It lives here, not in the policy's
#: module, because Ray may load that module more than once in the controller.
_EMBER_DEPLOYMENTS: set[Any] = set()
#: The controller's DeploymentStateManager, once it has updated (one per controller).
_MANAGER: list[Any] = []
#: The controller's ApplicationStateManager, once it has updated.
_APPS: list[Any] = []
#: Applications whose autoscaling is scheduled to run out of step.
_AUTOSCALE_SOON: set[str] = set()
#: The replicas' actor class of each deployment, by its actor name.
_ACTOR_CLASSES: dict[str, Any] = {}
#: Attributes Ember keeps on Serve's objects: the proxy nodes of the step's own update, a
#: pending extra update, and the object ref a starting replica is being watched on.
_PROXY_NODES, _UPDATE_SOON, _WATCHED = "_ember_proxy_nodes", "_ember_update_soon", \
    "_ember_watched_ref"


def move_on_at_once(deployment_id: Any) -> bool:
    """Have the controller act on ``deployment_id``'s scale-ups and starting replicas at once.

    Wraps Serve's classes once per process; returns False (and changes nothing) when Ray
    moved what this wraps (``ray_internals`` logs why, once).
    """
    if not available("controller_hooks"):
        return False
    from ray.serve._private.application_state import ApplicationStateManager
    from ray.serve._private.autoscaling_state import AutoscalingStateManager
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve._private.deployment_state import ActorReplicaWrapper, DeploymentStateManager

    _EMBER_DEPLOYMENTS.add(deployment_id)
    manager: Any = DeploymentStateManager
    if getattr(manager.autoscale, "__ember_wrapped__", False):
        return True
    replica: Any = ActorReplicaWrapper
    manager.update = _keeping_proxy_nodes(manager.update)
    manager.autoscale = _updating_after_scale_up(manager.autoscale)
    replica.on_scheduled = _watching_once_scheduled(replica.on_scheduled)
    replica.check_ready = _updating_when_started(replica.check_ready)
    apps: Any = ApplicationStateManager
    apps.update = _keeping_apps(apps.update)
    metrics: Any = AutoscalingStateManager
    for name in ("record_request_metrics_for_handle", "record_columnar_metrics_for_handle"):
        setattr(metrics, name, _deciding_on_demand(getattr(metrics, name)))
    info: Any = DeploymentInfo
    info.actor_def = property(_sharing_actor_class(info.actor_def.fget))
    return True


def _keeping_proxy_nodes(update: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(update)
    def keeping(self: Any, proxy_nodes: Any = None) -> bool:
        setattr(self, _PROXY_NODES, proxy_nodes)
        if not _MANAGER:
            _MANAGER.append(self)
        return update(self, proxy_nodes=proxy_nodes)
    return keeping


def _update_soon(manager: Any) -> None:
    """On the controller's loop: one more update of the deployments, once the step yields."""
    if getattr(manager, _UPDATE_SOON, False):
        return  # one is pending already: it covers every deployment
    with contextlib.suppress(RuntimeError):  # no running loop: the next step does it
        asyncio.get_running_loop().call_soon(_update_now, manager)
        setattr(manager, _UPDATE_SOON, True)


def _update_now(manager: Any) -> None:
    setattr(manager, _UPDATE_SOON, False)
    try:
        manager.update(proxy_nodes=getattr(manager, _PROXY_NODES, None))
    except Exception:  # as Serve's own step does: the control loop must go on
        logger.exception("updating deployments out of step failed")


def _updating_after_scale_up(autoscale: Callable[[Any, Any, int], bool]
                             ) -> Callable[[Any, Any, int], bool]:
    @functools.wraps(autoscale)
    def updating(self: Any, deployment_id: Any, target_num_replicas: int) -> bool:
        before = self.get_deployment_target_num_replicas(deployment_id)
        changed = autoscale(self, deployment_id, target_num_replicas)
        if (changed and before is not None and target_num_replicas > before
                and deployment_id in _EMBER_DEPLOYMENTS):
            _update_soon(self)
        return changed

    updating.__ember_wrapped__ = True  # type: ignore[attr-defined]
    return updating


def _watching_once_scheduled(on_scheduled: Callable[..., None]) -> Callable[..., None]:
    # The update that creates a replica polls it before creating it: watch it from here.
    @functools.wraps(on_scheduled)
    def watching(self: Any, *args: Any, **kwargs: Any) -> None:
        on_scheduled(self, *args, **kwargs)
        _watch(self, getattr(self, "_allocated_obj_ref", None))
    return watching


def _updating_when_started(check_ready: Callable[[Any], Any]) -> Callable[[Any], Any]:
    from ray.serve._private.deployment_state import ReplicaStartupStatus

    waiting_on = {ReplicaStartupStatus.PENDING_ALLOCATION: "_allocated_obj_ref",
                  ReplicaStartupStatus.PENDING_INITIALIZATION: "_ready_obj_ref"}

    @functools.wraps(check_ready)
    def updating(self: Any) -> Any:
        status = check_ready(self)
        _watch(self, getattr(self, waiting_on.get(status[0], ""), None))
        return status

    return updating


def _watch(replica: Any, ref: Any) -> None:
    """Update the deployments once ``ref`` (a starting replica's pending call) resolves."""
    if (ref is None or not _MANAGER or getattr(replica, _WATCHED, None) is ref
            or replica._replica_id.deployment_id not in _EMBER_DEPLOYMENTS):
        return
    setattr(replica, _WATCHED, ref)
    with contextlib.suppress(RuntimeError):  # not on the controller's loop: its steps will
        loop, manager = asyncio.get_running_loop(), _MANAGER[0]
        # The future resolves on one of Ray's threads: hand the update to the loop.
        ref.future().add_done_callback(
            lambda _: loop.call_soon_threadsafe(_update_soon, manager))


def _keeping_apps(update: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(update)
    def keeping(self: Any) -> None:
        if not _APPS:
            _APPS.append(self)
        return update(self)
    return keeping


def _deciding_on_demand(record: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    # A handle's report: a HandleMetricReport, or the dict of its columnar encoding.
    @functools.wraps(record)
    def recording(self: Any, report: Any) -> None:
        record(self, report)
        columnar = isinstance(report, dict)
        deployment_id = report["deployment_id"] if columnar else report.deployment_id
        if (deployment_id in _EMBER_DEPLOYMENTS and _MANAGER and _APPS
                and _queued(report, columnar)
                and _MANAGER[0].get_deployment_target_num_replicas(deployment_id) == 0):
            _autoscale_soon(deployment_id.app_name)
    return recording


def _queued(report: Any, columnar: bool) -> bool:
    """Whether the report's newest sample of the handle's queue is above zero."""
    if columnar:
        values = report["q_val"]
        return len(values) > 0 and float(values[-1]) > 0
    samples = report.queued_requests
    return bool(samples) and samples[-1].value > 0


def _autoscale_soon(app_name: str) -> None:
    """On the controller's loop: run ``app_name``'s autoscaling once the current work yields."""
    if app_name in _AUTOSCALE_SOON:
        return
    with contextlib.suppress(RuntimeError):  # no running loop: the next step decides
        asyncio.get_running_loop().call_soon(_autoscale_now, app_name)
        _AUTOSCALE_SOON.add(app_name)


def _autoscale_now(app_name: str) -> None:
    _AUTOSCALE_SOON.discard(app_name)
    app = _APPS[0]._application_states.get(app_name)
    try:
        if app is not None and app.should_autoscale():
            app.autoscale()  # a raised target updates the deployments at once (above)
    except Exception:  # as Serve's own step does: the control loop must go on
        logger.exception("autoscaling %s out of step failed", app_name)


def _sharing_actor_class(actor_def: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(actor_def)
    def shared(self: Any) -> Any:
        if self._cached_actor_def is None:
            self._cached_actor_def = _ACTOR_CLASSES.get(self.actor_name)
        made = actor_def(self)
        _ACTOR_CLASSES[self.actor_name] = made
        return made
    return shared
