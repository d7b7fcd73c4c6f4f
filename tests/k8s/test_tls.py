"""TLS in the manifests. The public Gateway in front of Serve (k8s/components/tls-gateway) and Ray's own mutual TLS in
the gpu overlay (k8s/overlays/gpu/ray-tls-*.yaml) are checked by structure: what references what, by name and port.
The per-pod certificate that the gpu overlay's init container signs is checked by running the init container's own
script, then a gRPC handshake set up the way Ray sets up its channels. None of this needs ../shared/k8s-schemas."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent import futures
from pathlib import Path, PurePosixPath

import grpc
import kubernetes_validate
import pytest
import yaml

from tests.k8s.manifests import ROOT, env, one, pod_templates, render, render_with, volume_at

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="renders overlays with `kubectl kustomize`")

GATEWAY_OVERLAY = "gpu-tls-gateway"
TLS_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


# --- The public Gateway ---------------------------------------------------------------------------------------------
def test_every_listener_terminates_tls_with_a_secret_that_cert_manager_keeps():
    docs = render(GATEWAY_OVERLAY)
    listeners = one(docs, "Gateway")["spec"]["listeners"]
    certificates = {c["spec"]["secretName"]: c for c in docs if c["kind"] == "Certificate"}
    assert len({listener["hostname"] for listener in listeners}) == len(listeners) >= 2  # one per protocol
    for listener in listeners:
        assert listener["protocol"] == "HTTPS" and listener["port"] == 443
        assert listener["tls"]["mode"] == "Terminate"
        assert listener["tls"]["certificateRefs"], listener["name"]
        for ref in listener["tls"]["certificateRefs"]:
            assert ref.get("kind", "Secret") == "Secret" and ref.get("group", "") == "" and "namespace" not in ref
            certificate = certificates[ref["name"]]["spec"]  # KeyError: no Certificate makes this Secret
            assert not certificate.get("isCA")
            assert listener["hostname"] in certificate["dnsNames"]  # what clients check


@pytest.mark.parametrize(
    ("kind", "port_name", "serve_option"),
    [
        ("GRPCRoute", "serve-grpc", "grpc_options"),
        ("HTTPRoute", "serve", "http_options"),
    ],
)
def test_routes_attach_to_their_own_listener_and_reach_the_serve_service(kind, port_name, serve_option):
    docs = render(GATEWAY_OVERLAY)
    gateway, route, service = one(docs, "Gateway"), one(docs, kind), one(docs, "RayService")
    listeners = {listener["name"]: listener for listener in gateway["spec"]["listeners"]}
    for parent in route["spec"]["parentRefs"]:
        assert parent.get("kind", "Gateway") == "Gateway" and parent["name"] == gateway["metadata"]["name"]
        admitted = listeners[parent["sectionName"]]["allowedRoutes"]["kinds"]
        assert admitted == [{"group": "gateway.networking.k8s.io", "kind": kind}]
    # KubeRay makes the Serve service from spec.serveService, with the head container's ports of the same names.
    serve_service = service["spec"]["serveService"]
    port = {p["name"]: p for p in serve_service["spec"]["ports"]}[port_name]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": port_name, "containerPort": port["targetPort"]} in head["ports"]
    assert port["targetPort"] == yaml.safe_load(service["spec"]["serveConfigV2"])[serve_option]["port"]
    backends = [backend for rule in route["spec"]["rules"] for backend in rule["backendRefs"]]
    assert backends
    for backend in backends:
        assert backend.get("kind", "Service") == "Service" and backend.get("group", "") == ""
        assert (backend["name"], backend["port"]) == (serve_service["metadata"]["name"], port["port"])
    if kind == "GRPCRoute":
        assert port["appProtocol"] == "kubernetes.io/h2c"  # the Gateway speaks HTTP/2 to the backend


def test_only_the_public_api_is_routed():
    docs = render(GATEWAY_OVERLAY)
    proto = (ROOT / "proto" / "specdec" / "v1" / "generation.proto").read_text()
    public = re.search(r"^package (\S+);", proto, re.M)[1] + "." + re.search(r"^service (\w+)", proto, re.M)[1]
    grpc_matches = [m for rule in one(docs, "GRPCRoute")["spec"]["rules"] for m in rule["matches"]]
    http_matches = [m for rule in one(docs, "HTTPRoute")["spec"]["rules"] for m in rule["matches"]]
    assert grpc_matches and all(m["method"] == {"type": "Exact", "service": public} for m in grpc_matches)
    assert http_matches and all(m["path"] == {"type": "PathPrefix", "value": "/v1"} for m in http_matches)


# --- Ray's own TLS (gpu overlay) ------------------------------------------------------------------------------------
def ca_secrets(docs: list[dict]) -> set[str]:
    return {c["spec"]["secretName"] for c in docs if c["kind"] == "Certificate" and c["spec"].get("isCA")}


def ray_tls_problems(docs: list[dict]) -> list[str]:
    """What keeps a Ray process of this render from mutual TLS under a cert-manager CA, or shows it the CA's key."""
    service, cas, problems = one(docs, "RayService"), ca_secrets(docs), []
    for group, template in pod_templates(service).items():
        ray = template["spec"]["containers"][0]
        variables = env(ray)
        if variables.get("RAY_USE_TLS", {}).get("value") != "1":
            problems.append(f"{group}: RAY_USE_TLS is not 1")
        if any(name not in variables for name in TLS_FILES):
            problems.append(f"{group}: missing {[name for name in TLS_FILES if name not in variables]}")
            continue
        for mount in ray.get("volumeMounts", []):
            volume = volume_at(template, ray, mount["mountPath"])[1]
            if volume.get("secret", {}).get("secretName") in cas and any(
                item["key"] != "ca.crt" for item in volume["secret"].get("items", [{"key": "all"}])
            ):
                problems.append(f"{group}: the Ray container can read the CA's key ({mount['mountPath']})")
        ca_path = variables["RAY_TLS_CA_CERT"]["value"]
        secret = (volume_at(template, ray, ca_path) or ({}, {}))[1].get("secret", {})
        if secret.get("secretName") not in cas or {
            "key": "ca.crt",
            "path": PurePosixPath(ca_path).name,
        } not in secret.get("items", []):
            problems.append(f"{group}: {ca_path} is not ca.crt of the CA's Secret")
        pair = [volume_at(template, ray, variables[name]["value"]) for name in TLS_FILES[:2]]
        if None in pair or pair[0][1] != pair[1][1] or pair[0][1].get("emptyDir", {}).get("medium") != "Memory":
            problems.append(f"{group}: the node's key and certificate are not in one memory-backed emptyDir")
            continue
        if not pair[0][0].get("readOnly"):
            problems.append(f"{group}: the Ray container can rewrite its certificate")
        problems += signer_problems(group, template, pair[0][0], cas)
    return problems + autoscaler_problems(service)


