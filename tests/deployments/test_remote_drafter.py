"""The router's drafter over the draft workers when they fail: real gRPC servers on loopback, no Ray.

A draft replica that dies, stalls or drains must cost speculation only (the output stays exactly the target's); the
grammar of a constrained session goes to its draft worker, which drafts inside it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from deployments.workers import DraftServicer
from specdec_core.config import SamplingParams
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from tests.deployments.loopback_workers import (
    GREEDY,
    PROMPT,
    draft_servicer,
    remote_engine,
    run_steps,
    serve_locally,
    structured_remotely,
    structured_run,
    target_servicer,
)
from tests.helpers import SERVED_SCHEMA, make_engine, run_to_completion


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


def test_a_dead_draft_replica_costs_speculation_not_the_request(pair, plain_tokens):
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(draft_servicer(pair))
    spare_server, spare_addr = serve_locally(draft_servicer(pair, name="spare"))
    try:
        engine, dpool = remote_engine(pair, [taddr], [daddr])
        engine.add_request(Request("r", tuple(PROMPT), GREEDY, num_speculative_tokens=3))
        events = {"killed_at": None, "back_at": None}

        def chaos(rounds):
            if events["killed_at"] is None and len(rounds) == 3:
                dserver.stop(0).wait()  # the draft replica dies mid-request
                events["killed_at"] = len(rounds)
            elif (
                events["killed_at"] is not None and events["back_at"] is None and len(rounds) == events["killed_at"] + 3
            ):
                dpool.update([daddr, spare_addr])  # its replacement registers
                events["back_at"] = len(rounds)

        tokens, rounds, last = run_steps(engine, chaos)
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
    stalling = draft_servicer(pair, StallingDraft)
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(stalling)
    try:
        engine, _ = remote_engine(pair, [taddr], [daddr], draft_timeout_s=0.5)
        engine.add_request(Request("r", tuple(PROMPT), GREEDY, num_speculative_tokens=3))

        def stall(rounds):
            if len(rounds) == 2:
                stalling.stalled.set()

        tokens, rounds, last = run_steps(engine, stall)
        assert tokens == plain_tokens and last.error is None
        assert any(not r.proposed_token_ids for r in rounds[2:])
    finally:
        stalling.released.set()
        tserver.stop(0)
        dserver.stop(0)


class SlowStartDraft(DraftServicer):
    """A draft worker whose first Start outlives the router's timeout (a long GC): it starts the session late."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalls = 1

    def Start(self, request, context):
        if self.stalls:
            self.stalls -= 1
            time.sleep(1.5)
        return super().Start(request, context)


def test_a_start_that_outlives_its_timeout_leaves_the_session_free_to_start_again(pair, plain_tokens):
    """The router gives up on the Start and the worker starts the session late: the worker keeps nothing of it,
    the same session is started there again once the replica answers a probe, drafts for the rest of the
    request, and the worker holds no session at the end."""
    slow = draft_servicer(pair, SlowStartDraft)
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(slow)
    try:
        engine, dpool = remote_engine(pair, [taddr], [daddr], draft_timeout_s=0.5)
        engine.add_request(Request("r", tuple(PROMPT), GREEDY, num_speculative_tokens=3))

        def follow(rounds):  # what the router's worker follower does after a failure
            if not dpool.has_usable:
                time.sleep(1.5)  # the late Start ends on the worker
                dpool.update([daddr])

        tokens, rounds, last = run_steps(engine, follow)
        held = slow.active_sessions
    finally:
        tserver.stop(0)
        dserver.stop(0)
    assert slow.stalls == 0  # the fault happened
    assert tokens == plain_tokens and last.error is None
    assert any(r.proposed_token_ids for r in rounds[3:])  # drafting again
    assert held == 0


def test_a_draining_draft_replica_takes_no_new_session_and_speculation_goes_on(pair, plain_tokens):
    """Its refusal sends a new session to the other draft replica at once: it drafts from its first round."""
    draining, other = draft_servicer(pair, name="draining"), draft_servicer(pair, name="other")
    servers = [serve_locally(target_servicer(pair)), serve_locally(draining), serve_locally(other)]
    (_, taddr), (_, a1), (_, a2) = servers
    try:
        engine, dpool = remote_engine(pair, [taddr], [a1, a2])
        draining.start_draining()
        for i in range(3):
            engine.add_request(Request(f"r{i}", tuple(PROMPT), GREEDY, num_speculative_tokens=3))
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


