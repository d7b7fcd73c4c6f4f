"""The application over several Ray nodes (conftest.py): every deployment and rank on the node its resources name,
the two target ranks on two nodes over gloo on the interface the config names, served greedy output equal to the
unsplit model's plain decoding. Then nodes lost under load, in this order: the draft's node (the stream finishes
with plain decoding's tokens; speculation resumes once a draft node joins) and a node holding a target rank (its
requests end with UNAVAILABLE within the RPC timeout; Serve replaces the replica once a target node joins; no
session is left behind in the workers that survive)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import ray
from ray.util.state import list_actors

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.models.loader import load_model
from tests.cluster.conftest import APP, RPC_TIMEOUT_S
from tests.helpers import make_engine, run_to_completion

K = 3
LONG = 460  # output tokens of a stream that a node is taken from: 20 + 460 fit the router's max_seq_len of 512
REPLACED_S = 300.0  # how long Serve may take to start a replacement replica on a node that joins


@pytest.fixture(scope="module")
def plain(tiny_dir):
    """Greedy plain decoding of the unsplit tiny target, in this process: the tokens every served run must give."""
    target = load_model(tiny_dir / "target", dtype="float32")

    def tokens(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return run_to_completion(make_engine(target, max_seq_len=512), [("r", prompt, params, 0)])["r"][0]

    return tokens


def request(prompt: list[int], max_tokens: int, k: int = K) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )
    message.speculation.num_speculative_tokens = k
    return message


def placement() -> dict[str, list[dict]]:
    """The live actors of the application and of Serve's proxies, by role, from Ray's state API."""
    roles: dict[str, list[dict]] = {"router": [], "draft": [], "target": [], "rank": [], "proxy": [], "registry": []}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, raise_on_missing_output=False):
        name, entry = actor.name or "", {"node_id": actor.node_id, "pid": actor.pid, "name": actor.name}
        for role, part in (
            ("router", f"{APP}#Router"),
            ("draft", f"{APP}#DraftWorker#"),
            ("target", f"{APP}#TargetWorker#"),
            ("rank", "specdec-target-rank-"),
            ("registry", "specdec-registry"),
        ):
            if part in name:
                roles[role].append(entry)
        if actor.class_name == "ProxyActor":
            roles["proxy"].append(entry)
    return roles


def nodes_of(role: str) -> list[str]:
    return sorted(a["node_id"] for a in placement()[role])


def until(what: str, check, timeout_s: float = REPLACED_S):
    """Poll `check` until it returns something true; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(1.0)


def sessions_held(config) -> dict[str, int]:
    """Active sessions of every worker replica that answers GetStats (registered replicas on lost nodes do not)."""
    from deployments import worker_registry as registry
    from deployments.auth import dial
    from deployments.tls import Role

    credentials = registry.credentials(config.app_name, Role.CLIENT)
    held = {}
    for kind, stub_type in (("target", wpb_grpc.TargetServiceStub), ("draft", wpb_grpc.DraftServiceStub)):
        for address in ray.get(registry.registry().addresses.remote(config.app_name, kind)):
            with dial(address, credentials) as channel:
                try:
                    stats = stub_type(channel).GetStats(wpb.GetStatsRequest(), timeout=5)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    continue
            held[f"{kind} {address}"] = stats.active_sessions
    return held


def assert_idle(config) -> None:
    """Every answering worker, one of each kind at least, ends with no session."""

    def idle():
        held = sessions_held(config)
        kinds = {name.split()[0] for name in held}
        return kinds == {"target", "draft"} and not any(held.values())

    until(f"the workers let go of every session: {sessions_held(config)}", idle, timeout_s=60)


def test_each_deployment_and_rank_runs_where_its_resources_say(stack):
    where = {role: sorted(a["node_id"] for a in actors) for role, actors in placement().items()}
    targets = sorted(stack.nodes["target"])
    assert where["router"] == [stack.head_id], where
    assert where["proxy"] == [stack.head_id], where  # proxy_location: HeadOnly
    assert where["registry"] == [stack.head_id], where  # never on a node that may be lost
    assert where["draft"] == sorted(stack.nodes["draft"]), where
    # STRICT_SPREAD: a rank on each target node, though either node has room for both.
    assert sorted(where["target"] + where["rank"]) == targets, where


def test_the_ranks_collectives_use_the_configured_interface(stack):
    """socket_ifname reaches the environment of every rank's process: the replica (rank 0) and its rank actor."""
    ranks = placement()["target"] + placement()["rank"]
    assert len(ranks) == 2, ranks
    for actor in ranks:
        environ = Path(f"/proc/{actor['pid']}/environ").read_bytes().split(b"\0")
        assert b"GLOO_SOCKET_IFNAME=lo" in environ and b"NCCL_SOCKET_IFNAME=lo" in environ, actor


def test_greedy_output_over_the_nodes_is_the_unsplit_models(stack, generation, plain):
    accepted = 0
    for prompt in (list(range(5, 30)), list(range(90, 97)), list(range(200, 230))):
        response = generation.Generate(request(prompt, 24), timeout=120)
        assert list(response.token_ids) == plain(prompt, 24), prompt
        accepted += response.speculation.accepted
    assert accepted > 0  # the draft on its own node did speculate
    assert_idle(stack.config)


def test_losing_the_draft_node_costs_speculation_not_the_stream(stack, generation, plain, record_property):
    prompt = list(range(5, 25))
    (lost,) = nodes_of("draft")
    stream = generation.GenerateStream(request(prompt, LONG), timeout=300)
    chunks = [next(stream), next(stream)]
    stack.remove_node(lost)
    chunks += list(stream)
    assert [t for c in chunks for t in c.token_ids] == plain(prompt, LONG)
    last = chunks[-1]
    record_property("rounds_proposed", (last.speculation.rounds, last.speculation.proposed))
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.speculation.proposed < K * last.speculation.rounds - 2 * K, "no round went without drafts"

    joined = stack.add_node("draft")

    def speculating():
        response = generation.Generate(request([7, 8, 9, 10], 12), timeout=120)
        return response.speculation.proposed > 0

    until("speculation again, through a draft replica on the node that joined", speculating)
    assert nodes_of("draft") == [joined]
    assert_idle(stack.config)


def test_losing_a_target_rank_node_fails_its_requests_in_time_then_a_new_replica_serves(
    stack, generation, plain, record_property
):
    prompt = list(range(30, 50))
    (rank,) = placement()["rank"]
    (replica,) = placement()["target"]
    survivor = replica["node_id"]
    stream = generation.GenerateStream(request(prompt, LONG), timeout=300)
    chunks = [next(stream), next(stream)]
    stack.remove_node(rank["node_id"])
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        chunks += list(stream)
    waited = time.monotonic() - start
    record_property("unavailable_after_s", round(waited, 2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    # Bounded by the RPC timeout (the router's call, the ranks' collectives), with room for a loaded machine.
    assert waited < RPC_TIMEOUT_S + 30, f"the request ended {waited:.0f} s after its rank's node was lost"
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == plain(prompt, LONG)[: len(tokens)]  # nothing duplicated or missing before the error

    joined = stack.add_node("target")

    def serving():
        try:
            return generation.Generate(request([5, 6, 7, 8], 12), timeout=120)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None

    response = until("a request served by a replacement target replica", serving)
    assert list(response.token_ids) == plain([5, 6, 7, 8], 12)
    until(
        "Serve stopped the replica that lost its rank",
        lambda: replica["name"] not in [a["name"] for a in placement()["target"]],
    )
    assert sorted(nodes_of("target") + nodes_of("rank")) == sorted([survivor, joined])
    assert_idle(stack.config)