def autoscaler_problems(service: dict) -> list[str]:
    """The autoscaler sidecar (KubeRay adds it to the head pod) talks to the GCS: it needs the head's TLS too."""
    autoscaler = service["spec"]["rayClusterConfig"]["autoscalerOptions"]
    head = pod_templates(service)["head"]["spec"]["containers"][0]
    tls_env = [e for e in head["env"] if e["name"] in ("RAY_USE_TLS", *TLS_FILES)]
    tls_mounts = [m for m in head["volumeMounts"] if m in autoscaler.get("volumeMounts", [])]
    if not tls_env or any(e not in autoscaler.get("env", []) for e in tls_env) or len(tls_mounts) != 2:
        return ["the autoscaler sidecar does not run with the head's TLS settings and files"]
    return []


def signer_problems(group: str, template: dict, node_mount: dict, cas: set[str]) -> list[str]:
    """The init container that writes the node's pair: exactly one, into the Ray container's directory, from the CA."""
    writers = [
        c
        for c in template["spec"].get("initContainers", [])
        for m in c.get("volumeMounts", [])
        if m["name"] == node_mount["name"] and not m.get("readOnly")
    ]
    if len(writers) != 1:
        return [f"{group}: {len(writers)} init containers write the node's certificate"]
    [signer] = writers
    variables = {name: e.get("value") for name, e in env(signer).items()}
    signing = volume_at(template, signer, variables.get("RAY_TLS_SIGNER_DIR") or "/nowhere")
    problems = []
    if variables.get("RAY_TLS_DIR") != node_mount["mountPath"]:
        problems.append(f"{group}: the signer writes elsewhere than the Ray container reads")
    if signing is None or signing[1].get("secret", {}).get("secretName") not in cas:
        problems.append(f"{group}: the signer does not sign with the cert-manager CA")
    if {"POD_IP", "RAY_NODE_TYPE"} - {name for name, e in env(signer).items() if "valueFrom" in e}:
        problems.append(f"{group}: the signer does not know its pod's IP and node type")
    return problems