def test_a_draft_worker_is_known_to_hold_an_ended_conversation_for_its_next_turn(pair):
    """What the engine asks before starting drafts for a new turn (`RemoteDrafter.cached`): the draft worker keeps
    an ended session's tokens as a prefix-cache entry, and the router remembers them, the answer included, so the
    start of the next turn is priced at its new message alone."""
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(draft_servicer(pair))
    try:
        engine, _ = remote_engine(pair, [taddr], [daddr])
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


def test_the_draft_worker_samples_its_drafts_from_the_grammars_masked_q(pair):
    """At T = 1 the draft worker gets each session's grammar with its first Propose and masks q with it at every
    step: every proposal stays in the grammar (drawn from the unmasked q, some leave it), and the output belongs to
    it. The worker's grammar follows the committed tokens across rounds of partial acceptance."""
    target, _ = pair
    constraint = Constraint("json_schema", json.dumps(SERVED_SCHEMA), compact=True)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=60, constraint=constraint)
    draft = draft_servicer(pair)
    got, rounds, engine = structured_remotely(pair, params, draft)
    compiled = engine.compile(constraint)
    drafted, partial = 0, 0
    for request_id, (tokens, _text, last) in got.items():
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
    expected, _ = structured_run(target, make_engine(target), params, 0)
    got, rounds, _ = structured_remotely(pair, params, draft_servicer(pair, grammars=False))
    assert {r: g[0] for r, g in got.items()} == {r: e[0] for r, e in expected.items()}
    methods = {
        info.method for per in rounds.values() for _, info in per if info is not None and info.proposed_token_ids
    }
    assert methods == {"forced"}  # the grammar's forced tokens still need no draft


@pytest.mark.parametrize("sampled", [False, True])
def test_pre_drafting_over_the_draft_workers_uses_branches_and_changes_no_greedy_token(pair, plain_tokens, sampled):
    """`overlap: on` over real gRPC: each Propose of a pre-draft carries the drafts under verification as assumed
    tokens, which the worker drafts on and never keeps as committed. Greedy output stays plain decoding's; a seeded
    sampled request runs to its end with branches used (its law: `test_statistical.py`)."""
    from specdec_core.engine import EngineConfig

    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(draft_servicer(pair))
    try:
        engine, _ = remote_engine(pair, [taddr], [daddr], config=EngineConfig(overlap="on"))
        sampling = SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0, top_k=2, seed=5)
        engine.add_request(Request("r", tuple(PROMPT), sampling if sampled else GREEDY, num_speculative_tokens=2))
        tokens, rounds, last = run_steps(engine)
        assert last.finish_reason == FinishReason.LENGTH and len(tokens) == 60
        if not sampled:
            assert tokens == plain_tokens
        assert engine.overlap.hits > 0 and any(r.predrafted for r in rounds if r is not None)
        # Greedy pre-drafts also cover rejections (`Proposal.alternatives` over the wire), and some are used.
        assert (engine.overlap.rejection_hits > 0) is not sampled
    finally:
        tserver.stop(0)
        dserver.stop(0)


def test_a_split_batch_over_the_draft_workers_changes_no_greedy_token(pair):
    """Two groups taking turns over real gRPC: the draft worker drafts one group's next proposals while the target
    verifies the other; every request's output is plain decoding's."""
    from specdec_core.engine import EngineConfig

    target, _ = pair
    prompts = [list(PROMPT), list(PROMPT[:5]), list(PROMPT[2:]), [*PROMPT, 7]]
    expected = run_to_completion(make_engine(target), [(str(i), p, GREEDY, 0) for i, p in enumerate(prompts)])
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(draft_servicer(pair))
    try:
        config = EngineConfig(overlap="on", split_batches=True)
        engine, _ = remote_engine(pair, [taddr], [daddr], config=config)
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(str(i), tuple(prompt), GREEDY, num_speculative_tokens=2))
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        split = 0
        while engine.has_work:
            for out in engine.step():
                got[out.seq_id] += out.new_token_ids
                split += out.round is not None and out.round.split
        assert got == {r: e[0] for r, e in expected.items()}
        assert engine.overlap.split_rounds > 0 and split > 0
    finally:
        tserver.stop(0)
        dserver.stop(0)
