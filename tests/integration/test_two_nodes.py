"""Two Ray nodes on this machine, joined through ``RAY_ADDRESS``: replicas and edges on both.

``ray.cluster_utils.Cluster`` starts a head and a worker raylet, each with a custom resource
(``node-a``, ``node-b``) that names it; Ember joins the cluster as it joins any existing one
(``RAY_ADDRESS``), and the test reads from Serve's controller which node holds each replica.

This test needs a pytest run of its own: a process joins one Ray cluster, and the session
cluster of the other integration tests is a different one (the Makefile runs it separately).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import ember
from ember.cli import main
from ember.cli.cache_nodes import Node, collect, submit
from ember.cluster.runtime import THROUGHPUT_SETTINGS
from ember.control.listeners import LOCAL_CLUSTER_ENV, LOOPBACK, use_loopback_node_ip
from ember.edge.edge import EDGE_DEPLOYMENT
from ember.loaders import LoaderConfig, list_snapshots

from apps.two_nodes import app, near_app
from harness import S3_CREDENTIALS, moto_s3, s3_options
from loaders.origins import HttpOrigin, handler_for, make_weights
from support import free_port, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Stores:
    """What the nodes fetch weights from: an HTTP origin that counts its requests, and a
    regional tier on moto's S3 server; and each node's own cache directory."""

    origin: HttpOrigin
    s3: Any
    regional: str
    caches: dict[str, Path]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stores]:
    import s3fs

    origin = HttpOrigin()
    server = ThreadingHTTPServer((LOOPBACK, 0), handler_for(origin))
    server.daemon_threads = True
    origin.url = f"http://{LOOPBACK}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    with moto_s3() as endpoint, pytest.MonkeyPatch.context() as patch:
        s3 = s3fs.S3FileSystem(**s3_options(endpoint))
        # moto's servers in one process share their buckets: one of its own per module.
        regional = f"s3://ember-regional-{uuid.uuid4().hex[:8]}/cache"
        s3.mkdir(regional.removeprefix("s3://").split("/")[0])
        root = tmp_path_factory.mktemp("two-nodes")
        # Every node's processes reach the regional tier as a node would: through its
        # environment (credentials, endpoint, EMBER_REGIONAL_CACHE).
        for name, value in {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint,
                            "EMBER_REGIONAL_CACHE": regional}.items():
            patch.setenv(name, value)
        yield Stores(origin, s3, regional,
                     {name: root / f"{name}-cache" for name in ("node-a", "node-b")})
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def cluster(stores: Stores) -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    from ember.cluster import runtime

    if ray.is_initialized():
        # Never a silent skip: conftest.py runs these modules before anything starts the
        # session's cluster, so this only happens when that ordering is broken.
        pytest.fail("the two-node tests need a Ray cluster of their own, but this process "
                    "already joined one: run them first or alone "
                    "(pytest tests/integration/test_two_nodes*.py)")
    with pytest.MonkeyPatch.context() as patch:
        # The nodes' processes inherit this environment: the code is "installed" on both
        # nodes, and Ray Serve runs with the settings Ember gives the clusters it starts.
        paths = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]
        patch.setenv("PYTHONPATH", os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
        for name, value in {**THROUGHPUT_SETTINGS, **LOCAL_CLUSTER_ENV}.items():
            patch.setenv(name, value)
        # Both nodes and this driver advertise loopback, as a local cluster does (and as
        # separate machines would advertise their own addresses).
        use_loopback_node_ip()
        # Cluster() names its head in Ray's ray_current_cluster file, which any
        # ray.init() without an address on this machine then joins (other test runs' apps
        # landed here, and their teardown killed this cluster's Serve controller): keep it
        # private.
        patch.setattr(ray._private.utils, "write_ray_address", lambda *_, **__: None)
        # Admin routes from loopback with no admin key: the local-development opt-in.
        patch.setenv("EMBER_ADMIN_LOOPBACK", "1")
        # Each raylet, and so each worker it starts, keeps the environment it started with:
        # a node cache of its own, as separate machines have.
        patch.setenv("EMBER_CACHE_DIR", str(stores.caches["node-a"]))
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"node-a": 1}, "node_ip_address": LOOPBACK,
            "include_dashboard": False})
        try:
            patch.setenv("EMBER_CACHE_DIR", str(stores.caches["node-b"]))
            cluster.add_node(num_cpus=1, resources={"node-b": 1}, node_ip_address=LOOPBACK)
            cluster.wait_for_nodes()
            patch.delenv("EMBER_CACHE_DIR")  # the test process is neither node
            patch.setenv("RAY_ADDRESS", cluster.address)
            yield cluster
        finally:
            if ray.is_initialized():
                runtime.shutdown()
            cluster.shutdown()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def cluster_url(cluster: Any) -> str:
    url: str = ember.serve(app, port=free_port())
    wait_for(lambda: _get(f"{url}/readyz") == 200, 120, what="the app to be ready")
    return url


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


def node_labels() -> dict[str, str]:
    """Ray node id -> the custom resource that names the node."""
    import ray

    labels = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        names = [r for r in node["Resources"] if r.startswith("node-")]
        if node["Alive"] and names:
            labels[node["NodeID"]] = names[0]
    return labels


def placed(deployment: str, app_name: str = app.name) -> list[str]:
    """The node label of each running replica of ``deployment`` ("dead": on a lost node)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    details: dict[str, Any] = client.get_serve_details()
    rows = details["applications"][app_name]["deployments"][deployment]["replicas"]
    labels = node_labels()
    return sorted(labels.get(r["node_id"], "dead") for r in rows
                  if str(r["state"]).endswith("RUNNING"))


