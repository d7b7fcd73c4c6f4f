"""The served stack end to end: client -> Serve's gRPC proxy -> router -> draft and target workers (real Ray Serve,
real gRPC on loopback, tiny models). Answers must equal the in-process engine's."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec_core.config import SamplingParams
from specdec_core.models.loader import load_model
from tests.helpers import make_engine, run_to_completion, wait_until_idle, worker_stats


@pytest.fixture(scope="module")
def stub(served):
    address, _ = served
    channel = grpc.insecure_channel(address)
    yield pb_grpc.GenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def local_pair(tiny_dir, near_draft_dir):
    return load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")


def local_tokens(local_pair, prompt_ids, params, k=3):
    target, draft = local_pair
    engine = make_engine(target, draft.model, num_slots=8, max_seq_len=256)
    return run_to_completion(engine, [("r", prompt_ids, params, k)])["r"][0]


def request(prompt_ids, k=None, **sampling):
    message = pb.GenerateRequest(prompt_token_ids=prompt_ids, sampling=pb.SamplingParams(**sampling))
    if k is not None:
        message.speculation.num_speculative_tokens = k
    return message


def test_generate_gives_the_in_process_engines_greedy_tokens(stub, local_pair):
    prompt = list(range(5, 30))
    response = stub.Generate(request(prompt, k=3, max_tokens=24, ignore_eos=True), timeout=120)
    assert list(response.token_ids) == local_tokens(local_pair, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == 24
    assert response.speculation.rounds > 0 and response.speculation.proposed >= response.speculation.accepted > 0


def test_seeded_sampling_gives_the_in_process_engines_tokens(stub, local_pair):
    prompt = list(range(50, 60))
    settings = dict(temperature=1.0, top_k=40, seed=1234, max_tokens=20, ignore_eos=True)
    served_a = stub.Generate(request(prompt, k=3, **settings), timeout=120).token_ids
    served_b = stub.Generate(request(prompt, k=3, **settings), timeout=120).token_ids
    assert list(served_a) == list(served_b)
    assert list(served_a) == local_tokens(local_pair, prompt, SamplingParams(**settings))


def test_stream_chunks_add_up_to_the_unary_answer(stub):
    message = request(list(range(7, 19)), k=2, max_tokens=20, ignore_eos=True)
    chunks = list(stub.GenerateStream(message, timeout=120))
    whole = stub.Generate(message, timeout=120)
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert "".join(c.text for c in chunks) == whole.text
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert chunks[-1].finish_reason == whole.finish_reason
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert whole.usage.cached_tokens == 11  # the stream left its prompt in the prefix cache


def test_concurrent_streams_do_not_disturb_each_other(stub):
    cases = [
        request(list(range(5, 25)), k=3, max_tokens=30, ignore_eos=True),
        request(list(range(100, 104)), k=0, max_tokens=9, ignore_eos=True),
        request(list(range(60, 75)), temperature=0.9, top_p=0.8, seed=5, max_tokens=25, ignore_eos=True),
        request(list(range(200, 240)), k=5, max_tokens=14, ignore_eos=True),
    ]
    solo = [list(stub.Generate(m, timeout=120).token_ids) for m in cases]
    together: list = [None] * len(cases)

    def run(i):
        together[i] = [t for chunk in stub.GenerateStream(cases[i], timeout=120) for t in chunk.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo


def test_a_cancelled_stream_frees_its_caches_in_both_workers(stub, served):
    call = stub.GenerateStream(request(list(range(5, 25)), k=3, max_tokens=200, ignore_eos=True), timeout=120)
    next(call)
    next(call)
    assert any(s.active_sessions == 1 for s in worker_stats(served, "target"))
    call.cancel()
    assert wait_until_idle(served), "a cancelled stream left sessions in the workers"


def test_sessions_stick_to_one_draft_replica_and_spread_over_both(stub, served):
    assert wait_until_idle(served)
    before = sum(s.sessions_started for s in worker_stats(served, "draft"))
    per_replica_before = [s.sessions_started for s in worker_stats(served, "draft")]
    n = 6
    for i in range(n):
        stub.Generate(request(list(range(10 + i, 30 + i)), k=3, max_tokens=12, ignore_eos=True), timeout=120)
    stats = worker_stats(served, "draft")
    assert len(stats) == 2
    assert sum(s.sessions_started for s in stats) - before == n  # each session prefilled the draft exactly once
    assert all(s.sessions_started > b for s, b in zip(stats, per_replica_before))  # both replicas took sessions


@pytest.mark.parametrize(
    "message, field",
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]), "prompt"),
        (pb.GenerateRequest(prompt_token_ids=[1, 99999]), "prompt_token_ids"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
        (
            pb.GenerateRequest(prompt_token_ids=list(range(5, 205)), sampling=pb.SamplingParams(max_tokens=100)),
            "sampling.max_tokens",
        ),
        (
            pb.GenerateRequest(prompt="hi", speculation=pb.SpeculationOptions(num_speculative_tokens=99)),
            "speculation.num_speculative_tokens",
        ),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(stub, message, field):
    for method in (stub.Generate, lambda m, timeout: list(stub.GenerateStream(m, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            method(message, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()
    ok = stub.Generate(request([5, 6, 7], max_tokens=3, ignore_eos=True), timeout=60)  # still serving
    assert len(ok.token_ids) == 3


def test_model_info(stub, served):
    _, config = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.target_model == config.target.model and info.draft_method == "draft_model"
    assert info.max_context_length == 256 and info.num_speculative_tokens == "3"


def test_metrics_reach_the_prometheus_endpoint(stub, ray_cluster):
    import urllib.request

    for _ in range(2):
        stub.Generate(request(list(range(30, 50)), k=3, max_tokens=12, ignore_eos=True), timeout=120)
    port = next(n["MetricsExportPort"] for n in ray_cluster.nodes() if n["Alive"])
    wanted = (
        "ray_specdec_acceptance_rate_bucket",
        "ray_gen_ai_server_time_to_first_token_bucket",
        "ray_specdec_requests",
        "ray_specdec_accepted_tokens_per_round_bucket",
        # the workers' prefix caches: the second request found the first one's prompt
        "ray_specdec_prefix_cache_queried_tokens",
        "ray_specdec_prefix_cache_hit_tokens",
        "ray_specdec_prefix_cache_bytes",
        "ray_specdec_prefix_cache_entries",
    )
    latencies = ("ray_specdec_draft_latency_seconds", "ray_specdec_verify_latency_seconds")
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        if all(name in text for name in wanted) and all(_count(text, name) > 0 for name in latencies):
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, f"not exported: {missing}"
    assert 'finish_reason="length"' in text
    counts = {name: _count(text, name) for name in latencies}
    assert all(n > 0 for n in counts.values()), counts


def test_a_repeated_prompt_is_read_from_the_prefix_cache_and_changes_no_token(stub, local_pair):
    prompt = list(range(150, 190))
    greedy = dict(max_tokens=16, ignore_eos=True)
    seeded = dict(temperature=1.0, top_k=40, seed=77, max_tokens=16, ignore_eos=True)
    for settings in (greedy, seeded):
        first = stub.Generate(request(prompt, k=3, **settings), timeout=120)
        again = stub.Generate(request(prompt, k=3, **settings), timeout=120)
        assert again.usage.cached_tokens == len(prompt) - 1  # all but the last token, computed for its logits
        expected = local_tokens(local_pair, prompt, SamplingParams(**settings))  # no prefix cache in process
        assert list(again.token_ids) == list(first.token_ids) == expected


def _sendable(stub, tokens):
    """`tokens` up to the first id a client may not send (the tiny target scores more ids than its tokenizer has)."""
    vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
    return tokens[: next((i for i, t in enumerate(tokens) if t >= vocab), len(tokens))]


def test_a_conversations_next_turn_computes_only_its_new_tokens_in_the_target(stub, served):
    prompt = list(range(200, 230))
    reply = list(stub.Generate(request(prompt, k=3, max_tokens=12, ignore_eos=True), timeout=120).token_ids)
    kept = _sendable(stub, reply)
    second = prompt + kept + [31, 32, 33]
    [before] = worker_stats(served, "target")
    answer = stub.Generate(request(second, k=3, max_tokens=1, ignore_eos=True), timeout=120)  # the prefill alone
    [after] = worker_stats(served, "target")
    cached = answer.usage.cached_tokens
    # Cached: the prompt and the reply but (at most) its last token, which was sampled and never read.
    assert cached >= len(prompt) + min(len(kept), len(reply) - 1)
    assert after.computed_tokens - before.computed_tokens == len(second) - cached
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == cached


def test_requests_share_cached_prefixes_only_within_their_salt(stub):
    prompt = list(range(240, 270))
    cached, tokens = [], []
    for salt in ("test-app-a", "test-app-a", "test-app-b", "test-app-b"):
        message = request(prompt, k=3, max_tokens=6, ignore_eos=True)
        message.cache_salt = salt
        response = stub.Generate(message, timeout=120)
        cached.append(response.usage.cached_tokens)
        tokens.append(list(response.token_ids))
    assert cached == [0, len(prompt) - 1, 0, len(prompt) - 1]
    assert all(t == tokens[0] for t in tokens)


def test_a_cancelled_stream_leaves_a_usable_cache_entry(stub, served, local_pair):
    prompt = list(range(300, 330))
    call = stub.GenerateStream(request(prompt, k=3, max_tokens=200, ignore_eos=True), timeout=120)
    next(call)
    next(call)
    call.cancel()
    assert wait_until_idle(served)
    response = stub.Generate(request(prompt, k=3, max_tokens=20, ignore_eos=True), timeout=120)
    assert response.usage.cached_tokens == len(prompt) - 1
    assert list(response.token_ids) == local_tokens(local_pair, prompt, SamplingParams(max_tokens=20, ignore_eos=True))


def test_draft_workers_reuse_their_caches_too(stub, served):
    before = sum(s.prefix_cache_hit_tokens for s in worker_stats(served, "draft"))
    conversation = list(range(330, 350))
    # New sessions alternate between the two draft replicas (equally loaded, the one that waited longest takes
    # it): the third turn lands where the first one's session was kept.
    for _ in range(3):
        reply = stub.Generate(request(conversation, k=3, max_tokens=8, ignore_eos=True), timeout=120)
        conversation += _sendable(stub, list(reply.token_ids)) + [21, 22]
    assert sum(s.prefix_cache_hit_tokens for s in worker_stats(served, "draft")) - before >= 20


def _count(text, histogram):
    """Observations of a histogram in a Prometheus exposition, summed over its series."""
    lines = [line for line in text.splitlines() if line.startswith(histogram + "_count")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_server_reflection_lists_the_services_and_describes_them_as_the_stubs_do(served):
    """What `grpcurl list` and `describe` ask, through the public port: no .proto on the client's side."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    address, _ = served
    local = pb.DESCRIPTOR.services_by_name["GenerationService"]
    with grpc.insecure_channel(address) as channel:
        reflected = ProtoReflectionDescriptorDatabase(channel)
        assert {local.full_name, "grpc.health.v1.Health"} <= set(reflected.get_services())
        pool = DescriptorPool(reflected)
        service = pool.FindServiceByName(local.full_name)
        assert [m.name for m in service.methods] == [m.name for m in local.methods]
        stream = service.methods_by_name["GenerateStream"]
        assert stream.server_streaming and stream.input_type.full_name == pb.GenerateRequest.DESCRIPTOR.full_name
        request_fields = pool.FindMessageTypeByName(pb.GenerateRequest.DESCRIPTOR.full_name).fields_by_name
        assert sorted(request_fields) == sorted(pb.GenerateRequest.DESCRIPTOR.fields_by_name)
        # Only v1alpha is served: a client asking v1 first (grpcurl) is told UNIMPLEMENTED and falls back.
        v1 = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as err:
            list(v1(iter([b""]), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
