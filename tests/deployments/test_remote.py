"""The router's clients of the workers when workers fail: real gRPC servers on loopback, no Ray.

A draft replica that dies or stalls must cost speculation only (the output stays exactly the target's), a dead
target replica must fail only its own requests, and a prefill that meets a dead replica goes to a live one.
"""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from deployments.auth import InternalCredentials
from deployments.remote import RemoteDrafter, RemoteTarget, ReplicaPool
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import SpecEngine
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget
from tests.helpers import SERVED_SCHEMA, make_engine, run_to_completion, satisfies_served_schema

RUNNER = RunnerConfig(num_slots=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=60, ignore_eos=True)
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def plain_tokens(pair):
    target, _ = pair
    return run_to_completion(make_engine(target), [("r", PROMPT, GREEDY, 0)])["r"][0]


class StallingDraft(DraftServicer):
    """A draft worker whose Propose hangs while `stalled` is set: a replica stuck in a long GC or a bad device."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalled = threading.Event()
        self.released = threading.Event()

    def Propose(self, request, context):
        if self.stalled.is_set():
            self.released.wait(30)
        return super().Propose(request, context)


def _serve(servicer):
    server, port = start_server(servicer, "127.0.0.1")
    return server, f"127.0.0.1:{port}"


def _target(pair, name="target"):
    return TargetServicer(LocalTarget(ModelRunner(pair[0].model, RUNNER)), name)


def _draft(pair, cls=DraftServicer, name="draft", grammars=True):
    target = pair[0]
    compiler = GrammarCompiler(target.tokenizer, target.model.vocab_size, sorted(target.eos_token_ids))
    return cls(DraftModelDrafter(ModelRunner(pair[1].model, RUNNER), target.model.vocab_size), name,
               grammars=compiler if grammars else None)


def _engine(pair, target_addresses, draft_addresses, draft_timeout_s=30.0):
    target, _ = pair
    tpool = ReplicaPool("target", target_addresses, wpb_grpc.TargetServiceStub, timeout_s=30)
    dpool = ReplicaPool("draft", draft_addresses, wpb_grpc.DraftServiceStub, timeout_s=30)
    drafter = RemoteDrafter(dpool, timeout_s=draft_timeout_s, retry_s=0.0)
    return SpecEngine(RemoteTarget(tpool), drafter, target.tokenizer, target.eos_token_ids), dpool


def _run(engine, until=None):
    """Step to the end; `until(outputs_so_far)` is called after each step. Returns (tokens, rounds, last)."""
    tokens, rounds, last = [], [], None
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
            rounds.append(out.round)
            last = out
        if until is not None:
            until(rounds)
    return tokens, [r for r in rounds if r is not None], last


def test_a_dead_draft_replica_costs_speculation_not_the_request(pair, plain_tokens):
    tserver, taddr = _serve(_target(pair))
    dserver, daddr = _serve(_draft(pair))
    spare_server, spare_addr = _serve(_draft(pair, name="spare"))
    try:
        engine, dpool = _engine(pair, [taddr], [daddr])
        engine.add_request("r", PROMPT, GREEDY, 3)
        events = {"killed_at": None, "back_at": None}

        def chaos(rounds):
            if events["killed_at"] is None and len(rounds) == 3:
                dserver.stop(0).wait()  # the draft replica dies mid-request
                events["killed_at"] = len(rounds)
            elif events["killed_at"] is not None and events["back_at"] is None and len(rounds) == events["killed_at"] + 3:
                dpool.update([daddr, spare_addr])  # its replacement registers
                events["back_at"] = len(rounds)

        tokens, rounds, last = _run(engine, chaos)
        assert last.finish_reason == FinishReason.LENGTH and last.error is None
        assert tokens == plain_tokens  # exact: the rounds without drafts are plain decoding
        killed, back = events["killed_at"], events["back_at"]
        assert killed is not None and back is not None, "the request ended before the fault was injected"
        assert any(not r.proposed_token_ids for r in rounds[killed - 1 : back])  # target-only while no draft
        assert any(r.proposed_token_ids for r in rounds[back:])  # speculation resumed on the new replica
    finally:
        for server in (tserver, spare_server):
            server.stop(0)


def test_a_stalled_draft_replica_times_out_into_target_only_rounds(pair, plain_tokens):
    stalling = _draft(pair, StallingDraft)
    tserver, taddr = _serve(_target(pair))
    dserver, daddr = _serve(stalling)
    try:
        engine, _ = _engine(pair, [taddr], [daddr], draft_timeout_s=0.5)
        engine.add_request("r", PROMPT, GREEDY, 3)

        def stall(rounds):
            if len(rounds) == 2:
                stalling.stalled.set()

        tokens, rounds, last = _run(engine, stall)
        assert tokens == plain_tokens and last.error is None
        assert any(not r.proposed_token_ids for r in rounds[2:])
    finally:
        stalling.released.set()
        tserver.stop(0)
        dserver.stop(0)


@pytest.fixture()
def two_targets(pair):
    """Two target replicas behind one pool, and a target-only engine over it: (engine, pool, servers, servicers)."""
    servicers = (_target(pair, "first"), _target(pair, "second"))
    (s1, a1), (s2, a2) = _serve(servicers[0]), _serve(servicers[1])
    target, _ = pair
    pool = ReplicaPool("target", [a1, a2], wpb_grpc.TargetServiceStub, timeout_s=30)
    engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
    yield engine, pool, ((s1, a1), (s2, a2)), servicers
    s1.stop(0)
    s2.stop(0)


def test_a_dead_target_replica_fails_only_its_own_requests(two_targets):
    engine, pool, ((s1, a1), _), (_, second) = two_targets
    for i in range(4):
        engine.add_request(f"r{i}", list(range(5 + i, 20 + i)), SamplingParams(max_tokens=30, ignore_eos=True), 0)
    engine.step()
    on_first = {sid for sid in (f"r{i}" for i in range(4)) if pool.replica_of(sid).address == a1}
    assert 0 < len(on_first) < 4  # spread over both
    s1.stop(0).wait()
    finished = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                finished[out.seq_id] = out
    assert {r for r, o in finished.items() if o.finish_reason == FinishReason.ERROR} == on_first
    assert all(o.finish_reason == FinishReason.LENGTH for r, o in finished.items() if r not in on_first)
    assert second.active_sessions == 0  # the survivors released their caches at the end


def test_a_prefill_that_meets_a_dead_replica_is_retried_on_a_live_one(two_targets):
    engine, pool, ((s1, a1), _), (_, second) = two_targets
    s1.stop(0).wait()  # dead, but the router has not noticed yet
    results = run_to_completion(engine, [(f"r{i}", list(range(5 + i, 20 + i)),
                                          SamplingParams(max_tokens=5, ignore_eos=True), 0) for i in range(4)])
    assert all(out.finish_reason == FinishReason.LENGTH for _, _, out in results.values())
    assert second.sessions_started == 4
    assert [r.usable for r in pool.replicas if r.address == a1] == [False]


def test_a_draining_target_replica_finishes_its_sessions_and_takes_no_new_one(two_targets, pair):
    """Scale-down: the replica Serve stops refuses new sessions (which start on the other, unseen by the client)
    and serves those it holds to their end."""
    engine, pool, ((_, a1), _), (first, second) = two_targets
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = {f"r{i}": list(range(5 + i, 20 + i)) for i in range(8)}
    for i in range(4):
        engine.add_request(f"r{i}", prompts[f"r{i}"], params, 0)
    outputs = engine.step()
    held = {sid for sid in (f"r{i}" for i in range(4)) if pool.replica_of(sid).address == a1}
    assert 0 < len(held) < 4  # spread over both
    first.start_draining()
    for i in range(4, 8):  # new requests while it drains: the pool has not heard of it yet
        engine.add_request(f"r{i}", prompts[f"r{i}"], params, 0)
    finished, tokens = {}, {sid: [] for sid in prompts}
    while True:
        for out in outputs:
            tokens[out.seq_id] += out.new_token_ids
            if out.finished:
                finished[out.seq_id] = out.finish_reason
            elif out.seq_id in held:
                assert pool.replica_of(out.seq_id).address == a1  # never moved
        if not engine.has_work:
            break
        outputs = engine.step()
    plain = run_to_completion(make_engine(pair[0]), [(sid, prompt, params, 0) for sid, prompt in prompts.items()])
    assert finished == {sid: FinishReason.LENGTH for sid in prompts}
    assert tokens == {sid: plain[sid][0] for sid in prompts}
    assert first.sessions_started == len(held) and second.sessions_started == 8 - len(held)
    assert [r.retired for r in pool.replicas if r.address == a1] == [True]  # learnt from its refusal
    assert first.drain(timeout_s=5)  # what it held has ended
    assert first.active_sessions == 0 and second.active_sessions == 0


def test_a_draining_draft_replica_takes_no_new_session_and_speculation_goes_on(pair, plain_tokens):
    """Its refusal sends a new session to the other draft replica at once: it drafts from its first round."""
    draining, other = _draft(pair, name="draining"), _draft(pair, name="other")
    servers = [_serve(_target(pair)), _serve(draining), _serve(other)]
    (_, taddr), (_, a1), (_, a2) = servers
    try:
        engine, dpool = _engine(pair, [taddr], [a1, a2])
        draining.start_draining()
        for i in range(3):
            engine.add_request(f"r{i}", PROMPT, GREEDY, 3)
        tokens, drafted = {f"r{i}": [] for i in range(3)}, set()
        while engine.has_work:
            for out in engine.step():
                tokens[out.seq_id] += out.new_token_ids
                if out.round is not None and out.round.proposed_token_ids:
                    drafted.add(out.seq_id)
        assert tokens == {sid: plain_tokens for sid in tokens}
        assert drafted == set(tokens)
        assert (draining.sessions_started, other.sessions_started) == (0, 3)
        assert [r.retired for r in dpool.replicas if r.address == a1] == [True]
    finally:
        for server, _ in servers:
            server.stop(0)


def test_the_internal_services_refuse_callers_without_the_secret(pair):
    """Plaintext (`internal_tls: false`): the secret alone guards every method, GetStats included."""
    servicer = _target(pair)
    server, port = start_server(servicer, "127.0.0.1", credentials=InternalCredentials("s3cret"))
    address = f"127.0.0.1:{port}"
    try:
        from specdec.v1 import worker_pb2 as wpb

        stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(address))
        item = wpb.PrefillRequest.Item(seq_id="x", prompt_token_ids=[5, 6, 7])
        for metadata in (None, [("specdec-internal-token", "wrong")]):
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(wpb.PrefillRequest(items=[item]), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(wpb.GetStatsRequest(), timeout=10, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert servicer.active_sessions == 0  # refused before any work
        pool = ReplicaPool("target", [address], wpb_grpc.TargetServiceStub, timeout_s=10,
                           credentials=InternalCredentials("s3cret"))
        assert pool.info.num_slots == RUNNER.num_slots  # its probe (GetStats) carried the secret
        target, _ = pair
        engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
        out = run_to_completion(engine, [("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0)])["r"]
        assert len(out[0]) == 4 and out[2].error is None
    finally:
        server.stop(0)


def test_a_conversations_next_turn_goes_to_the_replica_that_holds_its_prefix(pair):
    """Placement by load alone would send the second turn to the other replica (ties go to the one that waited
    longest): the pool's prefix affinity sends it where the first turn's KV is cached, and it hits; a request in
    another salt shares nothing, and is placed by load."""
    cached = RunnerConfig(num_slots=4, max_seq_len=256, prefix_caching=True)
    servicers = [TargetServicer(LocalTarget(ModelRunner(pair[0].model, cached)), name) for name in ("one", "two")]
    (s1, a1), (s2, a2) = _serve(servicers[0]), _serve(servicers[1])
    try:
        target, _ = pair
        pool = ReplicaPool("target", [a1, a2], wpb_grpc.TargetServiceStub, timeout_s=30)
        engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
        first = list(range(40, 100))
        where: dict[str, str] = {}

        def turn(name, prompt, salt=None):
            engine.add_request(name, prompt, SamplingParams(max_tokens=8, ignore_eos=True), 0, cache_salt=salt)
            engine.step()  # the prefill: the session is pinned now
            where[name] = pool.replica_of(name).address
            outputs = []
            while engine.has_work:
                outputs += [o for o in engine.step() if o.seq_id == name]
            return outputs[-1]

        one = turn("turn-1", first)
        answer = [t for t in range(8)]  # the second turn resends the history (any answer: only the prefix counts)
        second = first + answer + list(range(200, 210))
        two = turn("turn-2", second)
        assert where["turn-2"] == where["turn-1"]
        assert two.num_cached_tokens >= len(first)
        other = turn("other-salt", second, salt="tenant-b")
        assert where["other-salt"] != where["turn-1"] and other.num_cached_tokens == 0
        assert one.num_cached_tokens == 0
        # What a remote drafter tells the engine a start would find cached (prompts placed, by salt): a third turn
        # likely finds the second's prompt, a salt never placed finds nothing.
        third = second + list(range(300, 320))
        assert pool.likely_cached(third) == len(second) == RemoteDrafter(pool).cached("turn-3", third)
        assert pool.likely_cached(third, "tenant-c") == 0
    finally:
        s1.stop(0)
        s2.stop(0)


def test_a_draft_worker_is_known_to_hold_an_ended_conversation_for_its_next_turn(pair):
    """What the engine asks before starting drafts for a new turn (`RemoteDrafter.cached`): the draft worker keeps
    an ended session's tokens as a prefix-cache entry, and the router remembers them, the answer included, so the
    start of the next turn is priced at its new message alone."""
    tserver, taddr = _serve(_target(pair))
    dserver, daddr = _serve(_draft(pair))
    try:
        engine, _ = _engine(pair, [taddr], [daddr])
        tokens, _, _ = run_to_completion(engine, [("turn-1", PROMPT, GREEDY, 3)])["turn-1"]
        second = PROMPT + tokens + [11, 12, 13]
        held = engine.drafter.cached("turn-2", second)
        # All it read: the answer but its last rounds (those after the last Propose: near the end, room for fewer
        # tokens leaves no room for drafts); at placement it had the prompt alone.
        assert len(PROMPT) + len(tokens) - 10 <= held < len(PROMPT) + len(tokens)
        assert engine.drafter.cached("turn-2", second, "another-salt") == 0
    finally:
        tserver.stop(0)
        dserver.stop(0)


STRUCTURED_PROMPTS = ["def add(a, b):", "The quick brown fox", "class Counter:", "x = 1\ny = 2\n"]


def _structured(target, engine, params, k):
    """The structured prompts through `engine` under `params`: {id: (tokens, text, last output)}, and every round."""
    requests = [(str(i), target.tokenizer(p)["input_ids"], params, k) for i, p in enumerate(STRUCTURED_PROMPTS)]
    for request_id, prompt, p, kk in requests:
        engine.add_request(request_id, prompt, p, kk)
    results, rounds = {r[0]: ([], "", None) for r in requests}, {r[0]: [] for r in requests}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = results[out.seq_id]
            results[out.seq_id] = (tokens + list(out.new_token_ids), text + out.new_text, out)
            rounds[out.seq_id].append((len(tokens), out.round))
    return results, rounds


def _structured_remotely(pair, params, draft):
    """`_structured` over an engine whose target and `draft` servicer serve on loopback: (results, rounds, engine)."""
    tserver, taddr = _serve(_target(pair))
    dserver, daddr = _serve(draft)
    try:
        engine, _ = _engine(pair, [taddr], [daddr])
        got, rounds = _structured(pair[0], engine, params, 3)
    finally:
        tserver.stop(0)
        dserver.stop(0)
    return got, rounds, engine


def test_constrained_requests_over_the_workers_give_constrained_plain_decodings_tokens(pair):
    """The grammar's masks cross to the target worker with every prefill and verify, and the grammar to the draft
    worker: at T = 0 the remote engine's JSON is constrained greedy decoding's, token for token."""
    target, _ = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    params = SamplingParams(max_tokens=80, constraint=constraint)
    expected, _ = _structured(target, make_engine(target), params, 0)
    assert any(last.finish_reason == FinishReason.EOS for _, _, last in expected.values())
    got, _, _ = _structured_remotely(pair, params, _draft(pair))
    assert sum(last.stats.proposed for _, _, last in got.values()) > 0
    for request_id, (tokens, text, last) in expected.items():
        assert got[request_id][0] == tokens and got[request_id][2].finish_reason == last.finish_reason
        if last.finish_reason == FinishReason.EOS:
            assert satisfies_served_schema(json.loads(text)), text


def test_the_draft_worker_samples_its_drafts_from_the_grammars_masked_q(pair):
    """At T = 1 the draft worker gets each session's grammar with its first Propose and masks q with it at every
    step: every proposal stays in the grammar (drawn from the unmasked q, some leave it), and the output belongs to
    it. The worker's grammar follows the committed tokens across rounds of partial acceptance."""
    target, _ = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=60, constraint=constraint)
    draft = _draft(pair)
    got, rounds, engine = _structured_remotely(pair, params, draft)
    compiled = engine.compile(constraint)
    drafted, partial = 0, 0
    for request_id, (tokens, text, last) in got.items():
        assert last.error is None and GrammarState(compiled).advance(tokens) == len(tokens)
        for committed, info in rounds[request_id]:
            if info is None or info.method != "draft_model" or not info.proposed_token_ids:
                continue
            state = GrammarState(compiled)
            state.advance(tokens[:committed])
            proposed = list(info.proposed_token_ids)
            assert state.advance(proposed) == len(proposed), (request_id, committed, proposed)
            drafted += 1
            partial += info.num_accepted < len(proposed)
    assert drafted > 0 and partial > 0
    assert draft.active_sessions == 0 and not draft._grammar_states


def test_a_draft_worker_without_a_compiler_costs_speculation_not_the_request(pair):
    """A draft worker that cannot compile grammars refuses constrained sessions (INVALID_ARGUMENT naming `grammar`):
    the router drops them there and decodes them plainly, with the constrained greedy tokens."""
    target, _ = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    params = SamplingParams(max_tokens=40, constraint=constraint)
    expected, _ = _structured(target, make_engine(target), params, 0)
    got, rounds, _ = _structured_remotely(pair, params, _draft(pair, grammars=False))
    assert {r: g[0] for r, g in got.items()} == {r: e[0] for r, e in expected.items()}
    methods = {info.method for per in rounds.values() for _, info in per if info is not None and info.proposed_token_ids}
    assert methods == {"forced"}  # the grammar's forced tokens still need no draft
