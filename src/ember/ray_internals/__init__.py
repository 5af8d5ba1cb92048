"""Every private part of Ray that Ember uses, in one place, each checked before it is trusted.

Ray has no public API for these; a Ray minor release may move any of them. Each entry below
has a check that looks at the installed Ray (the attribute is there, its signature is what
Ember calls, Ray's own code still reads the switch or calls the function Ember wraps). What a
failed check does depends on what the part guards:

* ``refuse``: a door or a policy. The embedded cluster does not start, and says which part
  changed and why it matters (:func:`require`). Ember never runs with a port beyond
  127.0.0.1 or with its scaling policy silently gone.
* ``degrade``: a performance or freshness aid. Ember logs one warning and runs without it,
  as plain Ray Serve would.

Tested with Ray 2.60 (``tests/integration/test_ray_internals.py`` exercises each one live;
``tests/unit/test_ray_internals.py`` breaks each check on purpose).

=====================  =============================================  ====================
Name                   Why Ember needs it                             If Ray changes it
=====================  =============================================  ====================
loopback_node_ip       ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` and    refuse: the node IP
                       ``ray_constants.ENABLE_RAY_CLUSTER``: Ray      would be the
                       resolves 127.0.0.1 to the machine's address    machine's, every Ray
                       unless this flag is off, so without it a       port beyond loopback
                       local cluster binds every port beyond
                       loopback
init_node_ip           ``ray.init(_node_ip_address=)``: the node IP   refuse
                       the local cluster advertises and binds
replica_grpc_bind      ``serve._private.replica.                      refuse: replicas
                       add_port_to_grpc_server``: Serve binds each    would listen on
                       replica's gRPC server to ``[::]``; Ember       every interface
                       narrows it to the node IP
cold_start_fast_path   ``serve.autoscaling_policy.                    refuse: a burst at
                       _get_cold_start_scale_up_replicas``: Ray       zero would start one
                       sizes a cold start to 1 without asking the     replica, not what
                       policy; Ember lets its policy decide           the queue needs
kv_store               ``ray.experimental.internal_kv._internal_kv_*  refuse: leases
                       ``: the cluster's key-value store (floors,     (floors) would not
                       traffic, rollouts, edge metrics, pool          reach the policy
                       failures)
serve_env_switches     ``RAY_SERVE_*`` switches of Serve's            degrade: the switch
                       throughput mode and control-loop interval      is not set; slower
system_config          ``ray.init(_system_config=                     degrade: no warm
                       {"preload_python_modules"})`` (documented      runtime
                       "testing only")
prestart_workers       the raylet's ``PrestartWorkers`` RPC over      degrade: no warm
                       ``ray._private.grpc_utils.init_grpc_channel``  runtime
                       (carries the cluster's auth token), and the
                       ``ray::IDLE`` process title
grpc_by_value          handle option ``_by_reference=False``: the     degrade: handles
                       edges' handles send over Serve's gRPC          send by actor call
router_view            a handle's ``_router._asyncio_router           degrade: the polled
                       ._request_router.curr_replicas`` and a         replica counts are
                       response's ``_replica_result_future``          used
fresh_push_at_zero     ``RouterMetricsManager.should_send_scaled_     degrade: cold starts
                       to_zero_optimized_push``, ``._add_             wait up to one
                       autoscaling_metrics_point``, ``.push_          metrics interval
                       autoscaling_metrics_to_controller`` and its
                       ``_pending_metrics_push_ref`` (skips a push
                       while one is in flight) under
                       ``_metrics_push_lock``
quiet_idle_push        the same push and ref, ``._add_autoscaling_    degrade: an idle
                       metrics_point`` pruning the samples, the       handle reports its
                       report's ``num_queued_requests``, ``num_       zeros every
                       requests_sent_to_replicas``, ``metrics_        metrics interval
                       store.data`` (``TimeStampedValue.value``)
                       and Serve's 10 s handle timeout: an idle
                       handle's reports of zeros go every 4 s, not
                       every 0.25 s (``control/backoff``)
controller_hooks       ``DeploymentStateManager.autoscale``/          degrade: a cold
                       ``update``, ``ActorReplicaWrapper.             start waits up to
                       on_scheduled``/``check_ready`` (their          four control loops
                       ``_allocated_obj_ref``, ``_ready_obj_ref``),   more (0.1 s each)
                       and the order of ``ServeController.
                       run_control_loop_step``; ``Autoscaling
                       StateManager.record_*_for_handle`` (the
                       report's ``queued_requests``/``q_val``) and
                       ``ApplicationStateManager._application_
                       states``' ``autoscale``; ``DeploymentInfo.
                       actor_def`` (cached per name): Serve decides
                       and acts on a scale-up and a starting replica
                       a loop later, and re-exports the replicas'
                       class on each scale-up; ``ray_controller``
                       acts at once and keeps one class per name
dashboard_address      the key under which Ray stores its dashboard's degrade: status
                       address (``ray_constants.DASHBOARD_ADDRESS``)  omits the dashboard
driver_signal_handlers ``set_sigterm_handler`` and ``CoreWorker``,     degrade: a signal
                       swapped during ``ray.init`` so SIGTERM/SIGINT  during ray.init
                       keep ``ember run``'s drain handlers            meets Ray's handler
=====================  =============================================  ====================

The checks and the registry live in ``_checks``, the accessors Ember calls in ``_access``;
both are re-exported here, so callers import ``ember.ray_internals`` alone.

Public APIs replace what they can: the raylet's address (``ray.nodes()``), the job id
(``ray.get_runtime_context()``), the node IP (``ray.util.get_node_ip_address``), the raylet
process (a child of this process named ``raylet``).
"""

from ember.errors import RayInternalsChanged
from ember.ray_internals._access import (
    dashboard_address,
    driver_keeps_signal_handlers,
    handle_by_value_options,
    init_kwargs,
    kv_delete,
    kv_get,
    kv_list,
    kv_put,
    prestart_workers,
    push_demand_now,
    response_assigned,
    router_running_replicas,
    serve_replica_module,
    set_driver_loopback_flag,
    this_node,
    wrap_cold_start_fast_path,
    wrap_quiet_idle_push,
    wrap_replica_grpc_bind,
    wrap_scaled_to_zero_push,
)
from ember.ray_internals._checks import (
    IDLE_WORKER_TITLE,
    INTERNALS,
    LOOPBACK_ENV,
    QUIET_PUSH_KEEPALIVE_S,
    SERVE_ENV_SWITCHES,
    Internal,
    available,
    problem,
    require,
    unread_serve_env_switches,
)

__all__ = [
    "IDLE_WORKER_TITLE",
    "INTERNALS",
    "LOOPBACK_ENV",
    "QUIET_PUSH_KEEPALIVE_S",
    "SERVE_ENV_SWITCHES",
    "Internal",
    "RayInternalsChanged",
    "available",
    "dashboard_address",
    "driver_keeps_signal_handlers",
    "handle_by_value_options",
    "init_kwargs",
    "kv_delete",
    "kv_get",
    "kv_list",
    "kv_put",
    "prestart_workers",
    "problem",
    "push_demand_now",
    "require",
    "response_assigned",
    "router_running_replicas",
    "serve_replica_module",
    "set_driver_loopback_flag",
    "this_node",
    "unread_serve_env_switches",
    "wrap_cold_start_fast_path",
    "wrap_quiet_idle_push",
    "wrap_replica_grpc_bind",
    "wrap_scaled_to_zero_push",
]
