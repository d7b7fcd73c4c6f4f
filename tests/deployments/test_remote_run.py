"""Runs of plain steps on the target workers (Decode, StopDecode) over real gRPC on loopback, no Ray: the tokens of
in-process plain decoding, a router that cuts in, a replica that dies mid-run, a caller that goes away."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from deployments import worker_codec
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams, TokenShaping
from specdec_core.decode_run import DecodeItem
from specdec_core.engine import SpecEngine
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from specdec_core.target import PrefillItem
from tests.deployments.loopback_workers import serve_locally, target_servicer
from tests.helpers import drive, make_engine


@pytest.fixture()
def two_targets(pair):
    """Two target replicas behind one pool and an engine over it: (engine, pool, servers, servicers)."""
    servicers = (target_servicer(pair, "first"), target_servicer(pair, "second"))
    servers = [serve_locally(s) for s in servicers]
    pool = ReplicaPool("target", [a for _, a in servers], wpb_grpc.TargetServiceStub, timeout_s=30)
    engine = SpecEngine(RemoteTarget(pool), None, pair[0].tokenizer, pair[0].eos_token_ids)
    yield engine, pool, servers, servicers
    for server, _ in servers:
        server.stop(0)


def _request(i, temperature=0.0, max_tokens=30):
    params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
    return Request(f"r{i}", tuple(range(5 + i, 20 + i)), params, 0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_runs_on_the_workers_give_in_process_plain_decodings_tokens(pair, two_targets, temperature):
    """Four requests over two replicas, one arriving mid-run (the router cuts in): the tokens of in-process plain
    decoding, round by round; each worker stepped by itself; nothing held at the end."""
    engine, pool, _, servicers = two_targets
    arrivals = [(0, _request(0, temperature)), (0, _request(1, temperature)), (0, _request(2, temperature, 12))]
    arrivals.append((6, _request(3, temperature, 20)))
    expected = drive(make_engine(pair[0], plain_runs=False), arrivals)
    got = drive(engine, arrivals)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in expected.items()}
    assert all(out.finish_reason == FinishReason.LENGTH for _, out in got.values())
    assert [s.active_sessions for s in servicers] == [0, 0]
    assert sum(s.calls for s in servicers) > 60  # a call a step: the runs' steps are counted as the worker's calls


def test_a_replica_that_dies_mid_run_fails_only_its_own_rows(two_targets):
    engine, pool, servers, servicers = two_targets
    for i in range(4):
        engine.add_request(_request(i, max_tokens=60))
    results = {}
    for _ in range(4):
        for out in engine.step():
            results[out.seq_id] = out
    first = servers[0][1]
    on_first = {f"r{i}" for i in range(4) if pool.replica_of(f"r{i}").address == first}
    assert 0 < len(on_first) < 4 and engine._run is not None  # a run is under way on both
    servers[0][0].stop(0).wait()
    while engine.has_work:
        for out in engine.step():
            results[out.seq_id] = out
    assert {r for r, o in results.items() if o.finish_reason == FinishReason.ERROR} == on_first
    assert all(o.finish_reason == FinishReason.LENGTH for r, o in results.items() if r not in on_first)
    assert servicers[1].active_sessions == 0


@pytest.fixture()
def one_target(pair):
    """One target worker on loopback: (servicer, address)."""
    servicer = target_servicer(pair)
    server, address = serve_locally(servicer)
    yield servicer, address
    server.stop(0)


def _started(address, n=2, temperature=0.0):
    """`n` sessions prefilled on the worker at `address`; a stub to it and their first tokens."""
    stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(address))
    shaping = TokenShaping(temperature=temperature)
    items = [
        PrefillItem(f"s{i}", list(range(5 + i, 20 + i)), shaping, None if shaping.greedy else 0.5) for i in range(n)
    ]
    response = stub.Prefill(worker_codec.encode_prefill(items))
    return stub, list(response.first_token_ids)


def test_stop_decode_ends_the_stream_after_the_step_under_way(one_target):
    servicer, address = one_target
    stub, first = _started(address)
    items = [DecodeItem(f"s{i}", first[i], TokenShaping(), None, 200, frozenset()) for i in range(2)]
    stream = stub.Decode(worker_codec.encode_decode("run-1", items))
    steps = [next(stream), next(stream)]
    assert stub.StopDecode(wpb.StopDecodeRequest(run_id="run-1")).stopped
    steps += list(stream)
    assert 2 <= len(steps) <= 4  # at most the step under way, and the one already queued, after the stop
    assert not stub.StopDecode(wpb.StopDecodeRequest(run_id="run-1")).stopped
    assert servicer.active_sessions == 2  # stopped, not failed: the sessions go on


def test_a_run_whose_caller_went_away_keeps_nothing(one_target):
    servicer, address = one_target
    stub, first = _started(address)
    items = [DecodeItem(f"s{i}", first[i], TokenShaping(), None, 200, frozenset()) for i in range(2)]
    stream = stub.Decode(worker_codec.encode_decode("run-2", items))
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while servicer.active_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servicer.active_sessions == 0


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda item: item.uniforms.extend([0.5, 1.5]), "items.uniforms"),
        (lambda item: setattr(item, "last_token_id", 10**6), "items.last_token_id"),
        (lambda item: setattr(item, "max_steps", 0), "items.max_steps"),
    ],
)
def test_bad_run_items_are_refused_naming_the_field(one_target, change, field):
    servicer, address = one_target
    stub, first = _started(address, n=1, temperature=1.0)
    request = worker_codec.encode_decode(
        "run-3", [DecodeItem("s0", first[0], TokenShaping(1.0), (0.5, 0.5), 2, frozenset())]
    )
    change(request.items[0])
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Decode(request))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in raised.value.details()
    assert servicer.active_sessions == 1  # refused before it touched the session


def test_a_run_of_a_session_the_worker_does_not_hold_is_not_found(one_target):
    servicer, address = one_target
    stub = wpb_grpc.TargetServiceStub(grpc.insecure_channel(address))
    request = worker_codec.encode_decode("run-4", [DecodeItem("nobody", 1, TokenShaping(), None, 2, frozenset())])
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Decode(request))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_other_callers_calls_go_between_a_runs_steps(one_target):
    """A run holds the worker's lock a step at a time: another router's prefill starts while it runs."""
    servicer, address = one_target
    stub, first = _started(address, n=1)
    stream = stub.Decode(
        worker_codec.encode_decode("run-5", [DecodeItem("s0", first[0], TokenShaping(), None, 150, frozenset())])
    )
    next(stream)
    done = threading.Event()

    def prefill():
        item = PrefillItem("other", list(range(30, 40)), TokenShaping(), None)
        stub.Prefill(worker_codec.encode_prefill([item]))
        done.set()

    threading.Thread(target=prefill, daemon=True).start()
    assert done.wait(20)
    remaining = list(stream)
    assert remaining and servicer.active_sessions == 2  # the run went on after the prefill
