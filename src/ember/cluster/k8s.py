"""A KubeRay ``RayService`` (``ray.io/v1``) for an Ember app: ``ember deploy APP --k8s``.

Pure functions of the app, a :class:`ClusterShape` and an environment; nothing here talks to
Kubernetes or Ray. The manifest holds:

- ``spec.serveConfigV2``: a Serve config whose one application is built on the cluster by
  ``ember.cluster.build:build`` from the app's import path. Serve's own HTTP proxy is
  disabled: Ember's edges listen on Ember's port themselves, as they do locally.
- ``spec.rayClusterConfig``: a head group that runs Ray's control processes and no replicas
  (``num-cpus: 0``), and worker groups sized from the deployments: each worker pod has the
  shape given, its group's ``minReplicas`` holds the warm floors and the warm pool, its
  ``maxReplicas`` every deployment at ``max_replicas``. Ray's autoscaler moves between them
  as Ember's policy asks Serve for replicas, so idle deployments give their pods back.
- Ember's settings as ``EMBER_*`` variables, invoke and admin keys from a Secret (the invoke
  keys required), Ray Serve's throughput and cold-start settings, and for the worker pods,
  where the edges run: a readiness probe on ``/readyz`` and a liveness probe on ``/healthz`` at
  Ember's port, a short pre-stop wait and a termination grace that covers the longest drain.
- Ray's token auth (``authOptions``), and beside the ``RayService`` a ``NetworkPolicy``: only
  the cluster's own pods reach Ray's ports, only the edges' port is open to the ingress.

- GCS fault tolerance (``gcsFaultToleranceOptions``, KubeRay 1.3+): the head's GCS keeps
  its tables, Ray's internal key-value store among them, in Redis, so a head that restarts
  finds the cluster, its detached actors and the operator's settings (traffic, rollouts,
  shadows, leases: ``control/store.py``) where it left them. :func:`manifests` adds a
  one-replica Redis with an append-only file on a volume, or names an existing one
  (``--redis-address``). Its password comes from a Secret the operator creates once.

The head pod keeps KubeRay's own readiness probe: KubeRay submits the Serve config only once
the head is ready, so a head that waited for the app to be ready would never get one.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
)

from ember import settings
from ember.app.app import App
from ember.cluster.build import IMPORT_PATH
from ember.cluster.defaults import EDGE_NUM_CPUS, POOL_NUM_CPUS
from ember.cluster.k8s_redis import gcs_fault_tolerance, redis_name, redis_objects
from ember.cluster.runtime import THROUGHPUT_SETTINGS
from ember.edge.edge import DRAIN_S
from ember.errors import ConfigError

API_VERSION = "ray.io/v1"
KIND = "RayService"
GPU_RESOURCE = "nvidia.com/gpu"
#: Settings only the command line reads (where ``ember status|warm|plan`` look, the keys it
#: sends): they have no business on the cluster.
CLIENT_SETTINGS = frozenset({"url", "admin_key", "api_key"})
#: Settings that hold the keys callers present: read from a Secret, never written inline.
SECRET_SETTINGS = ("api_keys", "admin_keys")
_BOOL = TypeAdapter(bool)  # a setting's truth as pydantic reads it ("1", "true", "on", ...)
#: Settings that open a door (admin routes to loopback callers, no key beyond loopback):
#: written only when ``ember deploy`` is told so by name, never carried from a shell.
OPENING_SETTINGS = ("admin_loopback", "allow_unauthenticated")
#: Ports Ray's head listens on, named as KubeRay names them.
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
#: Seconds a terminating worker pod keeps serving before its processes are signalled: time
#: for Kubernetes to take it out of the Service's endpoints.
PRESTOP_S = 5


class ClusterShape(BaseModel):
    """The pods a manifest asks for; every worker pod of a group has the same shape.

    Example:
        >>> ClusterShape(image="registry.example/embeddings:1").worker_cpus
        4
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(min_length=1, description="Ray, Ember and the app's code installed")
    namespace: str | None = Field(default=None, description="Kubernetes namespace")
    head_cpus: PositiveInt = 2
    head_memory_gib: PositiveFloat = 8.0
    worker_cpus: PositiveInt = 4
    worker_memory_gib: PositiveFloat = 16.0
    worker_gpus: NonNegativeInt = Field(
        default=1, description="GPUs of each pod in the GPU group (made only when needed)"
    )
    host: str = Field(default="0.0.0.0", description="where the edges listen in a pod")
    port: int | None = Field(default=None, ge=1, le=65535, description="default: EMBER_PORT")


