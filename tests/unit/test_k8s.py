"""``ember deploy APP --k8s``: the RayService manifest, checked against KubeRay's fields."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

import ember
from ember.cli import main
from ember.cluster import build, k8s, k8s_redis, runtime
from ember.cluster.k8s import ClusterShape, Replica, nodes_needed
from ember.errors import ConfigError

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "rayservice.v1.json").read_text())
FLAGSHIP = "ember.deployments.embeddings:app"


def validate(manifest: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest)


@ember.deployment(route="/small", num_cpus=0.5, warm_floor=2, max_replicas=6)
class Small:
    def __call__(self, x: int) -> int:
        return x


@ember.deployment(route="/big", num_cpus=2, num_gpus=1, max_replicas=3)
class Big:
    def __call__(self, x: int) -> int:
        return x


def manifest_of(app: ember.App, environ: dict[str, str] | None = None,
                **shape: Any) -> dict[str, Any]:
    return k8s.rayservice(app, "tests_app:app", ClusterShape(image="img:1", **shape),
                          environ=environ or {}, ray_version="2.60.0")


def groups(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    specs = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return {g["groupName"]: g for g in specs}


def test_the_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_the_flagship_manifest_printed_by_the_cli_validates(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP, "--k8s", "--image", "registry.example/ember:1"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    manifest = next(d for d in docs if d["kind"] == "RayService")
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert policy["kind"] == "NetworkPolicy"
    validate(manifest)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["metadata"]["name"] == "embeddings"
    worker = groups(manifest)["cpu"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "registry.example/ember:1"
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    assert {"name": "serve", "containerPort": 8000, "protocol": "TCP"} in worker["ports"]


def test_the_cli_writes_an_opening_setting_only_when_its_flag_names_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ADMIN_LOOPBACK", "1")
    assert main(["deploy", FLAGSHIP, "--k8s"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and "--admin-loopback" in said.err  # nothing printed to apply
    assert main(["deploy", FLAGSHIP, "--k8s", "--admin-loopback"]) == 0
    manifest = next(d for d in yaml.safe_load_all(capsys.readouterr().out)
                    if d["kind"] == "RayService")
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in head["containers"][0]["env"]}
    assert env["EMBER_ADMIN_LOOPBACK"] == "1" and "EMBER_ALLOW_UNAUTHENTICATED" not in env


def test_json_output_is_the_same_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP, "--k8s"]) == 0
    from_yaml = list(yaml.safe_load_all(capsys.readouterr().out))
    assert main(["deploy", FLAGSHIP, "--k8s", "--json"]) == 0
    from_json = json.loads(capsys.readouterr().out)
    assert (from_json["apiVersion"], from_json["kind"]) == ("v1", "List")
    validate(next(i for i in from_json["items"] if i["kind"] == "RayService"))
    assert from_json["items"] == from_yaml


def test_deploy_without_a_target_platform_says_what_to_add(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP]) == 2
    assert "--k8s" in capsys.readouterr().err


def test_the_serve_config_is_one_ray_serve_accepts_and_builds_the_app() -> None:
    from ember.deployments.embeddings import app

    config = yaml.safe_load(manifest_of(app, port=9000)["spec"]["serveConfigV2"])
    parsed = ServeDeploySchema.model_validate(config)
    (application,) = parsed.applications
    assert application.import_path == build.IMPORT_PATH
    assert (application.name, application.route_prefix) == ("embeddings", None)
    assert application.args == {"target": "tests_app:app", "host": "0.0.0.0", "port": 9000}
    assert parsed.proxy_location.value == "Disabled"  # the edges listen instead


def test_the_import_path_builds_the_named_app(monkeypatch: pytest.MonkeyPatch) -> None:
    module, _, attr = build.IMPORT_PATH.partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    assert len(inspect.signature(builder).parameters) == 1  # what Serve requires
    seen: dict[str, Any] = {}
    monkeypatch.setattr(runtime, "build_application",
                        lambda app, host, port: seen.update(app=app.name, host=host, port=port))
    builder({"target": FLAGSHIP, "host": "0.0.0.0", "port": 9000})
    assert seen == {"app": "embeddings", "host": "0.0.0.0", "port": 9000}


def test_worker_groups_follow_the_deployments() -> None:
    manifest = manifest_of(ember.App([Small, Big], warm_pool=0), worker_cpus=4,
                           worker_memory_gib=12.5, worker_gpus=2)
    validate(manifest)
    cpu, gpu = groups(manifest)["cpu"], groups(manifest)["gpu"]
    # Small: 2 warm replicas of 0.5 CPU fit one pod; 6 at most need 3.0 of its 3.9 CPUs.
    assert (cpu["minReplicas"], cpu["replicas"], cpu["maxReplicas"]) == (1, 1, 1)
    # Big scales to zero; 3 replicas of 2 CPUs + 1 GPU: a pod's 2 GPUs would hold two, its
    # 3.9 CPUs for replicas only one -> 3 pods.
    assert (gpu["minReplicas"], gpu["replicas"], gpu["maxReplicas"]) == (0, 0, 3)
    assert gpu["rayStartParams"] == {"num-cpus": "4", "num-gpus": "2"}
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "4", "memory": "12800Mi", "nvidia.com/gpu": "2"}


def test_more_replicas_ask_for_more_pods() -> None:
    one = groups(manifest_of(ember.App([Small], warm_pool=0), worker_cpus=1))["cpu"]
    # 0.9 CPU per pod for replicas: one 0.5 replica each; floors of 2 -> 2 pods, max 6 -> 6.
    assert (one["minReplicas"], one["maxReplicas"]) == (2, 6)
    # The warm pool runs whenever the app does: nine of 0.1 CPU fill the 0.4 left on each of
    # the two pods and need a third.
    with_pool = groups(manifest_of(ember.App([Small], warm_pool=9), worker_cpus=1))["cpu"]
    assert (with_pool["minReplicas"], with_pool["maxReplicas"]) == (3, 6)


def test_a_replica_larger_than_a_pod_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"Big needs 2 CPUs and 1 GPUs.*--worker-cpus"):
        manifest_of(ember.App([Big], warm_pool=0), worker_cpus=2)


def test_first_fit_packs_largest_first() -> None:
    replicas = [Replica("a", 0.6)] * 3 + [Replica("b", 0.4)] * 3
    assert nodes_needed(replicas, cpus=1.0) == 3
    assert nodes_needed([], cpus=1.0) == 0
    assert nodes_needed([Replica("g", 1, 1)] * 3, cpus=8, gpus=2) == 2


def test_settings_travel_and_keys_come_from_a_secret() -> None:
    environ = {"EMBER_SCALEDOWN_AFTER_S": "30", "EMBER_ACCESS_LOG": "1",
               "EMBER_API_KEYS": "sk-live-secret", "EMBER_URL": "http://127.0.0.1:8000",
               "EMBER_ADMIN_KEY": "adm-secret", "EMBER_PORT": "8100", "HOME": "/root"}
    manifest = manifest_of(ember.App([Small], name="tests", warm_pool=0), environ)
    validate(manifest)
    head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e for e in head["containers"][0]["env"]}
    assert env["EMBER_SCALEDOWN_AFTER_S"]["value"] == "30"
    assert env["EMBER_PORT"]["value"] == "8100"
    # Required: a missing or misspelt Secret stops the pods rather than serving with no key.
    assert env["EMBER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "tests-ember-keys", "key": "EMBER_API_KEYS", "optional": False}
    assert "sk-live-secret" not in json.dumps(manifest) and "adm-secret" not in json.dumps(manifest)
    assert "EMBER_URL" not in env and "HOME" not in env
    assert env["RAY_SERVE_USE_GRPC_BY_DEFAULT"]["value"] == "1"
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in env  # Ray's own 0.1 s


@pytest.mark.parametrize("variable", ["EMBER_ADMIN_LOOPBACK", "EMBER_ALLOW_UNAUTHENTICATED"])
def test_a_shells_opt_in_that_opens_a_door_is_refused_unless_named(variable: str) -> None:
    app = ember.App([Small], name="tests", warm_pool=0)
    with pytest.raises(ConfigError, match=f"{variable} is set in this shell"):
        manifest_of(app, {variable: "1"})
    field = variable.removeprefix("EMBER_").lower()
    for environ in ({variable: "1"}, {}):  # named: written on, whatever the shell says
        manifest = k8s.rayservice(app, "tests_app:app", ClusterShape(image="img:1"),
                                  environ=environ, ray_version="2.60.0", opened=[field])
        validate(manifest)
        head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
        env = {e["name"]: e for e in head["containers"][0]["env"]}
        assert env[variable]["value"] == "1"
    manifest = manifest_of(app, {variable: "0"})  # off in the shell: nothing to carry
    assert variable not in json.dumps(manifest)


def test_the_opening_settings_are_read_from_the_environment_given_not_this_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(``settings.load`` of a mapping also reads the process's variables.)"""
    monkeypatch.setenv("EMBER_ADMIN_LOOPBACK", "1")
    manifest = manifest_of(ember.App([Small], name="tests", warm_pool=0), {})
    assert "EMBER_ADMIN_LOOPBACK" not in json.dumps(manifest)


