"""Every overlay renders, and what it renders is valid: the RayService against KubeRay's CRD schema, the core
resources (and the RayService's pod templates) against Kubernetes' schemas, the Gateway API and cert-manager
resources against hand-written shapes (tests/k8s/shapes.py: their CRDs are not in ../shared/k8s-schemas), and
serveConfigV2 against Ray Serve's deploy schema and the project's own config model, the one `specdec serve` accepts."""

from __future__ import annotations

import functools
import shutil
from pathlib import PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.config import gRPCOptions
from ray.serve.schema import ServeDeploySchema

from deployments.app import grpc_options
from deployments.serve_config import parse_config
from tests.k8s.manifests import OVERLAYS, ROOT, env, one, pod_templates, render, volume_at
from tests.k8s.shapes import SHAPES

CRDS = ROOT.parent / "shared" / "k8s-schemas"
K8S_VERSION = "1.32"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="renders overlays with `kubectl kustomize`")


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


@functools.cache
def crd_schema(kind: str) -> dict:
    path = CRDS / "ray.io_rayservices.yaml"
    if not path.exists():
        pytest.skip(f"KubeRay CRDs not found at {CRDS}")
    crd = yaml.safe_load(path.read_text())
    assert crd["spec"]["names"]["kind"] == kind
    return _no_unknown_fields(
        next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    )


