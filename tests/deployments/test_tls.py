"""Mutual TLS on the workers' services, over real sockets and real handshakes, without Ray.

Both workers serve with a certificate from one application's CA and require a client certificate from it. Every
refused caller below differs from a caller that is served in one thing only (no TLS, another CA, no client
certificate, no secret), so a refusal cannot come from a mistake elsewhere in the test.
"""

from __future__ import annotations

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from deployments import tls
from deployments.auth import INTERNAL_KEY, InternalCredentials, dial
from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.status import WorkerUnavailable
from deployments.tls import Role
from deployments.workers import start_server
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.runner import RunnerConfig
from tests.helpers import make_engine, operator_tls_dir, run_to_completion, serve_pair

APP = "tls-test"
SECRET = "s3cret-for-tls-tests"
RUNNER = RunnerConfig(num_slots=4, max_seq_len=256)
KINDS = ("target", "draft")
STUBS = {"target": wpb_grpc.TargetServiceStub, "draft": wpb_grpc.DraftServiceStub}


@pytest.fixture(scope="module")
def authority():
    return tls.make_authority(APP)


@pytest.fixture(scope="module")
def client(authority):
    """A router's credentials: a client certificate from the application's CA, and the secret."""
    return InternalCredentials(SECRET, tls.issue(authority, Role.CLIENT, APP))


@pytest.fixture(scope="module")
def servers(pair, authority):
    yield from serve_pair(pair, RUNNER, InternalCredentials(SECRET, tls.issue(authority, Role.SERVER, APP)))


def _session_call(kind, stub, metadata):
    """The call that starts a session on a `kind` worker (what an intruder would send first)."""
    if kind == "target":
        return lambda: stub.Prefill(
            wpb.PrefillRequest(items=[wpb.PrefillRequest.Item(seq_id="intruder", prompt_token_ids=[5, 6, 7])]),
            timeout=10,
            metadata=metadata,
        )
    return lambda: stub.Start(
        wpb.StartRequest(items=[wpb.StartRequest.Item(seq_id="intruder", prompt_token_ids=[5, 6, 7])]),
        timeout=10,
        metadata=metadata,
    )


def _codes(kind, channel, metadata=None):
    """The status of a session call and of GetStats on `channel` (OK when served)."""
    stub = STUBS[kind](channel)
    codes = []
    for call in (
        _session_call(kind, stub, metadata),
        lambda: stub.GetStats(wpb.GetStatsRequest(), timeout=10, metadata=metadata),
    ):
        try:
            call()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    return codes


WITH_SECRET = [(INTERNAL_KEY, SECRET)]  # for channels built here by hand: `dial` adds the secret itself


def _tls_channel(address, bundle, client_cert=True):
    """A TLS channel trusting `bundle`'s CA, with `bundle`'s certificate when `client_cert`."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=bundle.ca,
        private_key=bundle.key if client_cert else None,
        certificate_chain=bundle.cert if client_cert else None,
    )
    return grpc.secure_channel(address, credentials, options=tls.channel_options(bundle))


def _release(kind, servers, client):
    """Free the session a served call may have started (the next test expects none)."""
    servicer, address = servers[kind]
    with dial(address, client) as channel:
        STUBS[kind](channel).Release(wpb.ReleaseRequest(seq_ids=["intruder"]), timeout=10)
    assert servicer.active_sessions == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_plaintext_caller_is_refused(kind, servers, client):
    servicer, address = servers[kind]
    with grpc.insecure_channel(address) as channel:
        assert _codes(kind, channel, WITH_SECRET) == [grpc.StatusCode.UNAVAILABLE] * 2  # the secret is right
    assert servicer.active_sessions == 0
    with dial(address, client) as channel:  # the same calls over mutual TLS are served
        assert _codes(kind, channel) == [grpc.StatusCode.OK] * 2
    _release(kind, servers, client)


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_certificate_from_another_ca_is_refused(kind, servers, client):
    servicer, address = servers[kind]
    stranger = tls.issue(tls.make_authority(APP), Role.CLIENT, APP)  # same application name, another CA
    # It trusts the worker's CA (it could have read the public certificate): only its own certificate is wrong.
    impostor = tls.TlsBundle(client.tls.ca, stranger.cert, stranger.key)
    with dial(address, InternalCredentials(SECRET, impostor)) as channel:
        assert _codes(kind, channel) == [grpc.StatusCode.UNAVAILABLE] * 2
    assert servicer.active_sessions == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_tls_caller_without_a_client_certificate_is_refused(kind, servers, client):
    servicer, address = servers[kind]
    with _tls_channel(address, client.tls, client_cert=False) as channel:
        assert _codes(kind, channel, WITH_SECRET) == [grpc.StatusCode.UNAVAILABLE] * 2
    assert servicer.active_sessions == 0
    with _tls_channel(address, client.tls, client_cert=True) as channel:  # the same channel with the certificate
        assert _codes(kind, channel, WITH_SECRET) == [grpc.StatusCode.OK] * 2
    _release(kind, servers, client)


@pytest.mark.parametrize("kind", KINDS)
def test_a_workers_certificate_cannot_call_another_worker(kind, servers, authority):
    """Right CA, wrong purpose: a server certificate (extended key usage serverAuth only) is no client's."""
    _, address = servers[kind]
    with dial(address, InternalCredentials(SECRET, tls.issue(authority, Role.SERVER, APP))) as channel:
        assert _codes(kind, channel) == [grpc.StatusCode.UNAVAILABLE] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_get_stats_wants_the_secret_as_well_as_the_certificate(kind, servers, client):
    servicer, address = servers[kind]
    for secret in ("", "wrong"):
        with dial(address, InternalCredentials(secret, client.tls)) as channel:
            assert _codes(kind, channel) == [grpc.StatusCode.UNAUTHENTICATED] * 2
    assert servicer.active_sessions == 0
    with dial(address, client) as channel:
        assert STUBS[kind](channel).GetStats(wpb.GetStatsRequest(), timeout=10).num_slots == RUNNER.num_slots