@dataclass(frozen=True)
class Replica:
    """What one replica asks Ray for."""

    deployment: str
    num_cpus: float
    num_gpus: float = 0.0


@dataclass(frozen=True)
class WorkerGroup:
    """One ``workerGroupSpecs`` entry: a pod shape and how many of it."""

    name: str
    cpus: int
    memory_gib: float
    gpus: int
    min_pods: int
    max_pods: int


def nodes_needed(replicas: Iterable[Replica], *, cpus: float, gpus: float = 0.0) -> int:
    """Pods of ``cpus`` and ``gpus`` that hold every replica, packed largest first.

    First-fit decreasing: not always the fewest pods, but never fewer than Ray can place,
    because Ray cannot split a replica across nodes either.

    Raises:
        ConfigError: a replica is larger than one pod.

    Example:
        >>> nodes_needed([Replica("M", 1.0)] * 3 + [Replica("T", 0.25)] * 2, cpus=2)
        2
    """
    free: list[list[float]] = []
    for r in sorted(replicas, key=lambda r: (r.num_gpus, r.num_cpus), reverse=True):
        if r.num_cpus > cpus + 1e-9 or r.num_gpus > gpus + 1e-9:
            raise ConfigError(
                f"a replica of {r.deployment} needs {r.num_cpus:g} CPUs and {r.num_gpus:g} "
                f"GPUs, more than one worker pod offers ({cpus:g} CPUs for replicas, "
                f"{gpus:g} GPUs); raise --worker-cpus or --worker-gpus"
            )
        for node in free:
            if node[0] >= r.num_cpus - 1e-9 and node[1] >= r.num_gpus - 1e-9:
                node[0] -= r.num_cpus
                node[1] -= r.num_gpus
                break
        else:
            free.append([cpus - r.num_cpus, gpus - r.num_gpus])
    return len(free)


def app_replicas(app: App, *, at_floor: bool) -> list[Replica]:
    """Every replica of ``app`` at its warm floors (``at_floor``) or at ``max_replicas``,
    with the warm pool's replicas, which run whenever the app does."""
    replicas = [
        Replica(spec.name, spec.options.num_cpus, spec.options.num_gpus)
        for spec in app.specs
        for _ in range(spec.options.warm_floor if at_floor else spec.options.max_replicas)
    ]
    for gpu in (False, True):
        if app.pool_specs(gpu=gpu):
            replicas += [Replica("warm pool", POOL_NUM_CPUS)] * app.warm_pool
    return replicas


def worker_groups(app: App, shape: ClusterShape) -> list[WorkerGroup]:
    """A CPU group (always: the edges run there) and a GPU group when a deployment needs one.

    Each pod keeps ``EDGE_NUM_CPUS`` for the edge it may run; the CPU group never goes below
    one pod, or no edge would be left to answer.
    """
    room = shape.worker_cpus - EDGE_NUM_CPUS
    groups = []
    for gpu in (False, True):
        pick = [r for r in app_replicas(app, at_floor=False) if (r.num_gpus > 0) == gpu]
        if gpu and not pick:
            continue
        floor = [r for r in app_replicas(app, at_floor=True) if (r.num_gpus > 0) == gpu]
        gpus = shape.worker_gpus if gpu else 0
        low = nodes_needed(floor, cpus=room, gpus=gpus)
        high = nodes_needed(pick, cpus=room, gpus=gpus)
        if not gpu:
            low = max(1, low)
        groups.append(WorkerGroup("gpu" if gpu else "cpu", shape.worker_cpus,
                                  shape.worker_memory_gib, gpus, low, max(low, high)))
    return groups


