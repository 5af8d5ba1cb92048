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
from ember.cluster import build, k8s, runtime
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
    manifest = yaml.safe_load(capsys.readouterr().out)
    validate(manifest)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["metadata"]["name"] == "embeddings"
    worker = groups(manifest)["cpu"]["template"]["spec"]["containers"][0]
    assert worker["image"] == "registry.example/ember:1"
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    assert {"name": "serve", "containerPort": 8000, "protocol": "TCP"} in worker["ports"]


def test_json_output_is_the_same_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP, "--k8s"]) == 0
    from_yaml = yaml.safe_load(capsys.readouterr().out)
    assert main(["deploy", FLAGSHIP, "--k8s", "--json"]) == 0
    from_json = json.loads(capsys.readouterr().out)
    validate(from_json)
    assert from_json == from_yaml


def test_deploy_without_a_target_platform_says_what_to_add(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["deploy", FLAGSHIP]) == 2
    assert "--k8s" in capsys.readouterr().err


def test_the_serve_config_is_one_ray_serve_accepts_and_builds_the_app() -> None:
    from ember.deployments.embeddings import app

    config = yaml.safe_load(manifest_of(app, port=9000)["spec"]["serveConfigV2"])
    parsed = ServeDeploySchema.model_validate(config)
    (application,) = parsed.applications
    assert application.import_path == cluster.IMPORT_PATH
    assert (application.name, application.route_prefix) == ("embeddings", None)
    assert application.args == {"target": "tests_app:app", "host": "0.0.0.0", "port": 9000}
    assert parsed.proxy_location.value == "Disabled"  # the edges listen instead


def test_the_import_path_builds_the_named_app(monkeypatch: pytest.MonkeyPatch) -> None:
    module, _, attr = cluster.IMPORT_PATH.partition(":")
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
    assert env["EMBER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": "tests-ember-keys", "key": "EMBER_API_KEYS", "optional": True}
    assert "sk-live-secret" not in json.dumps(manifest) and "adm-secret" not in json.dumps(manifest)
    assert "EMBER_URL" not in env and "HOME" not in env
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]["value"] == "0.05"


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
