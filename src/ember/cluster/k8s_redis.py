"""The Redis a Kubernetes manifest runs for the GCS's fault tolerance, and how Ray finds it.

With GCS fault tolerance the head keeps its tables (Ray's internal key-value store among
them, where Ember keeps what an operator set) in Redis, so a head that restarts finds them.
``ember deploy --k8s`` runs a one-replica Redis with an append-only file on a volume, or
names an existing one (``--redis-address``). Its password comes from a Secret the operator
creates once, and reaches Redis through its standard input, never its command line: a
process's arguments are readable by every process of the node (``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

from typing import Any

#: The Redis image a manifest runs when no Redis is named.
REDIS_IMAGE = "redis:7.4"
REDIS_PORT = 6379

#: The Redis container's command: ``redis-server -`` reads a config from standard input, here
#: the password's line (quoted, its backslashes and quotes escaped, so any password works),
#: and the rest of the settings come as arguments. ``exec`` leaves Redis as the container's
#: first process, so it gets Kubernetes' SIGTERM and writes its file before it stops.
REDIS_SCRIPT = (
    # An empty password would write `requirepass ""`: no password at all. A line break
    # cannot be one config line (and $(...) would drop a trailing one, so Redis and its
    # clients would hold different passwords): both refused, so the pod says why.
    'case "$REDIS_PASSWORD" in ""|*"\n"*) echo "REDIS_PASSWORD must be one line, not empty'
    ' (does the Secret end in a newline?)" >&2; exit 1;; esac\n'
    "exec redis-server - --appendonly yes --appendfsync everysec --dir /data <<EOF\n"
    "requirepass \"$(printf '%s' \"$REDIS_PASSWORD\" | sed 's/[\\\\\"]/\\\\&/g')\"\n"
    "EOF\n"
)


def redis_name(manifest_name: str) -> str:
    """The Redis's objects' name, and its Secret's (key ``password``)."""
    return f"{manifest_name}-redis"


def gcs_fault_tolerance(name: str, redis_address: str | None) -> dict[str, Any]:
    """``gcsFaultToleranceOptions``: the GCS in Redis at ``redis_address`` (default: the
    Service :func:`redis_objects` makes), its password from the Secret ``name``."""
    address = redis_address or f"{name}:{REDIS_PORT}"
    ref = {"name": name, "key": "password"}
    return {"redisAddress": address, "redisPassword": {"valueFrom": {"secretKeyRef": ref}}}


def redis_objects(name: str, namespace: str | None, *,
                  head_labels: dict[str, str], storage_gib: int = 1) -> list[dict[str, Any]]:
    """A one-replica Redis for the GCS: a volume, a Deployment writing an append-only file
    to it (fsync every second), a Service, and a NetworkPolicy that lets only the pods
    labelled ``head_labels`` (the Ray head) reach it, all in ``namespace``."""
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "ember"}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    if namespace:
        meta["namespace"] = namespace
    password = {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": name, "key": "password"}}}
    container = {
        "name": "redis", "image": REDIS_IMAGE, "command": ["sh", "-c", REDIS_SCRIPT],
        "env": [password], "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        "readinessProbe": {"tcpSocket": {"port": REDIS_PORT}, "periodSeconds": 5},
    }
    pod = {"metadata": {"labels": labels}, "spec": {"containers": [container], "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": name}}]}}
    return [
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta,
         "spec": {"accessModes": ["ReadWriteOnce"],
                  "resources": {"requests": {"storage": f"{storage_gib}Gi"}}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                  "selector": {"matchLabels": labels}, "template": pod}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"selector": labels, "ports": [{"name": "redis", "port": REDIS_PORT}]}},
        # Redis holds the GCS's tables (pickled functions among them): only the head, where
        # the GCS runs, may reach it; the password alone would be one secret from any pod.
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
         "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": head_labels}}],
                               "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]}},
    ]