def serve_config(app: App, target: str, *, host: str, port: int) -> dict[str, Any]:
    """The Serve config (``serveConfigV2``) that builds ``target`` on the cluster."""
    return {
        # The edges take the place of Serve's HTTP proxy (see edge/edge.py).
        "proxy_location": "Disabled",
        "applications": [{
            "name": app.name,
            "route_prefix": None,
            "import_path": IMPORT_PATH,
            "args": {"target": target, "host": host, "port": port},
        }],
    }


def container_env(environ: Mapping[str, str], *, port: int, secret: str,
                  opened: Collection[str] = ()) -> list[dict[str, Any]]:
    """Ember's settings set in ``environ``, the keys from ``secret``, Ray Serve's settings.

    ``opened`` names the :data:`OPENING_SETTINGS` the operator asked for (``ember deploy
    --admin-loopback``): they are written on. One set in ``environ`` but not named is
    refused: a development shell's opt-in must not open a cluster's doors (in a service
    mesh, the sidecar delivers every caller's traffic from loopback).

    Raises:
        ConfigError: an ``EMBER_*`` variable holds a value of the wrong kind, or an opening
            setting is set but not named in ``opened``.
    """
    settings.load(environ)  # refuse a bad value here, not in a pod that crash-loops
    env: list[dict[str, Any]] = [{"name": settings.variable("port"), "value": str(port)}]
    for field in sorted(settings.Settings.model_fields):
        name = settings.variable(field)
        if field in OPENING_SETTINGS:
            if field in opened:
                env.append({"name": name, "value": "1"})
            elif _BOOL.validate_python(environ.get(name) or False):  # this mapping's own
                raise ConfigError(
                    f"{name} is set in this shell; a manifest does not carry it: pass "
                    f"--{field.replace('_', '-')} to `ember deploy` to open that door on the "
                    "cluster on purpose, or unset it")
            continue
        skip = field in CLIENT_SETTINGS or field in SECRET_SETTINGS or field == "port"
        if not skip and environ.get(name):
            env.append({"name": name, "value": environ[name]})
    env += secret_env(secret)
    env += [{"name": k, "value": v} for k, v in sorted(THROUGHPUT_SETTINGS.items())]
    return env


def quantity_cpus(cpus: float) -> str:
    """A Kubernetes CPU quantity: ``4`` -> ``"4"``, ``0.5`` -> ``"500m"``."""
    return str(int(cpus)) if float(cpus).is_integer() else f"{math.ceil(cpus * 1000)}m"


def quantity_memory(gib: float) -> str:
    """A Kubernetes memory quantity: ``16`` -> ``"16Gi"``, ``1.5`` -> ``"1536Mi"``."""
    return f"{int(gib)}Gi" if float(gib).is_integer() else f"{math.ceil(gib * 1024)}Mi"


def _resources(cpus: float, memory_gib: float, gpus: int) -> dict[str, Any]:
    """Requests equal to limits, so a pod gets the CPUs Ray believes it has."""
    amounts = {"cpu": quantity_cpus(cpus), "memory": quantity_memory(memory_gib)}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(role: str, shape: ClusterShape, env: list[dict[str, Any]], port: int,
               resources: dict[str, Any]) -> dict[str, Any]:
    ports = {**(HEAD_PORTS if role == "head" else {}), "serve": port}
    container: dict[str, Any] = {
        "name": f"ray-{role}", "image": shape.image, "env": env, "resources": resources,
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()],
    }
    if role == "worker":
        container["readinessProbe"] = {
            "httpGet": {"path": "/readyz", "port": port},
            "initialDelaySeconds": 10, "periodSeconds": 5, "timeoutSeconds": 2,
            "failureThreshold": 3,
        }
        # /healthz stays 200 while an edge drains: a slow drain is never taken for a hang.
        container["livenessProbe"] = {
            "httpGet": {"path": "/healthz", "port": port},
            "initialDelaySeconds": 30, "periodSeconds": 10, "timeoutSeconds": 5,
            "failureThreshold": 6,
        }
        # Keep serving while Kubernetes takes the pod out of the Service's endpoints.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}
    return container


