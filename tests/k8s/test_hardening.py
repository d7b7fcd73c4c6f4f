"""What every overlay renders for the pods' safety: the public API's token is required, every container runs as the
image's non-root user without privilege on a read-only root, only the init containers that pull models may write the
models volume, worker pods hold no service-account token, and a NetworkPolicy lets in the public ports from anywhere,
Ray's own traffic between the cluster's pods, metrics from the monitoring namespace only, and nothing else."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.k8s.manifests import K8S, OVERLAYS, env, one, pod_templates, render

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="renders overlays with `kubectl kustomize`")

MODELS_WRITERS = {"pull-models"}  # the init containers that run `specdec models pull`
CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
KUBERAY_LABELS = {"ray.io/cluster": "specdec-raycluster-x7k2p", "ray.io/is-ray-node": "yes"}


def image_uid() -> int:
    """The uid of the `ray` user the image runs as (k8s/image/prepare_base.sh makes it where the base has none)."""
    (uid,) = re.findall(r"useradd .*--uid (\d+)", (K8S / "image" / "prepare_base.sh").read_text())
    return int(uid)


def containers(template: dict) -> list[dict]:
    return template["spec"].get("initContainers", []) + template["spec"]["containers"]


# -- the public API's token ------------------------------------------------------------------------------------------
def token_problems(service: dict) -> list[str]:
    problems = []
    for group, template in pod_templates(service).items():
        ray = template["spec"]["containers"][0]
        ref = env(ray).get("SPECDEC_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            problems.append(f"{group}: no SPECDEC_AUTH_TOKEN from a Secret")
        elif (ref["name"], ref["key"]) != ("specdec-api-token", "token"):
            problems.append(f"{group}: SPECDEC_AUTH_TOKEN from {ref['name']}/{ref['key']}")
        elif ref.get("optional", False):
            problems.append(f"{group}: SPECDEC_AUTH_TOKEN optional: pods would serve without auth")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_container_requires_the_api_token(overlay):
    assert token_problems(one(render(overlay), "RayService")) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_configs_leave_auth_on(overlay):
    import yaml

    from deployments.serve_config import parse_config

    service = one(render(overlay), "RayService")
    [app] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert parse_config(app["args"]).auth == "bearer"


# -- securityContext -------------------------------------------------------------------------------------------------
def security_problems(service: dict) -> list[str]:
    problems = []
    for group, template in pod_templates(service).items():
        pod = template["spec"].get("securityContext", {})
        want = {"runAsNonRoot": True, "runAsUser": image_uid(), "runAsGroup": image_uid(), "fsGroup": image_uid()}
        problems += [f"{group}: pod {k}={pod.get(k)!r}" for k, v in want.items() if pod.get(k) != v]
        for container in containers(template):
            security = container.get("securityContext", {})
            problems += [
                f"{group}/{container['name']}: {k}={security.get(k)!r}"
                for k, v in CONTAINER_SECURITY.items()
                if security.get(k) != v
            ]
    autoscaler = service["spec"]["rayClusterConfig"]["autoscalerOptions"].get("securityContext", {})
    problems += [f"autoscaler: {k}" for k, v in CONTAINER_SECURITY.items() if autoscaler.get(k) != v]
    return problems


def writable_paths_problems(template: dict) -> list[str]:
    """With a read-only root, /tmp (Ray's session directory, mktemp, gcc) must be an emptyDir in every container."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    problems = []
    for container in containers(template):
        mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
        if "/tmp" not in mounts or "emptyDir" not in volumes[mounts["/tmp"]["name"]]:
            problems.append(f"{container['name']}: no emptyDir at /tmp")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_as_the_image_user_without_privilege(overlay):
    service = one(render(overlay), "RayService")
    assert security_problems(service) == []
    for group, template in pod_templates(service).items():
        assert writable_paths_problems(template) == [], group


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda t: t["spec"]["containers"][0]["securityContext"].pop("capabilities"), "capabilities"),
        (lambda t: t["spec"]["initContainers"][0].pop("securityContext"), "pull-models: runAsNonRoot"),
        (lambda t: t["spec"]["securityContext"].update(runAsUser=0), "runAsUser=0"),
    ],
)
def test_the_security_check_catches_a_container_left_out(change, problem):
    service = one(render("cpu-dev"), "RayService")
    template = pod_templates(service)["draft"]
    change(template)
    assert problem in " ".join(security_problems(service))


# -- the models volume and the service-account token ----------------------------------------------------------------
def models_problems(template: dict) -> list[str]:
    """A container other than the pull's that may write the models volume (every process there would load it)."""
    claims = {
        v["name"] for v in template["spec"].get("volumes", []) if v.get("persistentVolumeClaim", {}).get("claimName")
    }
    problems = []
    writers = {c["name"] for c in template["spec"].get("initContainers", [])} & MODELS_WRITERS
    for container in containers(template):
        for mount in container.get("volumeMounts", []):
            if mount["name"] in claims and not mount.get("readOnly", False) and container["name"] not in writers:
                problems.append(f"{container['name']} mounts {mount['mountPath']} read-write")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_pull_init_containers_write_the_models_volume(overlay):
    for group, template in pod_templates(one(render(overlay), "RayService")).items():
        assert models_problems(template) == [], group
        ray = template["spec"]["containers"][0]
        assert any(m["mountPath"] == "/models" and m["readOnly"] for m in ray["volumeMounts"]), group