@pytest.mark.parametrize("overlay", ["gpu", GATEWAY_OVERLAY])
def test_every_ray_process_runs_mutual_tls_under_the_cert_manager_ca(overlay):
    assert ray_tls_problems(render(overlay)) == []


def test_the_ray_ca_is_a_self_signed_cert_manager_ca_that_keeps_its_key_on_renewal():
    docs = render("gpu")
    [ca] = [c for c in docs if c["kind"] == "Certificate" and c["spec"].get("isCA")]
    issuer = one(docs, "Issuer", ca["spec"]["issuerRef"]["name"])
    assert ca["spec"]["issuerRef"]["kind"] == "Issuer" and issuer["spec"] == {"selfSigned": {}}
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"  # running pods' certificates outlive a renewal


def _drop_env(docs, group, name):
    container = pod_templates(one(docs, "RayService"))[group]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != name]


def _whole_ca_secret(docs, group):
    for volume in pod_templates(one(docs, "RayService"))[group]["spec"]["volumes"]:
        volume.get("secret", {}).pop("items", None)


def _writable_certificate(docs, group):
    for mount in pod_templates(one(docs, "RayService"))[group]["spec"]["containers"][0]["volumeMounts"]:
        mount.pop("readOnly", None)


def _no_autoscaler_tls(docs, group):
    one(docs, "RayService")["spec"]["rayClusterConfig"]["autoscalerOptions"].pop("env")


def _no_signer(docs, group):
    template = pod_templates(one(docs, "RayService"))[group]
    template["spec"]["initContainers"] = [c for c in template["spec"]["initContainers"] if c["name"] != "ray-tls-cert"]


@pytest.mark.parametrize(
    ("breakage", "group", "problem"),
    [
        (lambda docs, group: _drop_env(docs, group, "RAY_USE_TLS"), "draft", "draft: RAY_USE_TLS"),
        (lambda docs, group: _drop_env(docs, group, "RAY_TLS_CA_CERT"), "target", "target: missing"),
        (_whole_ca_secret, "target", "target: the Ray container can read the CA's key"),
        (_writable_certificate, "head", "head: the Ray container can rewrite"),
        (_no_autoscaler_tls, "head", "autoscaler"),
        (_no_signer, "draft", "draft: 0 init containers"),
    ],
)
def test_the_ray_tls_check_catches_a_gap(breakage, group, problem):
    docs = render("gpu")
    breakage(docs, group)
    assert problem in " | ".join(ray_tls_problems(docs))


def test_the_cpu_dev_overlay_runs_ray_without_tls():
    assert not any(
        "RAY_USE_TLS" in env(t["spec"]["containers"][0])
        for t in pod_templates(one(render("cpu-dev"), "RayService")).values()
    )


def test_the_optional_internal_tls_component_mounts_its_secret_on_every_ray_container(tmp_path):
    docs = render_with(tmp_path, "gpu", "internal-tls")
    for group, template in pod_templates(one(docs, "RayService")).items():
        ray = template["spec"]["containers"][0]
        mount, volume = volume_at(template, ray, "/etc/specdec/internal-tls/ca.crt")
        assert mount["readOnly"] and volume["secret"]["secretName"] == "specdec-internal-tls", group
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, "1.32", strict=True)
    assert ray_tls_problems(docs) == []
    plain = pod_templates(one(render("gpu"), "RayService"))
    assert not any(v["name"] == "internal-tls" for t in plain.values() for v in t["spec"]["volumes"])  # optional


# --- The init container's certificate, used as Ray uses it ----------------------------------------------------------
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the init container's script runs openssl")
HEAD_SERVICE = "specdec-raycluster-x7k2p-head-svc.default.svc.cluster.local"  # what KubeRay puts in FQ_RAY_IP


def openssl(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(["openssl", *args], capture_output=True, text=True, check=True, cwd=cwd).stdout


def make_ca(directory: Path, name: str) -> Path:
    """A CA's Secret as cert-manager writes it for an isCA Certificate: tls.crt, tls.key and ca.crt."""
    directory.mkdir()
    openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        "tls.key",
        "-out",
        "tls.crt",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )
    shutil.copy(directory / "tls.crt", directory / "ca.crt")
    return directory


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> Path:
    return make_ca(tmp_path_factory.mktemp("ray-ca") / "secret", "test Ray CA")


