"""Reliability and security of the served stack: real Ray Serve, real gRPC, replicas killed with `ray.kill`.

A second application on the session's Serve, with auth, a KV budget of two sequences, a queue of one and tight
limits; the faults come last in this module because they kill its replicas.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec_core.config import SamplingParams
from specdec_core.models.loader import load_model
from tests.helpers import make_engine, run_to_completion, wait_until_idle, worker_stats

APP = "specdec-rel"
TOKEN = "open-sesame-7f3a"
AUTH = [("application", APP), ("authorization", f"Bearer {TOKEN}")]
MAX_SPEC = 8
IDLE_S = 3.0  # the workers free a session unused this long


def _per_slot_bytes(tiny_dir) -> int:
    """What one KV slot of the tiny target takes in the worker (float32, 256 positions plus k_max + 1 slack)."""
    args = load_model(tiny_dir / "target", dtype="float32").model.args
    return 2 * args.num_layers * args.num_kv_heads * (256 + MAX_SPEC + 1) * args.head_dim * 4


@pytest.fixture(scope="module")
def rel(served, tiny_dir, tmp_path_factory):
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config

    address, base = served
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    config = parse_config(
        {
            **base.model_dump(mode="json"),
            "app_name": APP,
            "auth": "bearer",
            "auth_token_file": str(token_file),
            "session_idle_timeout_s": IDLE_S,
            "target": {
                **base.target.model_dump(mode="json"),
                "kv_cache_max_bytes": 2 * _per_slot_bytes(tiny_dir) + 100,
            },
            "draft": {**base.draft.model_dump(mode="json"), "num_replicas": 1},
            "router": {
                **base.router.model_dump(mode="json"),
                "max_queued_requests": 1,
                "queue_timeout_s": 60,
                "max_prompt_tokens": 64,
                "max_output_tokens": 230,
                "draft_timeout_s": 2,
                "worker_refresh_s": 1,
            },
        }
    )
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    channel = grpc.insecure_channel(address)
    yield pb_grpc.GenerationServiceStub(channel), (address, config)
    channel.close()
    serve.delete(APP)


def request(prompt, k=None, **sampling):
    message = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling))
    if k is not None:
        message.speculation.num_speculative_tokens = k
    return message


def code_of(call):
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_the_public_api_wants_the_bearer_token(rel):
    stub, _ = rel
    small = request([5, 6, 7], max_tokens=3, ignore_eos=True)
    for metadata in (
        [("application", APP)],
        [("application", APP), ("authorization", "Bearer wrong")],
        [("application", APP), ("authorization", TOKEN)],
    ):
        for call in (
            lambda metadata=metadata: stub.Generate(small, metadata=metadata, timeout=60),
            lambda metadata=metadata: list(stub.GenerateStream(small, metadata=metadata, timeout=60)),
            lambda metadata=metadata: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=60),
        ):
            assert code_of(call)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert len(stub.Generate(small, metadata=AUTH, timeout=60).token_ids) == 3
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=60).draft_method == "draft_model"


def _health(address, metadata=(("application", APP),)):
    """The public service's health Check, with no token, as a probe asks it."""
    check = health_pb2.HealthCheckRequest(service="specdec.v1.GenerationService")
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(check, metadata=metadata, timeout=60).status


def test_health_needs_no_token_but_names_the_application_when_serve_runs_two(rel):
    _, (address, _) = rel
    assert _health(address) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        _health(address, metadata=())  # as Kubernetes' gRPC probes call it: the proxy cannot choose an application
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "application metadata" in err.value.details().lower()


def test_the_internal_services_refuse_calls_from_outside(rel):
    """The served workers speak mutual TLS only (the default): a plaintext caller fails its handshake, a caller
    with the application's client certificate but not its secret is UNAUTHENTICATED, for GetStats too."""
    from deployments import worker_registry
    from deployments.auth import InternalCredentials, dial
    from deployments.tls import Role
    from specdec.v1 import worker_pb2 as wpb
    from specdec.v1 import worker_pb2_grpc as wpb_grpc

    address = ray.get(worker_registry.registry().addresses.remote(APP, "target"))[0]
    item = wpb.PrefillRequest.Item(seq_id="intruder", prompt_token_ids=[5, 6, 7])
    issued = worker_registry.credentials(APP, Role.CLIENT)
    assert issued.tls is not None
    for credentials, refused in (
        (None, grpc.StatusCode.UNAVAILABLE),
        (InternalCredentials("guessed", issued.tls), grpc.StatusCode.UNAUTHENTICATED),
    ):
        with dial(address, credentials) as channel:
            stub = wpb_grpc.TargetServiceStub(channel)
            assert code_of(lambda stub=stub: stub.Prefill(wpb.PrefillRequest(items=[item]), timeout=10))[0] == refused
            assert code_of(lambda stub=stub: stub.GetStats(wpb.GetStatsRequest(), timeout=10))[0] == refused
    with dial(address, issued) as channel:
        assert wpb_grpc.TargetServiceStub(channel).GetStats(wpb.GetStatsRequest(), timeout=10).active_sessions == 0