def test_the_models_check_catches_a_serving_container_that_writes():
    template = pod_templates(one(render("cpu-dev"), "RayService"))["target"]
    mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/models")
    mount["readOnly"] = False
    assert models_problems(template) == ["ray-worker mounts /models read-write"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_head_holds_a_service_account_token(overlay):
    templates = pod_templates(one(render(overlay), "RayService"))
    assert templates.pop("head")["spec"]["automountServiceAccountToken"] is True  # KubeRay's autoscaler sidecar
    assert {g: t["spec"].get("automountServiceAccountToken") for g, t in templates.items()} == dict.fromkeys(
        templates, False
    )


# -- the NetworkPolicy -----------------------------------------------------------------------------------------------
def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels; matchExpressions In, NotIn, Exists, DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests = {
        "In": lambda e: labels.get(e["key"]) in e["values"],
        "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
        "Exists": lambda e: e["key"] in labels,
        "DoesNotExist": lambda e: e["key"] not in labels,
    }
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def peer_matches(peer: dict, caller: dict) -> bool:
    """One `from` entry against a caller: {"namespace": labels or None (this namespace), "labels": pod labels}."""
    if "ipBlock" in peer:
        return caller.get("external", False)
    if caller.get("external"):
        return False
    if "namespaceSelector" in peer:
        namespace = caller["namespace"] or {"kubernetes.io/metadata.name": "specdec"}
        if not selects(peer["namespaceSelector"], namespace):
            return False
    elif caller["namespace"] is not None:
        return False  # a podSelector alone selects pods of the policy's own namespace
    return selects(peer.get("podSelector", {}), caller["labels"])


def admitted(docs: list[dict], pod_labels: dict, port: int, caller: dict) -> bool:
    """Whether the NetworkPolicies let `caller` reach `port` on a pod with `pod_labels` (no policy: everything)."""
    policies = [
        p["spec"]
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and "Ingress" in p["spec"]["policyTypes"]
        and selects(p["spec"]["podSelector"], pod_labels)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy.get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") == port for p in ports):
                continue
            if "from" not in rule or any(peer_matches(peer, caller) for peer in rule["from"]):
                return True
    return False


OUTSIDER = {"namespace": {"kubernetes.io/metadata.name": "default"}, "labels": {"app": "curl"}}
INTERNET = {"external": True, "namespace": None, "labels": {}}
MONITORING = {"namespace": {"kubernetes.io/metadata.name": "monitoring"}, "labels": {"app": "prometheus"}}


def pod_labels(template: dict, node_type: str) -> dict:
    return {**template["metadata"]["labels"], **KUBERAY_LABELS, "ray.io/node-type": node_type}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_admits_the_api_and_ray_and_keeps_metrics_for_monitoring(overlay):
    docs = render(overlay)
    templates = pod_templates(one(docs, "RayService"))
    assert any(d["kind"] == "NetworkPolicy" for d in docs)
    for group, template in templates.items():
        labels = pod_labels(template, "head" if group == "head" else "worker")
        own = {"namespace": None, "labels": pod_labels(templates["target"], "worker")}
        for caller in (OUTSIDER, INTERNET, own):
            assert admitted(docs, labels, 8000, caller) and admitted(docs, labels, 9000, caller), (group, caller)
        assert admitted(docs, labels, 8080, MONITORING), group
        for caller in (OUTSIDER, INTERNET):
            for port in (8080, 6379, 8265, 10001):  # metrics, GCS, dashboard, Ray client
                assert not admitted(docs, labels, port, caller), (group, port, caller)
        assert admitted(docs, labels, 6379, own) and admitted(docs, labels, 52000, own), group


PRIVATE = {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_gives_no_egress_beyond_the_cluster_but_https_out_and_the_heads_api(overlay):
    """Beyond the cluster's pods, DNS and the collector: HTTPS to public addresses only (the init containers'
    model pull), and the head's calls to the Kubernetes API."""
    for policy in (d for d in render(overlay) if d["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        for rule in spec.get("egress", []):
            if "to" not in rule:
                assert spec["podSelector"]["matchLabels"].get("ray.io/node-type") == "head", policy["metadata"]
                assert {p["port"] for p in rule["ports"]} <= {443, 6443}, policy["metadata"]
            elif any("ipBlock" in peer for peer in rule["to"]):
                assert {p["port"] for p in rule["ports"]} == {443}, policy["metadata"]
                for peer in rule["to"]:
                    assert PRIVATE <= set(peer["ipBlock"].get("except", [])), policy["metadata"]


def test_the_network_policy_check_catches_metrics_open_to_all():
    docs = render("cpu-dev")
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and "ingress" in d["spec"])
    policy["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 8080}]})
    labels = pod_labels(pod_templates(one(docs, "RayService"))["head"], "head")
    assert admitted(docs, labels, 8080, OUTSIDER)