def test_a_malformed_setting_is_refused_before_any_manifest() -> None:
    with pytest.raises(ConfigError, match="EMBER_WARM_POOL"):
        manifest_of(ember.App([Small], warm_pool=0), {"EMBER_WARM_POOL": "many"})


def _misspell(m: dict[str, Any]) -> None:
    m["spec"]["rayClusterConfig"]["workerGroupSpec"] = m["spec"]["rayClusterConfig"].pop(
        "workerGroupSpecs")


def _wrong_type(m: dict[str, Any]) -> None:
    m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "1"


def _missing_required(m: dict[str, Any]) -> None:
    del m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]


def _bad_quantity(m: dict[str, Any]) -> None:
    head = m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["resources"]["limits"]["cpu"] = "two"


def _start_param_not_a_string(m: dict[str, Any]) -> None:
    m["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0


def _misspelled_probe(m: dict[str, Any]) -> None:
    worker = m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    probe = worker["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["httpGet"]["paht"] = probe["httpGet"].pop("path")


@pytest.mark.parametrize("breaks", [_misspell, _wrong_type, _missing_required, _bad_quantity,
                                    _start_param_not_a_string, _misspelled_probe])
def test_a_broken_manifest_fails_validation(breaks: Any) -> None:
    manifest = manifest_of(ember.App([Small], warm_pool=0))
    validate(manifest)
    broken = copy.deepcopy(manifest)
    breaks(broken)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


@ember.deployment(route="/patient", graceful_shutdown_s=45)
class Patient:
    def __call__(self, x: int) -> int:
        return x


def test_worker_pods_get_probes_and_a_grace_that_covers_the_longest_drain() -> None:
    for app, longest_s in ((ember.App([Small], warm_pool=0), 20),
                           (ember.App([Small, Patient], warm_pool=0), 45)):
        manifest = manifest_of(app)
        validate(manifest)
        pod = groups(manifest)["cpu"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= k8s.PRESTOP_S + longest_s
        worker = pod["containers"][0]
        assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8000}
        assert worker["lifecycle"]["preStop"]["exec"]["command"] == ["sleep",
                                                                      str(k8s.PRESTOP_S)]


def _pods(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return [g["template"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_rays_ports_are_closed_to_other_pods_and_only_the_edge_port_is_open() -> None:
    app = ember.App([Small, Big], name="tests", warm_pool=0)
    *_, service, policy = k8s.manifests(app, "tests_app:app", ClusterShape(image="img:1"),
                                    environ={"EMBER_PORT": "8100"}, ray_version="2.60.0")
    validate(service)
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    # It covers every pod of the cluster, head and workers.
    assert all(_selects(spec["podSelector"], pod["metadata"]["labels"])
               for pod in _pods(service))
    own, operator, anyone = spec["ingress"]
    # The cluster's own pods reach any port: Ray's processes talk on many.
    assert own["from"] == [{"podSelector": spec["podSelector"]}] and "ports" not in own
    # KubeRay's operator reaches the dashboard only, to submit the Serve config.
    assert operator["ports"] == [{"protocol": "TCP", "port": k8s.HEAD_PORTS["dashboard"]}]
    assert operator["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kuberay-operator"}
    # Everyone else reaches the edges' port, and nothing else: no GCS, dashboard, client.
    assert "from" not in anyone and anyone["ports"] == [{"protocol": "TCP", "port": 8100}]
    open_to_all = {p["port"] for rule in spec["ingress"] if not rule.get("from")
                   for p in rule["ports"]}
    assert open_to_all.isdisjoint(k8s.HEAD_PORTS.values())


def test_ray_token_auth_guards_the_dashboard_and_gcs() -> None:
    service = manifest_of(ember.App([Small], name="tests", warm_pool=0))
    validate(service)
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_the_policy_lives_in_the_apps_namespace() -> None:
    app = ember.App([Small], name="tests", warm_pool=0)
    *_, policy = k8s.manifests(app, "tests_app:app", ClusterShape(image="i", namespace="ml"),
                               environ={}, ray_version="2.60.0")
    assert policy["metadata"]["namespace"] == "ml"


def test_the_gcs_keeps_its_state_in_the_redis_the_manifest_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP, "--k8s", "--namespace", "serving"]) == 0
    *redis, service, policy = yaml.safe_load_all(capsys.readouterr().out)
    assert policy["kind"] == "NetworkPolicy"
    validate(service)
    ft = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    by_kind = {o["kind"]: o for o in redis}
    assert set(by_kind) == {"PersistentVolumeClaim", "Deployment", "Service", "NetworkPolicy"}
    assert all(o["metadata"]["namespace"] == "serving" for o in redis)
    # The RayService points at the Service the manifest makes, on the port it serves.
    host, port = ft["redisAddress"].split(":")
    assert host == by_kind["Service"]["metadata"]["name"] == "embeddings-redis"
    assert int(port) == by_kind["Service"]["spec"]["ports"][0]["port"]
    # One password for both sides, from the Secret the operator creates; never inline.
    secret = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    redis_env = pod["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert secret == redis_env == {"name": "embeddings-redis", "key": "password"}
    assert "$REDIS_PASSWORD" in pod["containers"][0]["command"][-1]
    # Redis writes every change to an append-only file on a volume that outlives its pod.
    assert "--appendonly yes" in pod["containers"][0]["command"][-1]
    claim = pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == by_kind["PersistentVolumeClaim"]["metadata"]["name"]
    selector = by_kind["Deployment"]["spec"]["selector"]["matchLabels"]
    assert by_kind["Service"]["spec"]["selector"] == selector
    assert by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"] == selector


def test_only_the_ray_head_reaches_the_gcs_redis() -> None:
    app = ember.App([Small], name="tests", warm_pool=0)
    *redis, service, _ = k8s.manifests(app, "tests_app:app", ClusterShape(image="img:1"),
                                       environ={}, ray_version="2.60.0")
    by_kind = {o["kind"]: o for o in redis}
    spec = by_kind["NetworkPolicy"]["spec"]
    redis_pod = by_kind["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert _selects(spec["podSelector"], redis_pod) and spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": k8s_redis.REDIS_PORT}]
    (peer,) = rule["from"]
    cluster = service["spec"]["rayClusterConfig"]
    head = {**cluster["headGroupSpec"]["template"]["metadata"]["labels"],
            k8s.HEAD_NODE_LABEL: "head"}  # what KubeRay adds to the head's pod
    worker = {**cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"],
              k8s.HEAD_NODE_LABEL: "worker"}
    assert _selects(peer["podSelector"], head) and not _selects(peer["podSelector"], worker)
    assert "namespaceSelector" not in peer  # the manifest's namespace only


def test_an_existing_redis_is_named_and_none_is_made(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP, "--k8s", "--redis-address", "redis.infra:6380"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["RayService", "NetworkPolicy"]
    validate(docs[0])
    ft = docs[0]["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] == "redis.infra:6380"
