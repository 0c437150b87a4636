"""deploy/kuberay: every Kubernetes object validated against the Kubernetes API schemas
(kubernetes-validate, strict), the RayCluster against tests/data/raycluster.schema.json with its pod
templates checked as real PodTemplateSpecs, and the pieces checked against each other and against
the real CLI and ServeConfig: ports, GPUs per replica, mounted Secrets, probes. No cluster needed."""
from __future__ import annotations

import copy
import json
import shlex
import tempfile
import tomllib
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from hybridspec.cli.main import build_parser
from hybridspec.cloud.config import ServeConfig
from hybridspec.common.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay"
RAYCLUSTER_SCHEMA = Path(__file__).parent / "data" / "raycluster.schema.json"
K8S_VERSIONS = ("1.30", "1.37")  # the oldest and newest Kubernetes minor versions we claim


def documents() -> list[dict]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str, name: str | None = None) -> dict:
    found = [d for d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def raycluster() -> dict:
    return one("RayCluster")


def head_container() -> dict:
    return raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def head_command() -> list[str]:
    """The `hybridspec ...` command the head container's shell script ends by exec-ing."""
    script = " ".join(head_container()["args"])
    last = [part.strip() for part in script.split(";") if part.strip()][-1]
    words = shlex.split(last)
    assert words[:2] == ["exec", "hybridspec"], f"the head must exec the front door last, got {last!r}"
    return words[1:]


def serve_config() -> ServeConfig:
    """The ServeConfig the head runs: its command line through the real CLI, --config read from the
    ConfigMap mounted at that path."""
    from hybridspec.cli.cloud_cmd import serve_config as from_args

    args = build_parser().parse_args(head_command()[1:])
    mount = next(m for m in head_container()["volumeMounts"] if m["mountPath"] == args.config)
    volume = next(v for v in raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    text = one("ConfigMap", volume["configMap"]["name"])["data"][mount["subPath"]]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(text)
        file.flush()
        args.config = file.name
        return from_args(args)


# ----------------------------------------------------------------------------------------------
# schemas

def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert {d["kind"] for d in documents()} == {"Namespace", "ConfigMap", "RayCluster", "Service", "NetworkPolicy"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_objects_validate_strictly(version):
    checked = 0
    for doc in documents():
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked == len(documents()) - 1


def raycluster_validator() -> jsonschema.Validator:
    """Our RayCluster schema, its Kubernetes refs resolved from kubernetes-validate's strict schemas."""
    definitions = json.loads((Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" /
                              "v1.37.0-local-strict" / "_definitions.json").read_text())
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    registry = referencing.Registry().with_resources([
        ("/api/_definitions.json", referencing.Resource.from_contents(definitions)),
        (schema["$id"], referencing.Resource.from_contents(schema)),
    ])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_raycluster_matches_the_crd_schema_and_pod_templates_are_real_pod_templates():
    raycluster_validator().validate(raycluster())


@pytest.mark.parametrize("breakage", [
    lambda rc: rc["spec"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}),  # not a string
    lambda rc: rc["spec"]["workerGroupSpecs"][0].update({"replica": 4}),  # misspelt
    lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update({"imagePullPolicy": 3}),
    lambda rc: rc["spec"]["workerGroupSpecs"][0]["template"]["spec"].update({"container": []}),  # not a PodSpec field
    lambda rc: rc["spec"].update({"headGroupSpec": {"rayStartParams": {}}}),  # no template
], ids=["number-param", "misspelt-field", "bad-container-field", "unknown-podspec-field", "no-template"])
def test_the_raycluster_schema_catches_mistakes(breakage):
    broken = copy.deepcopy(raycluster())
    breakage(broken)
    with pytest.raises(jsonschema.ValidationError):
        raycluster_validator().validate(broken)


# ----------------------------------------------------------------------------------------------
# the pieces agree with each other and with the CLI

def test_the_head_runs_the_front_door_with_a_valid_config():
    command = head_command()
    assert command[:3] == ["hybridspec", "cloud", "serve"]
    config = serve_config()
    assert config.server.backend == "ray" and config.pool.ray_address == "auto" and config.replica.device == "cuda"
    assert config.server.host == "0.0.0.0" and config.access.tls.enabled and config.access.credentials
    assert not config.server.insecure
    assert config.server.direct_verify is False, "edges cannot reach Pod IPs: rounds go through the front door"
    assert raycluster()["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "$KUBERAY_GEN_RAY_START_CMD &" in " ".join(head_container()["args"])


def test_plaintext_in_the_configmap_would_be_refused():
    text = yaml.safe_load(one("ConfigMap")["data"]["cloud.yaml"])
    text.update(tls_cert="", tls_key="")
    with pytest.raises(ConfigError, match="without TLS"):
        load_config(ServeConfig, None, text)


def test_one_replica_per_gpu_and_the_counts_agree():
    config = serve_config()
    groups = raycluster()["spec"]["workerGroupSpecs"]
    gpus = 0
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = group["template"]["spec"]["containers"][0]
        per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert per_pod == 1 and config.pool.replica_num_gpus == 1.0
        assert float(group["rayStartParams"]["num-cpus"]) >= config.pool.replica_num_cpus * per_pod
        gpus += group["replicas"] * per_pod
    assert config.pool.replicas == gpus
    head = raycluster()["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head_container()["resources"].get("limits", {})


def test_ray_version_and_images_are_pinned_to_what_the_image_installs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ray_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("ray=="))
    assert raycluster()["spec"]["rayVersion"] == ray_pin.split("==")[1]
    images = {c["image"] for g in [raycluster()["spec"]["headGroupSpec"], *raycluster()["spec"]["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert len(images) == 1
    tag = next(iter(images)).rpartition(":")[2]
    assert tag == pyproject["project"]["version"]


def test_services_select_the_head_and_reach_its_ports():
    config = serve_config()
    head_labels = {"ray.io/cluster": raycluster()["metadata"]["name"], "ray.io/node-type": "head"}
    named = {p["name"]: p["containerPort"] for p in head_container()["ports"]}
    front, metrics = one("Service", "hybridspec-verifier"), one("Service", "hybridspec-metrics")
    for service, port, kind in ((front, config.server.port, "LoadBalancer"), (metrics, config.server.metrics_port, "ClusterIP")):
        assert service["spec"]["selector"] == head_labels
        assert service["spec"]["type"] == kind
        (entry,) = service["spec"]["ports"]
        assert named[entry["targetPort"]] == port == entry["port"]


def test_probes_use_the_metrics_servers_health_routes():
    config = serve_config()
    named = {p["name"]: p["containerPort"] for p in head_container()["ports"]}
    ready, live = head_container()["readinessProbe"]["httpGet"], head_container()["livenessProbe"]["httpGet"]
    assert (ready["path"], named[ready["port"]]) == ("/health/ready", config.server.metrics_port)
    assert (live["path"], named[live["port"]]) == ("/health", config.server.metrics_port)
    for group in raycluster()["spec"]["workerGroupSpecs"]:
        probe = group["template"]["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["port"]
        assert str(probe) == group["rayStartParams"]["node-manager-port"]


def mounted_secret(path: str) -> tuple[str, str]:
    """(Secret name, key) that a file path of the head container comes from."""
    pod = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in head_container()["volumeMounts"]:
        parent = PurePosixPath(mount["mountPath"])
        if PurePosixPath(path).parent == parent and "secret" in volumes[mount["name"]]:
            assert "subPath" not in mount, "a subPath mount never sees an updated Secret"
            return volumes[mount["name"]]["secret"]["secretName"], PurePosixPath(path).name
    pytest.fail(f"{path} is not in a mounted Secret")


def test_tls_and_credentials_come_from_mounted_secrets():
    config = serve_config()
    assert mounted_secret(config.access.tls_cert) == ("hybridspec-tls", "tls.crt")  # a kubernetes.io/tls Secret
    assert mounted_secret(config.access.tls_key) == ("hybridspec-tls", "tls.key")
    assert mounted_secret(config.access.credentials) == ("hybridspec-credentials", "credentials.yaml")


def test_grace_and_network_policy():
    config = serve_config()
    pod = raycluster()["spec"]["headGroupSpec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > config.server.grace_s
    assert pod["securityContext"]["runAsNonRoot"] is True
    policy = one("NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"ray.io/cluster": raycluster()["metadata"]["name"]}
    open_ports = {p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {config.server.port}, "only the front door is open to everyone"
    metrics_rules = [r for r in policy["ingress"] if any(p["port"] == config.server.metrics_port for p in r.get("ports", []))]
    assert metrics_rules and all("namespaceSelector" in src for r in metrics_rules for src in r["from"])
