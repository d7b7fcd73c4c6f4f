"""The router's target over the target workers when they fail: real gRPC servers on loopback, no Ray.

A dead target replica must fail only its own requests, a prefill that meets a dead replica goes to a live one, and a
draining replica finishes what it holds; a grammar's masks cross with every prefill and verify.
"""

from __future__ import annotations

import json
import time

import pytest

from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.grammar.constraint import Constraint
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from tests.deployments.loopback_workers import (
    RUNNER,
    draft_servicer,
    serve_locally,
    structured_remotely,
    structured_run,
    target_servicer,
)
from tests.helpers import SERVED_SCHEMA, make_engine, run_to_completion, satisfies_served_schema


@pytest.fixture()
def two_targets(pair):
    """Two target replicas behind one pool, and a target-only engine over it: (engine, pool, servers, servicers)."""
    servicers = (target_servicer(pair, "first"), target_servicer(pair, "second"))
    (s1, a1), (s2, a2) = serve_locally(servicers[0]), serve_locally(servicers[1])
    target, _ = pair
    pool = ReplicaPool("target", [a1, a2], wpb_grpc.TargetServiceStub, timeout_s=30)
    engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
    yield engine, pool, ((s1, a1), (s2, a2)), servicers
    s1.stop(0)
    s2.stop(0)


def test_a_dead_target_replica_fails_only_its_own_requests(two_targets):
    engine, pool, ((s1, a1), _), (_, second) = two_targets
    for i in range(4):
        engine.add_request(
            Request(
                f"r{i}",
                tuple(range(5 + i, 20 + i)),
                SamplingParams(max_tokens=30, ignore_eos=True),
                num_speculative_tokens=0,
            )
        )
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
    results = run_to_completion(
        engine,
        [(f"r{i}", list(range(5 + i, 20 + i)), SamplingParams(max_tokens=5, ignore_eos=True), 0) for i in range(4)],
    )
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
        engine.add_request(Request(f"r{i}", tuple(prompts[f"r{i}"]), params, num_speculative_tokens=0))
    outputs = engine.step()
    held = {sid for sid in (f"r{i}" for i in range(4)) if pool.replica_of(sid).address == a1}
    assert 0 < len(held) < 4  # spread over both
    first.start_draining()
    for i in range(4, 8):  # new requests while it drains: the pool has not heard of it yet
        engine.add_request(Request(f"r{i}", tuple(prompts[f"r{i}"]), params, num_speculative_tokens=0))
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


def test_constrained_requests_over_the_workers_give_constrained_plain_decodings_tokens(pair):
    """The grammar's masks cross to the target worker with every prefill and verify, and the grammar to the draft
    worker: at T = 0 the remote engine's JSON is constrained greedy decoding's, token for token."""
    target, _ = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    params = SamplingParams(max_tokens=80, constraint=constraint)
    expected, _ = structured_run(target, make_engine(target), params, 0)
    assert any(last.finish_reason == FinishReason.EOS for _, _, last in expected.values())
    got, _, _ = structured_remotely(pair, params, draft_servicer(pair))
    assert sum(last.stats.proposed for _, _, last in got.values()) > 0
    for request_id, (tokens, text, last) in expected.items():
        assert got[request_id][0] == tokens and got[request_id][2].finish_reason == last.finish_reason
        if last.finish_reason == FinishReason.EOS:
            assert satisfies_served_schema(json.loads(text)), text