def sign(ca: Path, out: Path, node_type: str, pod_ip: str) -> Path:
    """Run the gpu overlay's ray-tls-cert init container (its command, as rendered) with the env the pod gives it."""
    head = pod_templates(one(render("gpu"), "RayService"))["head"]
    init = next(c for c in head["spec"]["initContainers"] if c["name"] == "ray-tls-cert")
    given = {
        "POD_IP": pod_ip,
        "POD_NAME": f"pod-{pod_ip}",
        "RAY_NODE_TYPE": node_type,
        "RAY_TLS_DIR": str(out),
        "RAY_TLS_SIGNER_DIR": str(ca),
    }
    assert set(given) == set(env(init))  # the test stands in for exactly what the pod sets
    out.mkdir()
    subprocess.run(
        init["command"] + init["args"],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "FQ_RAY_IP": HEAD_SERVICE, **given},
    )  # FQ_RAY_IP: from KubeRay
    return out


def names(certificate: Path) -> set[str]:
    line = openssl("x509", "-in", str(certificate), "-noout", "-ext", "subjectAltName").splitlines()[1]
    return {name.strip() for name in line.split(",")}


@needs_openssl
@pytest.mark.parametrize(("node_type", "extra"), [("head", {f"DNS:{HEAD_SERVICE}"}), ("worker", set())])
def test_the_init_container_signs_a_certificate_for_its_own_pod(ca, tmp_path, node_type, extra):
    node = sign(ca, tmp_path / "tls", node_type, "10.4.0.17")
    assert names(node / "tls.crt") == {"DNS:localhost", "IP Address:127.0.0.1", "IP Address:10.4.0.17"} | extra
    assert openssl("verify", "-CAfile", str(ca / "ca.crt"), str(node / "tls.crt")).strip().endswith("OK")
    usage = openssl("x509", "-in", str(node / "tls.crt"), "-noout", "-ext", "extendedKeyUsage")
    assert "TLS Web Server Authentication" in usage and "TLS Web Client Authentication" in usage  # both ends of mTLS
    assert (node / "tls.key").stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in node.iterdir()) == ["tls.crt", "tls.key"]  # no CSR or config left behind


@needs_openssl
def test_the_init_container_fails_the_pod_without_its_node_type(ca, tmp_path):
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero"):
        sign(ca, tmp_path / "tls", "", "10.4.0.17")


def serve_tls(address: str, node: Path, ca: Path) -> tuple[grpc.Server, int]:
    """A gRPC server with the credentials Ray's servers build from RAY_TLS_* (client certificates required)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    credentials = grpc.ssl_server_credentials(
        [((node / "tls.key").read_bytes(), (node / "tls.crt").read_bytes())],
        root_certificates=(ca / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port(f"{address}:0", credentials)
    server.start()
    return server, port


def handshake(address: str, port: int, node: Path, ca: Path) -> grpc.StatusCode:
    """One call over a channel built as Ray builds its own: UNIMPLEMENTED means TLS went through both ways."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(ca / "ca.crt").read_bytes(),
        private_key=(node / "tls.key").read_bytes(),
        certificate_chain=(node / "tls.crt").read_bytes(),
    )
    with grpc.secure_channel(f"{address}:{port}", credentials) as channel:
        try:
            channel.unary_unary("/probe.Probe/Call")(b"", timeout=5)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@needs_openssl
def test_ray_nodes_complete_mutual_tls_at_their_own_ip_and_only_there(ca, tmp_path):
    head = sign(ca, tmp_path / "head", "head", "127.0.0.2")
    worker = sign(ca, tmp_path / "worker", "worker", "127.0.0.3")
    stranger = sign(make_ca(tmp_path / "other-ca", "another CA"), tmp_path / "stranger", "worker", "127.0.0.5")
    at_own_ip, port = serve_tls("127.0.0.2", head, ca)
    # The same certificate at an address it does not name: what one certificate shared by all pods would meet.
    elsewhere, other_port = serve_tls("127.0.0.4", head, ca)
    try:
        assert handshake("127.0.0.2", port, worker, ca) == grpc.StatusCode.UNIMPLEMENTED
        assert handshake("127.0.0.4", other_port, worker, ca) == grpc.StatusCode.UNAVAILABLE
        assert handshake("127.0.0.2", port, stranger, ca) == grpc.StatusCode.UNAVAILABLE  # mutual: no foreign nodes
    finally:
        at_own_ip.stop(None)
        elsewhere.stop(None)