class Load:
    """Requests that each hold a replica for a while, from a few threads, until stopped."""

    def __init__(self, url: str, threads: int = 6, sleep_s: float = 1.0) -> None:
        self.url, self.sleep_s = url, sleep_s
        self.codes: list[int] = []
        self.nodes: set[str] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    reply = client.post(f"{self.url}/where", json={"sleep_s": self.sleep_s})
                except httpx.HTTPError:
                    self.codes.append(0)  # no answer at all (e.g. its edge's node died)
                    continue
                self.codes.append(reply.status_code)
                if reply.status_code == 200:
                    self.nodes.add(reply.json()["node_id"])


def edges_on_both_nodes() -> None:
    # /readyz answers once one edge listens; the other may start a moment later.
    wait_for(lambda: placed(EDGE_DEPLOYMENT) == ["node-a", "node-b"], 60,
             what="an edge on each node")


def test_an_edge_runs_on_each_node(cluster_url: str) -> None:
    edges_on_both_nodes()


def test_replicas_spread_over_both_nodes_scale_to_zero_and_come_back(cluster_url: str) -> None:
    with Load(cluster_url) as load:
        wait_for(lambda: placed("Where") == ["node-a", "node-b"], 90,
                 what="a replica of Where on each node")
        wait_for(lambda: len(load.nodes) == 2, 30, what="answers from both nodes")
    assert load.codes and set(load.codes) == {200}
    assert {node_labels()[n] for n in load.nodes} == {"node-a", "node-b"}

    wait_for(lambda: placed("Where") == [], 60, what="Where to scale to zero")
    started = time.monotonic()
    reply = httpx.post(f"{cluster_url}/where", json={}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert node_labels()[reply.json()["node_id"]] in {"node-a", "node-b"}
    assert time.monotonic() - started < 60
    assert len(placed("Where")) == 1


def test_the_kubernetes_serve_config_deploys_the_app_on_the_cluster(cluster_url: str) -> None:
    """What KubeRay does with ``serveConfigV2``: submit it to Serve, which builds the app."""
    import yaml
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from ember.cluster import k8s

    serve.delete(app.name)
    port = free_port()
    shape = k8s.ClusterShape(image="unused", host=LOOPBACK, port=port)
    manifest = k8s.rayservice(app, "apps.two_nodes:app", shape, environ={},
                              ray_version=ray_version())
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    client = _get_global_client()
    assert client is not None
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    url = f"http://{LOOPBACK}:{port}"
    wait_for(lambda: _get(f"{url}/readyz") == 200, 120, what="the app built from the config")
    edges_on_both_nodes()
    reply = httpx.post(f"{url}/where", json={}, timeout=60)
    assert reply.status_code == 200, reply.text


def ray_version() -> str:
    from importlib import metadata

    return metadata.version("ray")


def origin_bytes(origin: HttpOrigin, name: str) -> int:
    """Bytes the origin sent for ``name``: the sum of its ranged GETs (full GETs: the file)."""
    total = 0
    for rng in origin.ranged_gets(name):
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng)
        size = len(origin.files[name])
        total += min(int(m.group(2)), size - 1) - int(m.group(1)) + 1 if m else size
    return total