def test_prompt_and_output_limits_name_the_field(rel):
    stub, _ = rel
    code, details = code_of(lambda: stub.Generate(request(list(range(5, 70)), max_tokens=3), metadata=AUTH, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details and "64" in details
    code, details = code_of(lambda: stub.Generate(request([5, 6], max_tokens=231), metadata=AUTH, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.max_tokens" in details


def test_beyond_the_kv_budget_requests_queue_then_are_refused(rel):
    stub, (_, config) = rel
    stats = worker_stats((None, config), "target")
    assert [s.num_slots for s in stats] == [2]  # the byte budget holds two sequences, not max_sequences (8)
    results: list = [None] * 4

    def run(i):
        message = request(list(range(10 + i, 30 + i)), k=0, max_tokens=200, ignore_eos=True)
        results[i] = code_of(lambda: stub.Generate(message, metadata=AUTH, timeout=120))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code.name for code, _ in results)
    assert codes == ["OK", "OK", "OK", "RESOURCE_EXHAUSTED"], results  # two run, one waits, one is refused
    assert all("queue" in details for code, details in results if code != grpc.StatusCode.OK)
    assert wait_until_idle((None, config))


def _http(config, method: str, path: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    """A call to the application's OpenAI-compatible API (under its route prefix)."""
    url = f"http://127.0.0.1:{config.http_port}/{APP}/v1{path}"
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_api_wants_the_same_bearer_token(rel):
    _, (_, config) = rel
    chat = {"model": config.served_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for token in (None, "wrong", TOKEN.upper()):
        for method, path, body in (("GET", "/models", None), ("POST", "/chat/completions", chat)):
            status, error = _http(config, method, path, body, token)
            assert status == 401 and error["error"]["type"] == "authentication_error", (token, error)
    assert _http(config, "GET", "/models")[1]["data"][0]["id"] == config.served_name
    status, reply = _http(config, "POST", "/chat/completions", chat)
    assert status == 200 and reply["usage"]["completion_tokens"] <= 2


def test_over_http_beyond_the_kv_budget_requests_queue_then_are_429(rel):
    _, (_, config) = rel
    results: list = [None] * 4

    def run(i):
        body = {
            "model": config.served_name,
            "prompt": list(range(10 + i, 30 + i)),
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "num_speculative_tokens": 0,
        }
        results[i] = _http(config, "POST", "/completions", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(status for status, _ in results) == [200, 200, 200, 429], results
    (refused,) = [body["error"] for status, body in results if status == 429]
    assert refused["type"] == "rate_limit_exceeded" and refused["param"] == "queue"
    assert wait_until_idle((None, config))


def test_a_client_deadline_stops_the_request_and_frees_its_caches(rel):
    stub, (_, config) = rel
    message = request(list(range(5, 25)), k=3, max_tokens=220, ignore_eos=True)
    code, _ = code_of(lambda: list(stub.GenerateStream(message, metadata=AUTH, timeout=0.3)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until_idle((None, config)), "a request past its deadline left sessions in the workers"


def _kill_replica(kind: str) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{APP}#{kind}#" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"))


def _plain_tokens(tiny_dir, prompt, params):
    target = load_model(tiny_dir / "target", dtype="float32")
    return run_to_completion(make_engine(target), [("r", prompt, params, 0)])["r"][0]


def _until(check, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError("not within the timeout")


def test_the_sessions_of_a_killed_router_are_reclaimed_by_the_workers(rel):
    stub, (_, config) = rel
    streams = [
        stub.GenerateStream(
            request(list(range(5 + i, 25 + i)), k=0, max_tokens=220, ignore_eos=True), metadata=AUTH, timeout=120
        )
        for i in range(2)
    ]
    next(streams[0])
    _kill_replica("Router")
    held = sum(s.active_sessions for kind in ("target", "draft") for s in worker_stats((None, config), kind))
    assert held > 0  # the dead router's sessions, nobody left to release them
    assert wait_until_idle((None, config), timeout=IDLE_S + 30), "the workers kept a dead router's sessions"
    for stream in streams:
        stream.cancel()

    def serving():
        small = request([5, 6, 7], max_tokens=4, ignore_eos=True)
        return code_of(lambda: stub.Generate(small, metadata=AUTH, timeout=60))[0] == grpc.StatusCode.OK

    _until(serving)  # Serve replaced the router


def test_a_killed_draft_replica_costs_speculation_not_the_request(rel, tiny_dir):
    stub, _ = rel
    prompt, k = list(range(5, 25)), 3
    stream = stub.GenerateStream(request(prompt, k=k, max_tokens=220, ignore_eos=True), metadata=AUTH, timeout=120)
    chunks = [next(stream), next(stream)]
    _kill_replica("DraftWorker")
    chunks += list(stream)  # the stream goes on
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == _plain_tokens(tiny_dir, prompt, SamplingParams(max_tokens=220, ignore_eos=True))
    stats = chunks[-1].speculation
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert stats.proposed < k * stats.rounds - 2 * k  # rounds without drafts after the kill

    def speculating_again():
        response = stub.Generate(request([7, 8, 9, 10], k=k, max_tokens=12, ignore_eos=True), metadata=AUTH, timeout=60)
        return response.speculation.proposed > 0

    _until(speculating_again)  # Serve replaced the replica and the router found it


def test_a_killed_target_replica_fails_its_requests_cleanly_then_serving_resumes(rel, tiny_dir):
    stub, (address, _) = rel
    prompt = list(range(30, 50))
    params = SamplingParams(max_tokens=220, ignore_eos=True)
    stream = stub.GenerateStream(request(prompt, k=0, max_tokens=220, ignore_eos=True), metadata=AUTH, timeout=120)
    chunks = [next(stream), next(stream)]
    _kill_replica("TargetWorker")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        chunks += list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert time.monotonic() - start < 60  # an answer, not a hang
    # No target until Serve's replacement registers (a restart and a model load away): health says so.
    assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == _plain_tokens(tiny_dir, prompt, params)[: len(tokens)]  # no duplicated or missing token

    def serving():
        small = request([5, 6, 7], max_tokens=4, ignore_eos=True)
        code, _ = code_of(lambda: stub.Generate(small, metadata=AUTH, timeout=60))
        return code == grpc.StatusCode.OK

    _until(serving)
    assert _health(address) == health_pb2.HealthCheckResponse.SERVING
