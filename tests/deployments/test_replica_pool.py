"""The router's replica pools over real gRPC servers on loopback, no Ray: what they present to the workers, and
where they place a new session."""

from __future__ import annotations

import grpc
import pytest

from deployments.auth import InternalCredentials
from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.workers import TargetServicer, start_server
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget
from tests.deployments.loopback_workers import RUNNER, serve_locally, target_servicer
from tests.helpers import run_to_completion


def test_the_internal_services_refuse_callers_without_the_secret(pair):
    """Plaintext (`internal_tls: false`): the secret alone guards every method, GetStats included."""
    servicer = target_servicer(pair)
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
        pool = ReplicaPool(
            "target", [address], wpb_grpc.TargetServiceStub, timeout_s=10, credentials=InternalCredentials("s3cret")
        )
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
    (s1, a1), (s2, a2) = serve_locally(servicers[0]), serve_locally(servicers[1])
    try:
        target, _ = pair
        pool = ReplicaPool("target", [a1, a2], wpb_grpc.TargetServiceStub, timeout_s=30)
        engine = SpecEngine(RemoteTarget(pool), None, target.tokenizer, target.eos_token_ids)
        first = list(range(40, 100))
        where: dict[str, str] = {}

        def turn(name, prompt, salt=None):
            engine.add_request(
                Request(
                    name,
                    tuple(prompt),
                    SamplingParams(max_tokens=8, ignore_eos=True),
                    num_speculative_tokens=0,
                    cache_salt=salt,
                )
            )
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