def test_cache_warm_all_nodes_fills_each_node_and_the_origin_serves_the_bytes_once(
    cluster_url: str, stores: Stores, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_weights(tmp_path / "model.safetensors", n=16, width=64 << 10)  # 4 MiB
    data = (tmp_path / "model.safetensors").read_bytes()
    url = stores.origin.put("weights/model.safetensors", data)
    capsys.readouterr()
    assert main(["cache", "warm", url, "--snapshot", "v1", "--all-nodes"]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():  # the per-node lines, fill times included, in the run's log
        print(out)
    labels = node_labels()
    lines = {labels[node]: line for line in out.splitlines() for node in labels
             if line.startswith(f"node {node} ")}
    assert sorted(lines) == ["node-a", "node-b"], out
    # One node filled from the origin, the other from the regional tier, not the origin.
    assert sorted("1 from origin" in line for line in lines.values()) == [False, True], out
    assert sum("1 from regional" in line for line in lines.values()) == 1, out
    assert all("snapshot " in line and " ready" in line for line in lines.values())
    assert origin_bytes(stores.origin, "weights/model.safetensors") == len(data)
    assert stores.s3.glob(f"{stores.regional}/*/blobs/*")
    for name, cache in stores.caches.items():
        [snapshot] = [s for s in list_snapshots(LoaderConfig(cache_dir=cache)) if s.url == url]
        assert snapshot.code_version == "v1" and snapshot.total_bytes == len(data), name

    # Again: every node finds its cache filled, and the origin sends nothing more.
    assert main(["cache", "warm", url, "--snapshot", "v1", "--all-nodes"]) == 0
    again = capsys.readouterr().out
    assert again.count("1 from node") == 2, again
    assert origin_bytes(stores.origin, "weights/model.safetensors") == len(data)


def test_cache_warm_all_nodes_names_the_node_whose_fill_failed(
    cluster_url: str, stores: Stores, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_weights(tmp_path / "model.safetensors", n=2, width=1024)
    url = stores.origin.put("broken-b/model.safetensors",
                            (tmp_path / "model.safetensors").read_bytes())
    node_b = next(node for node, label in node_labels().items() if label == "node-b")
    cache = stores.caches["node-b"]
    cache.mkdir(parents=True, exist_ok=True)
    aside = cache.with_name("node-b-cache.aside")
    cache.rename(aside)
    cache.write_text("not a directory")  # node-b cannot write its cache
    try:
        capsys.readouterr()
        assert main(["cache", "warm", url, "--all-nodes"]) == 1
    finally:
        cache.unlink()
        aside.rename(cache)
    captured = capsys.readouterr()
    assert f"node {node_b} " in captured.out and "failed:" in captured.out
    assert captured.err.strip().endswith(f"failed on 1 of 2 node(s): {node_b}"), captured.err


def test_a_replica_from_zero_starts_on_the_node_that_holds_its_snapshot(
    cluster_url: str, stores: Stores, tmp_path: Path
) -> None:
    """Each snapshot is on one node only; each deployment's first replica starts there."""
    from ray import serve

    make_weights(tmp_path / "model.safetensors", n=4, width=1024)
    url = stores.origin.put("near/model.safetensors",
                            (tmp_path / "model.safetensors").read_bytes())
    by_label = {label: node for node, label in node_labels().items()}
    versions = {"on-b": "near-b", "on-a": "near-a"}
    for route, label in (("on-b", "node-b"), ("on-a", "node-a")):
        node = Node(by_label[label], LOOPBACK)
        assert collect(submit([node], url, cache_dir=None, regional=None,
                              snapshot=versions[route])) == []
    serve.delete(app.name)  # room on both nodes
    near = ember.serve(near_app(url, versions), port=free_port())
    wait_for(lambda: _get(f"{near}/readyz") == 200, 60, what="the near app to be ready")
    for route, label in (("on-b", "node-b"), ("on-a", "node-a")):
        reply = httpx.post(f"{near}/{route}", json={}, timeout=60)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert node_labels()[body["node_id"]] == label, (route, body)
        assert body["restored"], body  # it mapped the snapshot it was placed for

