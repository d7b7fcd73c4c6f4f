"""The workers' gRPC services and the router's gRPC clients of them, over real sockets, without Ray.

An engine whose target and drafter are remote must produce exactly what the in-process engine produces.
"""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.status import WorkerUnavailable
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import SpecEngine
from specdec_core.grammar.compiler import GrammarCompiler, grammar_compiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget
from tests.helpers import SERVED_SCHEMA, make_engine, run_to_completion, serve_pair
from tests.specdec_core.test_structured import EOS_ID, wordlevel_tokenizer

RUNNER = RunnerConfig(num_slots=4, max_seq_len=256)


@pytest.fixture(scope="module")
def servers(pair):
    yield from serve_pair(pair, RUNNER)


def remote_engine(pair, servers, **config):
    target, _ = pair
    tpool = ReplicaPool("target", [servers["target"][1]], wpb_grpc.TargetServiceStub, timeout_s=30)
    dpool = ReplicaPool("draft", [servers["draft"][1]], wpb_grpc.DraftServiceStub, timeout_s=30)
    return SpecEngine(RemoteTarget(tpool), RemoteDrafter(dpool), target.tokenizer, target.eos_token_ids)


REQUESTS = [
    ("greedy-k3", list(range(5, 25)), SamplingParams(max_tokens=24, ignore_eos=True), 3),
    ("greedy-auto", list(range(40, 47)), SamplingParams(max_tokens=17, ignore_eos=True), "auto"),
    ("greedy-off", list(range(9, 30)), SamplingParams(max_tokens=9, ignore_eos=True), 0),
    (
        "sampled",
        list(range(60, 75)),
        SamplingParams(temperature=1.0, top_k=50, seed=3, max_tokens=20, ignore_eos=True),
        4,
    ),
    (
        "nucleus",
        list(range(80, 84)),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=15, ignore_eos=True),
        2,
    ),
]


def test_remote_engine_matches_the_in_process_engine(pair, servers):
    target, draft = pair
    local = run_to_completion(make_engine(target, draft.model, num_slots=8), REQUESTS)
    remote = run_to_completion(remote_engine(pair, servers), REQUESTS)  # all five batched together
    for request_id, *_ in REQUESTS:
        assert remote[request_id][0] == local[request_id][0], request_id
        assert remote[request_id][2].stats == local[request_id][2].stats, request_id
    assert sum(out.stats.accepted for _, _, out in remote.values()) > 0  # the drafts were used, not just sent
    for servicer, _ in servers.values():
        assert servicer.active_sessions == 0  # finished sessions were released in both workers


def test_constrained_sampled_requests_through_the_workers_match_the_in_process_engine(pair, servers):
    """The draft worker masks its q with the grammar the router sends, as the in-process drafter masks it: at
    T > 0 (seeded) and greedy alike, the remote engine's tokens and counts are the in-process engine's."""
    target, draft = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    requests = [
        (
            "json-sampled",
            list(range(5, 25)),
            SamplingParams(temperature=1.0, seed=5, max_tokens=40, constraint=constraint),
            3,
        ),
        ("json-greedy", list(range(30, 44)), SamplingParams(max_tokens=40, constraint=constraint), 4),
        (
            "regex-sampled",
            list(range(50, 60)),
            SamplingParams(
                temperature=0.9, seed=9, max_tokens=30, constraint=Constraint("regex", "[a-c]{2,9}( [a-c]+)*")
            ),
            3,
        ),
    ]
    local = run_to_completion(make_engine(target, draft.model, num_slots=8), requests)
    remote = run_to_completion(remote_engine(pair, servers), requests)
    for request_id, *_ in requests:
        assert remote[request_id][0] == local[request_id][0], request_id
        assert remote[request_id][2].stats == local[request_id][2].stats, request_id
    assert sum(out.stats.proposed for _, _, out in remote.values()) > 0
    assert servers["draft"][0].active_sessions == 0 and not servers["draft"][0]._grammar_states