def termination_grace_s(app: App) -> int:
    """Seconds a worker pod gets between its end being asked and SIGKILL: the pre-stop wait,
    then the longest of the edges' drain and the deployments' ``graceful_shutdown_s``."""
    longest = max([DRAIN_S, *(spec.options.with_env_overrides().graceful_shutdown_s
                              for spec in app.specs)])
    return math.ceil(PRESTOP_S + longest + 5)


def _worker_spec(group: WorkerGroup, shape: ClusterShape, env: list[dict[str, Any]],
                 port: int, grace_s: int) -> dict[str, Any]:
    params = {"num-cpus": str(group.cpus)}
    if group.gpus:
        params["num-gpus"] = str(group.gpus)
    resources = _resources(group.cpus, group.memory_gib, group.gpus)
    return {
        "groupName": group.name,
        "replicas": group.min_pods,
        "minReplicas": group.min_pods,
        "maxReplicas": group.max_pods,
        "rayStartParams": params,
        "template": {"spec": {
            "terminationGracePeriodSeconds": grace_s,
            "containers": [_container("worker", shape, env, port, resources)]}},
    }


def manifest_name(app_name: str) -> str:
    """A DNS-1123 name for the app: ``My_App`` -> ``my-app``."""
    return app_name.lower().replace("_", "-").strip("-") or "ember"


def rayservice(app: App, target: str, shape: ClusterShape, *, environ: Mapping[str, str],
               ray_version: str, opened: Collection[str] = ()) -> dict[str, Any]:
    """The ``RayService`` that serves ``app`` (imported on the cluster as ``target``).

    Raises:
        ConfigError: a replica does not fit a worker pod, or a setting is malformed.

    Example:
        >>> from ember.deployments.embeddings import app  # doctest: +SKIP
        >>> rayservice(app, "ember.deployments.embeddings:app", ClusterShape(image="img"),
        ...            environ={}, ray_version="2.60.0")["kind"]  # doctest: +SKIP
        'RayService'
    """
    name = manifest_name(app.name)
    port = shape.port or settings.load(environ).port
    env = container_env(environ, port=port, secret=f"{name}-ember-keys", opened=opened)
    config = serve_config(app, target, host=shape.host, port=port)
    head = _container("head", shape, env, port,
                      _resources(shape.head_cpus, shape.head_memory_gib, 0))
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": name,
                                                         "app.kubernetes.io/managed-by": "ember"}}
    if shape.namespace:
        metadata["namespace"] = shape.namespace
    return secured({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "serveConfigV2": yaml.safe_dump(config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": ray_version,
                "enableInTreeAutoscaling": True,
                "headGroupSpec": {
                    # No replicas or edges on the head: it keeps Ray's control processes.
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [head]}},
                },
                "workerGroupSpecs": [_worker_spec(g, shape, env, port, termination_grace_s(app))
                                     for g in worker_groups(app, shape)],
            },
        },
    })


# -- Who may reach the cluster -------------------------------------------------------------
# Ray's head listens for its GCS, dashboard and client ports on every interface, and the
# dashboard's job API runs any code on every node: only the cluster's own pods (and the
# KubeRay operator, which submits the Serve config to the dashboard) may reach them, and
# Ray's token auth guards them too. Only the edges' HTTP port is open to the ingress.

#: Label every pod of the app carries; the NetworkPolicy selects the cluster's pods by it.
POD_LABEL = "ember.dev/app"
#: KubeRay's label of a Ray pod's role (``head`` or ``worker``).
HEAD_NODE_LABEL = "ray.io/node-type"
#: Labels of KubeRay's operator pods (its Helm chart's), in any namespace.
OPERATOR_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}