REQUESTS = [
    ("greedy-k3", list(range(5, 25)), SamplingParams(max_tokens=20, ignore_eos=True), 3),
    (
        "sampled",
        list(range(60, 75)),
        SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=16, ignore_eos=True),
        4,
    ),
    ("greedy-auto", list(range(40, 47)), SamplingParams(max_tokens=12, ignore_eos=True), "auto"),
]


def test_an_engine_over_mutual_tls_gives_the_in_process_tokens(pair, servers, client):
    target, draft = pair
    tpool = ReplicaPool("target", [servers["target"][1]], wpb_grpc.TargetServiceStub, timeout_s=30, credentials=client)
    dpool = ReplicaPool("draft", [servers["draft"][1]], wpb_grpc.DraftServiceStub, timeout_s=30, credentials=client)
    try:
        engine = SpecEngine(RemoteTarget(tpool), RemoteDrafter(dpool), target.tokenizer, target.eos_token_ids)
        remote = run_to_completion(engine, REQUESTS)
    finally:
        tpool.close()
        dpool.close()
    local = run_to_completion(make_engine(target, draft.model, num_slots=8), REQUESTS)
    for request_id, *_ in REQUESTS:
        assert remote[request_id][0] == local[request_id][0], request_id
        assert remote[request_id][2].stats == local[request_id][2].stats, request_id
    assert sum(out.stats.accepted for _, _, out in remote.values()) > 0  # the draft worker was really used
    assert all(servicer.active_sessions == 0 for servicer, _ in servers.values())


def test_the_router_refuses_a_worker_whose_certificate_another_ca_signed(pair, client):
    """The other direction: a process posing as a worker, with a well-formed server certificate from its own CA."""
    from deployments.workers import TargetServicer
    from specdec_core.runner import ModelRunner
    from specdec_core.target import LocalTarget

    rogue = tls.issue(tls.make_authority(APP), Role.SERVER, APP)
    servicer = TargetServicer(LocalTarget(ModelRunner(pair[0].model, RUNNER)), "rogue")
    server, port = start_server(servicer, "127.0.0.1", credentials=InternalCredentials(SECRET, rogue))
    try:
        with pytest.raises(WorkerUnavailable, match="no target worker"):
            ReplicaPool("target", [f"127.0.0.1:{port}"], wpb_grpc.TargetServiceStub, timeout_s=5, credentials=client)
        assert servicer.calls == 0 and servicer.active_sessions == 0
    finally:
        servicer.close()
        server.stop(0)


def test_keys_stay_out_of_reprs(authority, client):
    key_line = client.tls.key.decode().splitlines()[1]  # a line of the key's base64
    assert key_line not in repr(client) and SECRET not in repr(client)
    assert authority.key.decode().splitlines()[1] not in repr(authority)


# -- a mounted directory (a Kubernetes TLS Secret) ----------------------------------------------------------------


def test_a_mounted_certificate_serves_both_ends(pair, tmp_path):
    """Workers and router load the same directory; clients expect the certificate's own DNS name."""
    bundle = tls.load_dir(operator_tls_dir(tmp_path / "secret"))
    assert bundle.server_name == "specdec.example.internal"
    credentials = InternalCredentials(SECRET, bundle)
    servers = serve_pair(pair, RUNNER, credentials)
    served = next(servers)
    try:
        target, _ = pair
        pool = ReplicaPool(
            "target", [served["target"][1]], wpb_grpc.TargetServiceStub, timeout_s=30, credentials=credentials
        )
        engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
        out = run_to_completion(engine, [("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0)])["r"]
        assert len(out[0]) == 4 and out[2].error is None
        pool.close()
        with grpc.insecure_channel(served["draft"][1]) as channel:  # still nothing in plaintext
            assert _codes("draft", channel, WITH_SECRET) == [grpc.StatusCode.UNAVAILABLE] * 2
    finally:
        next(servers, None)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda d: d.mkdir(), "ca.crt, tls.crt, tls.key"),
        (lambda d: operator_tls_dir(d, key_of_other=True), "tls.key is not the key of tls.crt"),
        (lambda d: operator_tls_dir(d, usages=[ExtendedKeyUsageOID.SERVER_AUTH]), "both server auth and client auth"),
    ],
)
def test_a_bad_mounted_directory_is_refused_naming_what_is_wrong(tmp_path, make, names):
    make(tmp_path / "secret")
    with pytest.raises(InvalidArgument) as err:
        tls.load_dir(tmp_path / "secret")
    assert err.value.field == "internal_tls_dir" and names in err.value.message
