"""The registry actor hands out each application's internal credentials through Ray: one CA per application,
the setting its workers and routers gave, to tools that know only the application's name."""

from __future__ import annotations

import logging

import pytest
from cryptography import x509

from deployments.tls import SERVER_NAME, Role, TlsSetting
from tests.helpers import operator_tls_dir


def _issuer(bundle):
    return x509.load_pem_x509_certificate(bundle.cert).issuer


def test_each_application_gets_its_own_ca_and_both_ends_share_it(ray_cluster):
    from deployments import worker_registry

    server = worker_registry.credentials("reg-a", Role.SERVER, TlsSetting())
    client = worker_registry.credentials("reg-a", Role.CLIENT)  # a tool: the setting the application gave
    other = worker_registry.credentials("reg-b", Role.CLIENT, TlsSetting())
    assert server.tls.ca == client.tls.ca != other.tls.ca
    assert _issuer(server.tls) == _issuer(client.tls) == x509.load_pem_x509_certificate(server.tls.ca).subject
    assert server.tls.cert != client.tls.cert and server.tls.key != client.tls.key
    assert client.tls.server_name == SERVER_NAME
    assert server.secret == client.secret == ray_cluster.get(worker_registry.registry().secret.remote("reg-a"))
    assert other.secret != client.secret


def test_a_tool_before_any_worker_or_router_learns_nothing(ray_cluster):
    from deployments import worker_registry

    with pytest.raises(LookupError, match="reg-unknown"):
        worker_registry.credentials("reg-unknown", Role.CLIENT)


def test_internal_tls_off_hands_out_no_certificate_and_warns(ray_cluster, caplog):
    from deployments import worker_registry

    with caplog.at_level(logging.WARNING, logger="deployments.worker_registry"):
        plain = worker_registry.credentials("reg-plain", Role.SERVER, TlsSetting(enabled=False))
    assert plain.tls is None and plain.secret
    assert any("plaintext" in r.getMessage() and "reg-plain" in r.getMessage() for r in caplog.records)
    assert worker_registry.credentials("reg-plain", Role.CLIENT).tls is None  # a tool follows the application


def test_a_mounted_directory_is_read_by_the_process_that_asks(ray_cluster, tmp_path):
    from deployments import worker_registry

    directory = operator_tls_dir(tmp_path / "secret")
    mounted = worker_registry.credentials("reg-mounted", Role.SERVER, TlsSetting(directory=str(directory)))
    assert mounted.tls.cert == (directory / "tls.crt").read_bytes()
    assert mounted.tls.server_name == "specdec.example.internal"


def test_the_routers_waiting_sessions_add_up_per_kind_until_a_router_stops_reporting(ray_cluster):
    """What the worker replicas report to Serve's autoscaling as waiting (`deployments.autoscaling`)."""
    import time

    from deployments import worker_registry

    reg, get = worker_registry.registry(), ray_cluster.get
    get(reg.report_waiting.remote("reg-wait", "router-a", {"target": 3, "draft": 1}))
    get(reg.report_waiting.remote("reg-wait", "router-b", {"target": 2}))
    assert (get(reg.waiting.remote("reg-wait", "target")), get(reg.waiting.remote("reg-wait", "draft"))) == (5, 1)
    get(reg.report_waiting.remote("reg-wait", "router-a", {}))  # its latest report replaces the last
    assert get(reg.waiting.remote("reg-wait", "target")) == 2
    assert get(reg.waiting.remote("reg-other", "target")) == 0  # per application
    deadline = time.monotonic() + 3 * worker_registry.WAITING_TTL_S
    while get(reg.waiting.remote("reg-wait", "target")) and time.monotonic() < deadline:
        time.sleep(0.5)  # router-b went silent: its count lapses
    assert get(reg.waiting.remote("reg-wait", "target")) == 0