def test_a_draft_worker_refuses_a_grammar_its_session_left(pair, servers):
    """Committed tokens the session's grammar refuses mean router and worker disagree: INVALID_ARGUMENT, nothing
    drafted under a wrong state."""
    _, address = servers["draft"]
    stub = wpb_grpc.DraftServiceStub(grpc.insecure_channel(address))
    stub.Start(wpb.StartRequest(items=[wpb.StartRequest.Item(seq_id="g", prompt_token_ids=[5, 6, 7])]), timeout=10)
    try:
        item = wpb.ProposeRequest.Item(
            seq_id="g",
            new_token_ids=[8],
            num_committed=4,
            num_tokens=2,
            grammar=wpb.Grammar(kind="regex", value="[0-9]+", output_start=3),
        )
        item.sampling.temperature = 0.0
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(wpb.ProposeRequest(items=[item]), timeout=10)
        code, details = err.value.code(), err.value.details()
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "new_token_ids" in details, details
        bad = wpb.ProposeRequest.Item(seq_id="g", num_committed=4, num_tokens=2, grammar=wpb.Grammar(kind="regex"))
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(wpb.ProposeRequest(items=[bad]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items.grammar" in err.value.details()
    finally:
        stub.Release(wpb.ReleaseRequest(seq_ids=["g"]), timeout=10)


def test_aborted_requests_free_both_workers(pair, servers):
    engine = remote_engine(pair, servers)
    engine.add_request(
        Request("long", tuple(range(5, 25)), SamplingParams(max_tokens=200, ignore_eos=True), num_speculative_tokens=3)
    )
    engine.step()
    engine.step()
    assert all(servicer.active_sessions == 1 for servicer, _ in servers.values())
    final = engine.abort("long")
    assert final.finish_reason is FinishReason.CANCELLED
    assert all(servicer.active_sessions == 0 for servicer, _ in servers.values())


def test_worker_errors_are_statuses_naming_the_field(servers):
    _, address = servers["target"]
    stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as err:
        stub.Verify(wpb.VerifyRequest(items=[wpb.VerifyRequest.Item(seq_id="nope", last_token_id=1)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "seq_id" in err.value.details()
    bad = wpb.PrefillRequest(items=[wpb.PrefillRequest.Item(seq_id="s", prompt_token_ids=[1, 10**6])])
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(bad, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()
    assert stub.GetStats(wpb.GetStatsRequest(), timeout=10).active_sessions == 0  # nothing leaked


def test_a_worker_that_goes_away_fails_its_requests_as_unavailable(pair):
    target, _ = pair
    servicer = TargetServicer(LocalTarget(ModelRunner(target.model, RUNNER)), "doomed")
    server, port = start_server(servicer, "127.0.0.1")
    pool = ReplicaPool("target", [f"127.0.0.1:{port}"], wpb_grpc.TargetServiceStub, timeout_s=10)
    engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
    engine.add_request(
        Request("r", (5, 6, 7), SamplingParams(max_tokens=50, ignore_eos=True), num_speculative_tokens=0)
    )
    engine.step()
    server.stop(0).wait()
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR]
    assert isinstance(outputs[0].error, WorkerUnavailable)
    assert outputs[0].error.code == grpc.StatusCode.UNAVAILABLE
    assert not engine.has_work


def test_no_reachable_worker_is_an_immediate_error():
    with pytest.raises(WorkerUnavailable, match="no target worker"):
        ReplicaPool("target", ["127.0.0.1:1"], wpb_grpc.TargetServiceStub, timeout_s=5)


def test_idle_sessions_are_released(pair):
    import time

    target, _ = pair
    servicer = TargetServicer(LocalTarget(ModelRunner(target.model, RUNNER)), "idle", idle_timeout_s=0.4)
    server, port = start_server(servicer, "127.0.0.1")
    try:
        stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        item = wpb.PrefillRequest.Item(seq_id="forgotten", prompt_token_ids=[5, 6, 7])
        stub.Prefill(wpb.PrefillRequest(items=[item]), timeout=10)
        assert servicer.active_sessions == 1
        deadline = time.monotonic() + 10
        while servicer.active_sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = stub.GetStats(wpb.GetStatsRequest(), timeout=10)
        assert stats.active_sessions == 0 and stats.sessions_expired == 1
        assert servicer.target.runner.cache.free_slots == RUNNER.num_slots  # the cache slot came back too
    finally:
        servicer.close()
        server.stop(0)


def test_the_pool_follows_replicas_that_come_and_go(pair, servers):
    target, _ = pair
    first = servers["target"][1]
    extra = TargetServicer(LocalTarget(ModelRunner(target.model, RUNNER)), "extra")
    server, port = start_server(extra, "127.0.0.1")
    second = f"127.0.0.1:{port}"
    try:
        pool = ReplicaPool("target", [first], wpb_grpc.TargetServiceStub, timeout_s=10)
        pool.update([first, second])
        assert sorted(r.address for r in pool.replicas) == sorted([first, second])
        pinned = pool.pin("kept")
        pool.update([a for a in (first, second) if a != pinned.address])  # the replica holding "kept" is gone
        assert pool.replica_of("kept") is pinned  # its session still goes there
        assert all(pool.pin(f"new-{i}") is not pinned for i in range(3))  # new sessions do not
        for i in range(3):
            pool.unpin(f"new-{i}")
        pool.unpin("kept")
        pool.update([a for a in (first, second) if a != pinned.address])
        assert [r.address for r in pool.replicas] == [a for a in (first, second) if a != pinned.address]
    finally:
        extra.close()
        server.stop(0)


@pytest.fixture(scope="module")
def cached_servers(pair):
    """Both workers with prefix caching, as the service runs them by default."""
    yield from serve_pair(pair, RunnerConfig(num_slots=4, max_seq_len=256, prefix_caching=True))


def _stats(servers, kind):
    _, address = servers[kind]
    stub = (wpb_grpc.TargetServiceStub if kind == "target" else wpb_grpc.DraftServiceStub)(
        grpc.insecure_channel(address)
    )
    return stub.GetStats(wpb.GetStatsRequest(), timeout=10)


def test_remote_workers_reuse_cached_prefixes_within_a_salt_and_change_no_token(pair, cached_servers):
    target, draft = pair
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = list(range(100, 130))
    engine = remote_engine(pair, cached_servers)
    reply, _, first = run_to_completion(engine, [("t1", prompt, params, 3, "tenant")])["t1"]
    assert first.num_cached_tokens == 0
    before = {kind: _stats(cached_servers, kind) for kind in ("target", "draft")}
    second = prompt + reply + [7, 8, 9]
    results = run_to_completion(engine, [("t2", second, params, 3, "tenant"), ("other", second, params, 3, "else")])
    after = {kind: _stats(cached_servers, kind) for kind in ("target", "draft")}
    assert results["t2"][2].num_cached_tokens >= len(prompt) + len(reply) - 1  # through PrefillResponse
    assert results["other"][2].num_cached_tokens == 0  # the salt crossed the wire: another namespace
    expected = run_to_completion(make_engine(target, draft.model), [("r", second, params, 3)])["r"][0]
    assert results["t2"][0] == results["other"][0] == expected
    for kind in ("target", "draft"):  # both workers found turn one's tokens, and counted them
        hits = after[kind].prefix_cache_hit_tokens - before[kind].prefix_cache_hit_tokens
        assert hits >= len(prompt), kind
        assert after[kind].prefix_cache_queried_tokens > before[kind].prefix_cache_queried_tokens
        assert after[kind].prefix_cache_entries >= 1 and after[kind].prefix_cache_bytes > 0
        assert after[kind].computed_tokens > before[kind].computed_tokens
    assert all(servicer.active_sessions == 0 for servicer, _ in cached_servers.values())


# -- grammars on the draft worker ----------------------------------------------------------------------------------

WAIT_S = 60.0  # a bound for what takes milliseconds: reached only when the worker is broken


class SlowCompiler(GrammarCompiler):
    """A real compiler whose every compile, once started (`started`), waits for `go`: a large schema's compile."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.started, self.go = threading.Event(), threading.Event()

    def compile(self, constraint):
        self.started.set()
        assert self.go.wait(WAIT_S)
        return super().compile(constraint)


def _draft_worker(pair, grammars):
    """A draft worker over the tiny draft with `grammars`, on loopback: (servicer, server, stub)."""
    target, draft = pair
    drafter = DraftModelDrafter(ModelRunner(draft.model, RUNNER), target.model.vocab_size)
    servicer = DraftServicer(drafter, "tiny-draft", grammars=grammars)
    server, port = start_server(servicer, "127.0.0.1")
    return servicer, server, wpb_grpc.DraftServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def _constrained_item(seq_id: str, num_committed: int) -> wpb.ProposeRequest.Item:
    item = wpb.ProposeRequest.Item(
        seq_id=seq_id,
        num_committed=num_committed,
        num_tokens=2,
        grammar=wpb.Grammar(kind="regex", value="[0-9]+", output_start=num_committed),
    )
    item.sampling.temperature = 0.0
    return item


def test_a_grammar_compiles_without_holding_the_draft_workers_lock(pair):
    """While a session's grammar compiles, calls that take the worker's lock (Release here; every other session's
    Propose) go through: a slow compile must not stall the worker past its routers' draft timeout."""
    target, _ = pair
    grammars = SlowCompiler(target.tokenizer, target.model.vocab_size, sorted(target.eos_token_ids))
    servicer, server, stub = _draft_worker(pair, grammars)
    try:
        stub.Start(wpb.StartRequest(items=[wpb.StartRequest.Item(seq_id="g", prompt_token_ids=[5, 6, 7])]), timeout=10)
        proposing = stub.Propose.future(wpb.ProposeRequest(items=[_constrained_item("g", 3)]), timeout=WAIT_S)
        assert grammars.started.wait(WAIT_S)
        assert stub.Release(wpb.ReleaseRequest(seq_ids=["other"]), timeout=5).released == 0
        assert not proposing.done()  # still compiling: the Release did not wait for it
        grammars.go.set()
        assert len(proposing.result().proposals) == 1
    finally:
        grammars.go.set()
        servicer.close()
        server.stop(0)


def test_a_draft_worker_without_grammars_serves_and_refuses_constrained_sessions_saying_why(pair):
    """A target tokenizer the grammar engine cannot read: the worker comes up and drafts; a constrained session is
    INVALID_ARGUMENT naming the constraint and why structured output is unavailable."""
    grammars = grammar_compiler(wordlevel_tokenizer(), pair[0].model.vocab_size, [EOS_ID])
    servicer, server, stub = _draft_worker(pair, grammars)
    try:
        start = wpb.StartRequest(items=[wpb.StartRequest.Item(seq_id=s, prompt_token_ids=[5, 6, 7]) for s in "ab"])
        stub.Start(start, timeout=10)
        plain = wpb.ProposeRequest.Item(seq_id="a", num_committed=3, num_tokens=2)
        plain.sampling.temperature = 0.0
        assert len(stub.Propose(wpb.ProposeRequest(items=[plain]), timeout=10).proposals[0].token_ids) == 2
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(wpb.ProposeRequest(items=[_constrained_item("b", 3)]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("structured.regex: structured output is unavailable for this model")
    finally:
        servicer.close()
        server.stop(0)
