"""A real Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`: a head and worker nodes, each
with its own raylet and object store), and the application spread over it as an operator would place it on
separate machines: each node started with a custom resource that names its role, each deployment asking for its
role's resource, the tensor-parallel target's two ranks on two nodes (`placement_strategy: STRICT_SPREAD`) talking
gloo over a named interface.

These tests run apart from the suite (`make test-cluster`): the suite keeps one Ray cluster per pytest session, so
every test under this directory is marked `cluster`, which pyproject's addopts deselect by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

HERE = Path(__file__).resolve().parent
APP = "specdec-nodes"

# What each kind of node offers: its CPUs, and one custom resource naming its role (`ray start --resources`).
# A target node could hold both ranks of a replica (2 CPUs, target_node 2): only STRICT_SPREAD sets them apart.
# The router's replica fits on a worker node too (0.5 CPU): only its resource keeps it on the head.
ROLES: dict[str, dict[str, Any]] = {
    "head": {"num_cpus": 2, "resources": {"router_node": 1}},
    "draft": {"num_cpus": 1, "resources": {"draft_node": 1}},
    "target": {"num_cpus": 2, "resources": {"target_node": 2}},
}
RPC_TIMEOUT_S = 60.0  # router.rpc_timeout_s: a call to a target worker, and its ranks' collectives


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.cluster)


@dataclass
class Stack:
    """The cluster, its nodes by role (node id -> Ray's node object), and the application served on it."""

    cluster: Any
    head_id: str
    address: str  # the public gRPC API (Serve's proxy on the head)
    config: Any
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_node(self, role: str) -> str:
        """Start a node of `role` (as `ray start --address ... --resources ...` would); returns its node id."""
        node = self.cluster.add_node(**ROLES[role])
        self.nodes.setdefault(role, {})[node.node_id] = node
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        """Take a node away at once, as a machine that fails does: its raylet and every process on it killed."""
        for nodes in self.nodes.values():
            if node_id in nodes:
                self.cluster.remove_node(nodes.pop(node_id), allow_graceful=False)
                return
        raise AssertionError(f"no worker node {node_id} in the cluster")


@pytest.fixture(scope="session")
def stack(tiny_dir, near_draft_dir):
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments import worker_registry as registry
    from deployments.app import build_app, limit_public_messages
    from deployments.launch import start_serve
    from deployments.serve_config import parse_config
    from tests.conftest import free_port

    limit_public_messages()  # the proxies started below inherit it
    cluster = Cluster(initialize_head=True, head_node_args=ROLES["head"])
    config = parse_config(
        {
            "auth": "none",  # a test stack on this machine; tests/deployments/test_reliability.py checks the token
            "app_name": APP,
            "grpc_port": free_port(),
            "http_port": free_port(),
            # One machine: proxies on every node would all want the same ports.
            "proxy_location": "HeadOnly",
            "target": {
                "model": str(tiny_dir / "target"),
                "dtype": "float32",
                "num_cpus": 1,
                "threads": 1,
                "max_sequences": 4,
                "tensor_parallel_size": 2,
                "placement_strategy": "STRICT_SPREAD",
                "resources": {"target_node": 1},
                "socket_ifname": "lo",
            },
            "draft": {
                "method": "draft_model",
                "model": str(near_draft_dir),
                "dtype": "float32",
                "num_cpus": 1,
                "threads": 1,
                "max_sequences": 4,
                "num_speculative_tokens": 3,
                "resources": {"draft_node": 1},
            },
            "router": {
                "num_cpus": 0.5,
                "resources": {"router_node": 1},
                "max_seq_len": 512,
                "default_max_tokens": 16,
                "rpc_timeout_s": RPC_TIMEOUT_S,
                "draft_timeout_s": 2,
                "worker_refresh_s": 1,
                "calibrate": False,
            },
        }
    )
    stack = Stack(cluster, cluster.head_node.node_id, f"127.0.0.1:{config.grpc_port}", config)
    try:
        for role in ("draft", "target", "target"):
            stack.add_node(role)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        start_serve(config, host="127.0.0.1")
        serve.run(build_app(config), name=APP, route_prefix="/")
        yield stack
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
                registry.shutdown()
                ray.shutdown()
        finally:
            cluster.shutdown()


@pytest.fixture(scope="session")
def generation(stack):
    """A GenerationService stub on the cluster's public gRPC port."""
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(stack.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)
