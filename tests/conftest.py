"""Shared fixtures: tiny random-weight models built locally (no test downloads anything), and the one Ray cluster
and served stack of the session, which tests of the service and of its clients (specdec_tools) both use."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec_core.models.loader import LoadedModel, load_model
from specdec_core.models.tiny import build_tiny_model, build_tiny_tokenizer

# Fixtures that start the session's Ray cluster (`served` and every application fixture stand on `ray_cluster`):
# a test that needs one, directly or through another fixture, is marked `serve`, which `make test-fast` leaves out.
RAY_FIXTURES = frozenset({"ray_cluster"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serve)


def free_port() -> int:
    from deployments.ports import free_port as find

    return find()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A directory holding a shared tokenizer and several tiny models built from it."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_tokenizer(root / "tokenizer")
    build_tiny_model(root / "target", family="qwen2", seed=1, tokenizer_dir=root / "tokenizer", vocab_size=400)
    build_tiny_model(
        root / "draft",
        family="qwen2",
        seed=2,
        tokenizer_dir=root / "tokenizer",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=384,
    )
    build_tiny_model(root / "llama", family="llama", seed=3, tokenizer_dir=root / "tokenizer")
    return root


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> LoadedModel:
    return load_model(tiny_dir / "target", dtype="float32")


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir) -> LoadedModel:
    return load_model(tiny_dir / "draft", dtype="float32")


@pytest.fixture(scope="session")
def near_draft_dir(tiny_dir) -> Path:
    """The tiny target with noise on its weights: greedy drafts right often enough to exercise acceptance."""
    out = tiny_dir / "near_draft"
    if not out.exists():
        shutil.copytree(tiny_dir / "target", out)
        gen = torch.Generator().manual_seed(7)
        for file in out.glob("*.safetensors"):
            state = load_file(file)
            noisy = {
                k: (v + torch.randn(v.shape, generator=gen) * 0.05 * v.float().std().clamp(min=1e-3)).to(v.dtype)
                for k, v in state.items()
            }
            save_file(noisy, file, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def pair(tiny_dir, near_draft_dir):
    """The tiny target and its near draft, loaded (float32)."""
    from specdec_core.models.loader import load_model

    return load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")


@pytest.fixture(scope="session")
def ray_cluster():
    """The one local Ray cluster of the test session."""
    ray = pytest.importorskip("ray")
    from deployments import worker_registry as registry
    from deployments.app import limit_public_messages

    limit_public_messages()  # as `specdec serve` does: the proxies started below inherit it

    # address="local": a cluster of its own, even where another runs on this machine (a `ray start` of a developer)
    ray.init(address="local", num_cpus=10, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        from ray import serve

        serve.shutdown()
        registry.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def served(ray_cluster, tiny_dir, near_draft_dir):
    """The whole stack on the session's Ray cluster: Serve's gRPC proxy, the router, one target worker and two
    draft replicas, tiny models. Yields (address, config)."""
    from ray import serve

    from deployments.app import build_app, grpc_options
    from deployments.serve_config import parse_config

    config = parse_config(
        {
            "auth": "none",  # a test stack on this machine; tests/deployments/test_reliability.py checks the token
            "grpc_port": free_port(),
            "http_port": free_port(),
            "target": {
                "model": str(tiny_dir / "target"),
                "dtype": "float32",
                "num_cpus": 1,
                "threads": 1,
                "max_sequences": 8,
            },
            "draft": {
                "method": "draft_model",
                "model": str(near_draft_dir),
                "dtype": "float32",
                "num_speculative_tokens": 3,
                "num_cpus": 1,
                "threads": 1,
                "num_replicas": 2,
                "max_sequences": 8,
            },
            "router": {"max_seq_len": 256, "default_max_tokens": 16, "num_cpus": 0.5},
        }
    )
    serve.start(http_options={"host": "127.0.0.1", "port": config.http_port}, grpc_options=grpc_options(config))
    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    yield f"127.0.0.1:{config.grpc_port}", config