def secret_env(secret: str) -> list[dict[str, Any]]:
    """The keys' variables, from ``secret``. Invoke keys are required: a missing or misspelt
    Secret stops the pods instead of serving every route with no key. Admin keys may be
    absent: admin routes then answer no one (see ``edge/auth.py``)."""
    env = []
    for field in SECRET_SETTINGS:
        name = settings.variable(field)
        ref = {"name": secret, "key": name, "optional": field != "api_keys"}
        env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
    return env


def ray_auth_options() -> dict[str, Any]:
    """Ray's token auth (Ray 2.52+, KubeRay 1.5.1+): KubeRay makes a token Secret and sets
    ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN`` in every Ray container, and uses it itself."""
    return {"mode": "token"}


def secured(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with Ray's token auth on and every pod labelled for the NetworkPolicy."""
    name = manifest["metadata"]["name"]
    cluster = manifest["spec"]["rayClusterConfig"]
    cluster["authOptions"] = ray_auth_options()
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        meta = group["template"].setdefault("metadata", {})
        meta.setdefault("labels", {})[POD_LABEL] = name
    return manifest


def network_policy(manifest: Mapping[str, Any], port: int) -> dict[str, Any]:
    """The ``NetworkPolicy`` for ``manifest``'s pods: any port from the cluster's own pods
    (Ray's processes talk on many), the dashboard from KubeRay's operator, and only the
    edges' ``port`` from anywhere else (the ingress; the edges ask for API keys)."""
    name = manifest["metadata"]["name"]
    own = {"podSelector": {"matchLabels": {POD_LABEL: name}}}
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_LABELS}}
    metadata: dict[str, Any] = {"name": f"{name}-ember",
                                "labels": dict(manifest["metadata"]["labels"])}
    if "namespace" in manifest["metadata"]:
        metadata["namespace"] = manifest["metadata"]["namespace"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": {"matchLabels": {POD_LABEL: name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own]},
                {"from": [operator],
                 "ports": [{"protocol": "TCP", "port": HEAD_PORTS["dashboard"]}]},
                {"ports": [{"protocol": "TCP", "port": port}]},
            ],
        },
    }


def serve_port(manifest: Mapping[str, Any]) -> int:
    """The edges' port in ``manifest`` (the worker containers' ``serve`` port)."""
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    ports = head["containers"][0]["ports"]
    return int(next(p["containerPort"] for p in ports if p["name"] == "serve"))


def manifests(app: App, target: str, shape: ClusterShape, *, environ: Mapping[str, str],
              ray_version: str, redis_address: str | None = None,
              opened: Collection[str] = ()) -> list[dict[str, Any]]:
    """What ``ember deploy --k8s`` writes: the Redis the GCS keeps its state in (unless
    ``redis_address`` names one), the ``RayService`` with GCS fault tolerance, and its
    ``NetworkPolicy``. ``opened``: see :func:`container_env`."""
    service = rayservice(app, target, shape, environ=environ, ray_version=ray_version,
                         opened=opened)
    name = redis_name(manifest_name(app.name))
    service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"] = gcs_fault_tolerance(
        name, redis_address)
    head = {POD_LABEL: manifest_name(app.name), HEAD_NODE_LABEL: "head"}
    redis = [] if redis_address else redis_objects(name, shape.namespace, head_labels=head)
    return [*redis, service, network_policy(service, serve_port(service))]


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the Serve config) as YAML literal blocks, and repeats
    shared values (the containers' env) instead of writing anchors a reader must follow."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_block(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_block)


def to_yaml(manifest: Mapping[str, Any]) -> str:
    """``manifest`` as YAML, keys in the order built, the Serve config as a literal block."""
    return yaml.dump(dict(manifest), Dumper=_BlockDumper, sort_keys=False)


def to_yaml_documents(items: Iterable[Mapping[str, Any]]) -> str:
    """Several manifests as one multi-document YAML stream (``kubectl apply -f -`` takes it)."""
    return "---\n".join(to_yaml(item) for item in items)


def to_list(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several manifests as one ``v1`` ``List`` (the JSON form ``kubectl apply`` takes)."""
    return {"apiVersion": "v1", "kind": "List", "items": [dict(i) for i in items]}
