"""Every overlay renders, and what it renders is valid: the RayService against KubeRay's CRD schema, the core
resources (and the RayService's pod templates) against Kubernetes' schemas, and serveConfigV2 against Ray Serve's
deploy schema and the project's own config model, the one `specdec serve` accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if p.is_dir())
CRDS = ROOT.parent / "shared" / "k8s-schemas"
K8S_VERSION = "1.32"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="renders overlays with `kubectl kustomize`")


def render(overlay: str) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _no_unknown_fields(schema: dict) -> dict:
    """The API server silently drops fields a structural schema does not know: make them errors instead, so a
    misspelt key fails here rather than vanish in the cluster."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        for value in list(schema.values()):
            if isinstance(value, (dict, list)):
                _no_unknown_fields(value)
    elif isinstance(schema, list):
        for item in schema:
            _no_unknown_fields(item)
    return schema


def crd_schema(kind: str) -> dict:
    path = CRDS / "ray.io_rayservices.yaml"
    if not path.exists():
        pytest.skip(f"KubeRay CRDs not found at {CRDS}")
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind
    return _no_unknown_fields(next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])


def test_there_are_the_two_overlays():
    assert OVERLAYS == ["cpu-dev", "gpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayservice_matches_the_kuberay_crd(overlay):
    [service] = [d for d in render(overlay) if d["kind"] == "RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(crd_schema("RayService")).validate(service)


def test_the_crd_check_catches_a_misspelt_key():
    [service] = [d for d in render("cpu-dev") if d["kind"] == "RayService"]
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.Draft7Validator(crd_schema("RayService")).validate(service)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_resources_and_pod_templates_match_kubernetes_schemas(overlay):
    docs = render(overlay)
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    [service] = [d for d in docs if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    serve_service = {"apiVersion": "v1", "kind": "Service", **service["spec"]["serveService"]}
    kubernetes_validate.validate(serve_service, K8S_VERSION, strict=True)
    ports = {p["name"]: p for p in serve_service["spec"]["ports"]}
    assert ports["serve-grpc"]["port"] == 9000 and ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["serve"]["port"] == 8000


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_is_valid_for_ray_serve_and_for_specdec(overlay):
    [service] = [d for d in render(overlay) if d["kind"] == "RayService"]
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(serve_config)
    assert serve_config["grpc_options"]["port"] == 9000
    [app] = serve_config["applications"]
    assert app["import_path"] == "deployments.app:build" and app["name"] == "specdec"
    config = parse_config(app["args"])
    assert config.grpc_port == serve_config["grpc_options"]["port"]
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for placement, group in ((config.target, "target"), (config.draft, "draft")):
        # Each deployment asks for a custom resource that only its worker group advertises.
        (resource,) = placement.resources
        assert resource in groups[group]["rayStartParams"]["resources"]


def test_the_auth_token_comes_from_a_secret():
    docs = render("cpu-dev")
    [service] = [d for d in docs if d["kind"] == "RayService"]
    auth = service["spec"]["rayClusterConfig"]["authOptions"]
    assert auth["mode"] == "token"
    assert any(d["kind"] == "Secret" and d["metadata"]["name"] == auth["secretName"] for d in docs)


def test_gpu_overlay_reserves_tensor_parallel_gpus():
    [service] = [d for d in render("gpu") if d["kind"] == "RayService"]
    config = parse_config(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    target_group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(target_group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert config.target.tensor_parallel_size == 2 and config.target.num_gpus == 1
    assert gpus == config.target.tensor_parallel_size * config.target.num_gpus  # one replica's ranks per pod