def test_there_are_the_three_overlays():
    assert OVERLAYS == ["cpu-dev", "gpu", "gpu-tls-gateway"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayservice_matches_the_kuberay_crd(overlay):
    service = one(render(overlay), "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(crd_schema("RayService")).validate(service)


def test_the_crd_check_catches_a_misspelt_key():
    service = one(render("cpu-dev"), "RayService")
    service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.Draft7Validator(crd_schema("RayService")).validate(service)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_resources_and_pod_templates_match_kubernetes_schemas(overlay):
    docs = render(overlay)
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/") or (doc["apiVersion"], doc["kind"]) in SHAPES:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # an unknown kind fails here: none slips through
    service = one(docs, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "x", **template.get("metadata", {})},
            "spec": template["spec"],
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    serve_service = {"apiVersion": "v1", "kind": "Service", **service["spec"]["serveService"]}
    kubernetes_validate.validate(serve_service, K8S_VERSION, strict=True)
    ports = {p["name"]: p for p in serve_service["spec"]["ports"]}
    assert ports["serve-grpc"]["port"] == 9000 and ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["serve"]["port"] == 8000


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_api_and_cert_manager_resources_match_their_hand_written_shapes(overlay):
    for doc in render(overlay):
        if (doc["apiVersion"], doc["kind"]) in SHAPES:
            jsonschema.Draft7Validator(SHAPES[doc["apiVersion"], doc["kind"]]).validate(doc)


@pytest.mark.parametrize(
    ("kind", "path", "value", "error"),
    [
        ("Gateway", ["spec", "listeners", 0, "tls", "mode"], "Terminated", "Terminated"),
        ("Gateway", ["spec", "listeners", 0, "allowedRoute"], {}, "allowedRoute"),
        ("Gateway", ["spec", "gatewayClassName"], None, "gatewayClassName"),
        ("GRPCRoute", ["spec", "rules", 0, "matches", 0, "method"], {"type": "Exact"}, "required"),
        ("HTTPRoute", ["spec", "rules", 0, "backendRefs", 0, "port"], 70000, "70000"),
        ("Certificate", ["spec", "secretName"], None, "secretName"),
        ("Certificate", ["spec", "privateKey", "rotationPolicy"], "Sometimes", "Sometimes"),
    ],
)
def test_the_hand_written_shapes_catch_a_broken_resource(kind, path, value, error):
    doc = next(d for d in render("gpu-tls-gateway") if d["kind"] == kind)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is None:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.Draft7Validator(SHAPES[doc["apiVersion"], doc["kind"]]).validate(doc)


def test_the_base_overlay_needs_neither_gateway_api_nor_cert_manager():
    groups = {d["apiVersion"].split("/")[0] for d in render("cpu-dev") if "/" in d["apiVersion"]}
    assert groups == {"ray.io", "networking.k8s.io"}  # KubeRay's, and Kubernetes' own NetworkPolicy
    assert not any(d["apiVersion"].startswith("gateway.networking.k8s.io/") for d in render("gpu"))


def kernel_dir_problems(template: dict) -> list[str]:
    """Where a container that runs specdec would cache compiled kernels off its own pod, or nowhere."""
    problems = []
    spec = template["spec"]
    for container in spec["containers"][:1] + spec.get("initContainers", []):
        variables = env(container)
        if "SPECDEC_HOME" not in variables:
            continue  # runs no specdec code (the TLS init container)
        if "SPECDEC_KERNEL_DIR" not in variables:
            problems.append(f"{container['name']}: no SPECDEC_KERNEL_DIR")
            continue
        path = variables["SPECDEC_KERNEL_DIR"]["value"]
        home = variables["SPECDEC_HOME"]["value"]
        found = volume_at(template, container, path)
        if PurePosixPath(path).is_relative_to(home) or PurePosixPath(path).is_relative_to("/models"):
            problems.append(f"{container['name']}: {path} is on the models volume")
        elif found is None or "emptyDir" not in found[1]:
            problems.append(f"{container['name']}: {path} is not on an emptyDir of the pod")
        elif found[0]["mountPath"] == path:
            problems.append(f"{container['name']}: {path} is the mount point itself (root's, 0777), not in it")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_caches_kernels_in_its_own_pod(overlay):
    service = one(render(overlay), "RayService")
    for group, template in pod_templates(service).items():
        assert "SPECDEC_HOME" in env(template["spec"]["containers"][0]), group  # the Ray container is checked
        assert kernel_dir_problems(template) == [], group


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("/models/kernels", "models volume"),
        ("/home/ray/.cache/specdec/kernels", "not on an emptyDir"),
        ("/var/cache/specdec", "mount point itself"),
        (None, "no SPECDEC_KERNEL_DIR"),
    ],
)
def test_the_kernel_dir_check_catches_a_shared_or_missing_directory(value, problem):
    template = pod_templates(one(render("cpu-dev"), "RayService"))["draft"]
    ray = template["spec"]["containers"][0]
    if value is None:
        ray["env"] = [e for e in ray["env"] if e["name"] != "SPECDEC_KERNEL_DIR"]
    else:
        env(ray)["SPECDEC_KERNEL_DIR"]["value"] = value
    assert problem in " ".join(kernel_dir_problems(template))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_runs_its_workers_at_nice_0(overlay):
    """Ray's default for its workers is nice 15: every replica would yield its cores to any other process."""
    service = one(render(overlay), "RayService")
    for group, template in pod_templates(service).items():
        variables = env(template["spec"]["containers"][0])
        assert variables.get("RAY_worker_niceness", {}).get("value") == "0", group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_containers_keep_the_probes_kuberay_gives_them(overlay):
    """KubeRay probes a Ray container only where it sets none: a worker's readiness then follows Serve's draining of
    its proxy, which a gRPC health probe would lose, and a probe on the head that waits for the application would
    keep KubeRay from deploying it (docs/deploy.md#health-and-probes)."""
    service = one(render(overlay), "RayService")
    for group, template in pod_templates(service).items():
        ray = template["spec"]["containers"][0]
        assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(ray), group


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_is_valid_for_ray_serve_and_for_specdec(overlay):
    service = one(render(overlay), "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config) if hasattr(
        ServeDeploySchema, "model_validate"
    ) else ServeDeploySchema.parse_obj(serve_config)
    assert serve_config["grpc_options"]["port"] == 9000
    [app] = serve_config["applications"]
    assert app["import_path"] == "deployments.app:build" and app["name"] == "specdec"
    config = parse_config(app["args"])
    assert config.grpc_port == serve_config["grpc_options"]["port"]
    # The proxy `specdec serve` starts: the API and the health Check routed to the router, reflection on.
    assert gRPCOptions(**serve_config["grpc_options"]) == grpc_options(config)
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for placement, group in ((config.target, "target"), (config.draft, "draft")):
        # Each deployment asks for a custom resource that only its worker group advertises.
        (resource,) = placement.resources
        assert resource in groups[group]["rayStartParams"]["resources"]


def test_the_auth_token_comes_from_a_secret():
    docs = render("cpu-dev")
    service = one(docs, "RayService")
    auth = service["spec"]["rayClusterConfig"]["authOptions"]
    assert auth["mode"] == "token"
    assert any(d["kind"] == "Secret" and d["metadata"]["name"] == auth["secretName"] for d in docs)


def test_gpu_overlay_reserves_tensor_parallel_gpus():
    service = one(render("gpu"), "RayService")
    config = parse_config(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    target_group = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    gpus = int(target_group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert config.target.tensor_parallel_size == 2 and config.target.num_gpus == 1
    assert gpus == config.target.tensor_parallel_size * config.target.num_gpus  # one replica's ranks per pod