def _greedy(i, max_tokens=20):
    return Request(f"r{i}", tuple(range(5 + i, 20 + i)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0)


def _step_to_end(engine, results):
    """Step until the engine is idle, adding each output to `results` ({seq_id: (tokens, last output)})."""
    while engine.has_work:
        for out in engine.step():
            tokens, _ = results.get(out.seq_id, ([], None))
            results[out.seq_id] = (tokens + list(out.new_token_ids), out)
    return results


def _alone(pair, request):
    engine = make_engine(pair[0])
    engine.add_request(request)
    return _step_to_end(engine, {})[request.seq_id][0]


def test_a_prefill_that_outlives_its_timeout_costs_no_other_request_and_leaks_nothing(pair):
    """r2's prefill stalls past the router's timeout on the replica it was placed on: r2 starts on the other one,
    unseen by its client; r0 and r1, running on both replicas, go on as if nothing happened (the stalled replica
    answers their next verify); the late prefill keeps nothing on the worker, and at the end no worker holds a
    session."""
    servicers = (target_servicer(pair, "first"), target_servicer(pair, "second"))
    servers = [serve_locally(s) for s in servicers]
    pool = ReplicaPool("target", [a for _, a in servers], wpb_grpc.TargetServiceStub, timeout_s=3.0)
    engine = SpecEngine(RemoteTarget(pool), None, pair[0].tokenizer, pair[0].eos_token_ids)
    stalled = []
    for servicer in servicers:

        def slow_once(items, prefill=servicer.target.prefill, servicer=servicer):
            if any(item.seq_id == "r2" for item in items) and not stalled:
                stalled.append(servicer)
                time.sleep(4.5)  # past the router's timeout; shorter than the timeout plus one verify's wait
            return prefill(items)

        servicer.target.prefill = slow_once
    requests = [_greedy(i) for i in range(3)]
    try:
        for request in requests[:2]:
            engine.add_request(request)
        results = {out.seq_id: (list(out.new_token_ids), out) for out in engine.step()}
        assert {pool.replica_of("r0").address, pool.replica_of("r1").address} == {a for _, a in servers}
        engine.add_request(requests[2])
        _step_to_end(engine, results)
        time.sleep(2.0)  # the stalled prefill ends on its worker
        held = [servicer.active_sessions for servicer in servicers]
    finally:
        for server, _ in servers:
            server.stop(0)
    assert stalled  # the fault happened
    for request in requests:
        tokens, last = results[request.seq_id]
        assert tokens == _alone(pair, request) and last.error is None, request.seq_id
    assert held == [0, 0]


def test_routers_sharing_a_worker_wait_for_its_slots_instead_of_failing(pair):
    """Two routers, one target worker of four slots: the first fills it; the second, which counted four free
    slots when it started, admits its requests as the worker's slots come free, every one exact, none refused."""
    servicer = target_servicer(pair, "shared")
    server, address = serve_locally(servicer)
    engines = [
        SpecEngine(
            RemoteTarget(ReplicaPool("target", [address], wpb_grpc.TargetServiceStub, timeout_s=30)),
            None,
            pair[0].tokenizer,
            pair[0].eos_token_ids,
        )
        for _ in range(2)
    ]
    first = [_greedy(i, max_tokens=8) for i in range(4)]
    second = [_greedy(i, max_tokens=8) for i in range(4, 7)]
    try:
        for request in first:
            engines[0].add_request(request)
        results = {out.seq_id: (list(out.new_token_ids), out) for out in engines[0].step()}  # the worker is full
        for request in second:
            engines[1].add_request(request)
        while any(engine.has_work for engine in engines):
            for engine in engines:
                for out in engine.step() if engine.has_work else []:
                    tokens, _ = results.get(out.seq_id, ([], None))
                    results[out.seq_id] = (tokens + list(out.new_token_ids), out)
            time.sleep(0.01)
        held = servicer.active_sessions
    finally:
        server.stop(0)
    for request in first + second:
        tokens, last = results[request.seq_id]
        assert last.error is None and tokens == _alone(pair, request), request.seq_id
    assert held == 0


def test_a_routers_count_of_free_slots_comes_back_as_its_sessions_end(pair):
    """Two requests end one after the other: the last verify of the first finds the other's slot taken, yet once
    both are released the router counts every slot free again, without asking the worker (no under-admission)."""
    servicer = target_servicer(pair, "only")
    server, address = serve_locally(servicer)
    pool = ReplicaPool("target", [address], wpb_grpc.TargetServiceStub, timeout_s=30)
    engine = SpecEngine(RemoteTarget(pool), None, pair[0].tokenizer, pair[0].eos_token_ids)
    try:
        results = {}
        for request in (_greedy(0, max_tokens=4), _greedy(1, max_tokens=9)):
            engine.add_request(request)
        _step_to_end(engine, results)
        free = engine.target.free_slots
    finally:
        server.stop(0)
    assert free == servicer.num_slots == RUNNER.num_slots
