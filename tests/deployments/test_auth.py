"""The public API's auth is on unless a config says `auth: none`: a router with no token does not start, an open
one says so in its log, and the shipped configs say which they are."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import deployments
from deployments.auth import Unauthenticated, cache_namespace, public_auth
from deployments.router_wiring import connect_router
from deployments.serve_config import load_config, parse_config
from specdec_core import environment
from specdec_core.errors import InvalidArgument

CONFIGS = Path(deployments.__file__).parent / "configs"
MODELS = {"target": {"model": "m"}}


@pytest.fixture(autouse=True)
def no_token_in_the_environment(monkeypatch):
    monkeypatch.delenv(environment.AUTH_TOKEN, raising=False)


def test_auth_is_bearer_unless_the_config_says_none():
    assert parse_config(MODELS).auth == "bearer"
    assert parse_config({**MODELS, "auth": "none"}).auth == "none"
    with pytest.raises(InvalidArgument, match="auth"):
        parse_config({**MODELS, "auth": "off"})


def test_a_token_file_with_auth_none_is_a_contradiction():
    with pytest.raises(InvalidArgument, match="auth_token_file and auth_tokens_file need auth: bearer"):
        parse_config({**MODELS, "auth": "none", "auth_token_file": "/run/secrets/token"})


def test_bearer_without_a_token_refuses_naming_every_way_to_give_one():
    with pytest.raises(InvalidArgument) as info:
        public_auth("bearer", None)
    message = str(info.value)
    for way in ("SPECDEC_AUTH_TOKEN", "specdec-api-token", "auth_token_file", "auth: none"):
        assert way in message


def test_the_router_refuses_to_start_without_a_token_before_anything_else():
    with pytest.raises(InvalidArgument, match="SPECDEC_AUTH_TOKEN"):
        connect_router(parse_config(MODELS).model_dump(mode="json"))  # no Ray here: it fails first


@pytest.mark.parametrize("source", ["environment", "file"])
def test_bearer_with_a_token_checks_it(source, monkeypatch, tmp_path):
    token_file = None
    if source == "environment":
        monkeypatch.setenv(environment.AUTH_TOKEN, "s3cret")
    else:
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
    auth = public_auth("bearer", None if token_file is None else str(token_file))
    assert auth.enabled
    auth.check([("authorization", "Bearer s3cret")])
    with pytest.raises(Unauthenticated):
        auth.check([])


def test_auth_none_serves_open_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.auth"):
        auth = public_auth("none", None)
    assert not auth.enabled
    auth.check([])
    assert any(r.levelno == logging.WARNING and "without a token" in r.getMessage() for r in caplog.records)


def test_auth_none_with_a_token_in_the_environment_still_checks_it(monkeypatch, caplog):
    monkeypatch.setenv(environment.AUTH_TOKEN, "s3cret")
    with caplog.at_level(logging.WARNING, logger="deployments.auth"):
        auth = public_auth("none", None)
    with pytest.raises(Unauthenticated):
        auth.check([])
    assert any("SPECDEC_AUTH_TOKEN is set" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_open_the_api_only_on_a_machine_of_ones_own(path):
    """The CPU configs are local demos and say `auth: none` out loud; the GPU layout, meant for shared machines,
    keeps the default and needs a token."""
    import yaml

    data = yaml.safe_load(path.read_text())
    args = data["applications"][0]["args"] if "applications" in data else data
    config = parse_config(args) if "applications" in data else load_config(path)
    assert config.auth == ("bearer" if path.name == "gpu.yaml" else "none")


def test_each_tenants_token_names_its_tenant_and_no_other_token_passes(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("alice: alice-token\nbob: bob-token\n")
    auth = public_auth("bearer", None, str(tokens))
    assert auth.check([("authorization", "Bearer alice-token")]) == "alice"
    assert auth.check([("authorization", "Bearer bob-token")]) == "bob"
    with pytest.raises(Unauthenticated):
        auth.check([("authorization", "Bearer carol-token")])


@pytest.mark.parametrize(
    "text", ["alice: same\nbob: same\n", "alice: ''\n", "- alice-token\n", ""], ids=["shared", "empty", "list", "none"]
)
def test_a_tokens_file_that_does_not_name_one_token_per_tenant_is_refused(tmp_path, text):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(text)
    with pytest.raises(InvalidArgument) as refused:
        public_auth("bearer", None, str(tokens))
    assert refused.value.field == "auth_tokens_file"


def test_cache_namespaces_are_per_tenant_and_salt_and_of_one_length():
    names = {cache_namespace(t, s) for t in ("alice", "bob") for s in (None, "x", "y")}
    assert len(names) == 6 and len({len(n) for n in names}) == 1
    assert cache_namespace(None, "x") == "x" and cache_namespace(None, None) is None
    assert cache_namespace("a:b", None) != cache_namespace("a", "b:")  # no two (tenant, salt) pairs collide
