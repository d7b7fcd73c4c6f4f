"""The proposal log: records written off the round's path, read back by `specdec proposals stats`; served with
probabilities, checked against the models' own."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from deployments.proposal_log import ProposalLog
from specdec_core.config import SamplingParams
from specdec_core.models.loader import load_model
from specdec_core.request import Request
from specdec_tools.proposals import format_summary, read_records, summarize
from tests.helpers import logits_after, make_engine, reference_prob


def test_the_log_round_trips_through_proposals_stats(tmp_path, tiny_dir, near_draft_dir):
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    engine = make_engine(target, draft.model)
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="d")
    finals, drafted_rounds = {}, 0
    for i in range(3):
        sid = f"s{i}"
        log.start(sid, f"req-{i}")
        engine.add_request(
            Request(
                sid,
                tuple(range(10 + i, 30 + i)),
                SamplingParams(max_tokens=15, ignore_eos=True),
                num_speculative_tokens=3,
            )
        )
    while engine.has_work:
        for out in engine.step():
            log.observe(out.seq_id, out)
            drafted_rounds += out.round is not None and out.round.k > 0  # rounds with nothing to propose: no record
            if out.finished:
                finals[out.seq_id] = out
    log.close()
    records = list(read_records([tmp_path / "proposals.jsonl"]))
    assert len(records) == drafted_rounds > 0
    assert {r["request_id"] for r in records} == {"req-0", "req-1", "req-2"}
    assert all(set(r) >= {"ts", "round", "position", "k", "proposed", "accepted", "bonus", "method"} for r in records)
    assert {r["method"] for r in records} == {"draft_model"}
    assert not any("p" in r or "q" in r for r in records)  # not asked for
    summary = summarize(records)
    assert "mean_probs" not in summary
    assert summary["proposed"] == sum(f.stats.proposed for f in finals.values())
    assert summary["accepted"] == sum(f.stats.accepted for f in finals.values())
    first = summary["acceptance_by_position"][0]
    assert all(rate <= first + 1e-9 for rate in summary["acceptance_by_position"].values())  # a prefix is kept
    result = subprocess.run(
        [sys.executable, "-m", "specdec_tools.cli", "proposals", "stats", "--json", str(tmp_path / "proposals.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accepted"] == summary["accepted"]


def test_unsampled_requests_leave_no_records(tmp_path, tiny_dir):
    log = ProposalLog(tmp_path, sample_rate=1e-12, target="t", draft="d")
    log.start("s", "r")
    log.close()
    assert list(read_records([tmp_path / "proposals.jsonl"])) == []


APP = "specdec-log"


@pytest.fixture(scope="module")
def served_logging(served, tmp_path_factory):
    """A second application on the session's Serve: the same pair drafting by `hybrid` (draft workers for the model,
    the suffix structure in the router), every request logged with probabilities and 6 tokens of context."""
    from ray import serve

    from deployments.app import build_app
    from deployments.serve_config import parse_config

    address, base = served
    directory = tmp_path_factory.mktemp("proposals")
    config = parse_config(
        {
            **base.model_dump(mode="json"),
            "app_name": APP,
            "draft": {**base.draft.model_dump(mode="json"), "method": "hybrid", "num_replicas": 1},
            "proposal_log": {
                "directory": str(directory),
                "sample_rate": 1.0,
                "include_probs": True,
                "include_context_tokens": 6,
            },
        }
    )
    serve.run(build_app(config), name=APP, route_prefix=f"/{APP}")
    yield address, directory
    serve.delete(APP)


def _generate(address, request_id, prompt, **sampling):
    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(**sampling),
        speculation=pb.SpeculationOptions(num_speculative_tokens=3),
    )
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.GenerationServiceStub(channel).Generate(request, metadata=[("application", APP)], timeout=120)


def _records_of(directory, request_id, response, timeout=30.0):
    """The request's records, once the listener thread has written all of them (its proposals add up)."""
    deadline = time.monotonic() + timeout
    while True:
        path = directory / "proposals.jsonl"
        records = [r for r in read_records([path]) if r["request_id"] == request_id] if path.exists() else []
        if sum(len(r["proposed"]) for r in records) == response.speculation.proposed or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_served_records_carry_the_models_probabilities(served_logging, tiny_dir, near_draft_dir):
    address, directory = served_logging
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    prompt = list(range(5, 30))
    # top_k 50 < the drafter's q support (128): the q it draws from is exactly the processed distribution.
    # The greedy request again: its answer is in the router's suffix structure now, which proposes it.
    cases = {
        "greedy": dict(max_tokens=20, ignore_eos=True),
        "sampled": dict(max_tokens=20, temperature=0.8, top_k=50, seed=3, ignore_eos=True),
        "greedy-again": dict(max_tokens=20, ignore_eos=True),
    }
    everything, accepted_with_probs = [], 0
    for name, sampling in cases.items():
        params = SamplingParams(**sampling)
        response = _generate(address, f"log-{name}", prompt, **sampling)
        records = _records_of(directory, f"log-{name}", response)
        assert sum(len(r["proposed"]) for r in records) == response.speculation.proposed > 0
        output = list(response.token_ids)
        for r in records:
            drafts = r["proposed"]
            assert len(r["p"]) == len(r["q"]) == len(drafts) and all(0 <= v <= 1 for v in r["p"] + r["q"])
            assert r["context"] == (prompt + output[: r["position"]])[-6:]  # the router passes the prompt on
            context = prompt + output[: r["position"]] + drafts
            target_logits, draft_logits = logits_after(target.model, context), logits_after(draft.model, context)
            for i, token in enumerate(drafts):
                row = len(prompt) + r["position"] + i - 1  # the logits that predict draft i
                assert abs(r["p"][i] - reference_prob(target_logits[row], token, params)) < 1e-4
                if r["method"] == "suffix":  # a point mass
                    assert r["q"][i] == 1.0
                    continue
                assert r["method"] == "draft_model"
                assert abs(r["q"][i] - reference_prob(draft_logits[row], token, params)) < 1e-4
                if params.greedy:  # a greedy draft is the draft's argmax; an accepted one is the target's too
                    assert abs(r["q"][i] - float(draft_logits[row].softmax(-1).max())) < 1e-4
                    if i < r["accepted"]:
                        assert abs(r["p"][i] - float(target_logits[row].softmax(-1).max())) < 1e-4
        everything += records
        accepted_with_probs += sum(r["accepted"] for r in records)
    assert {r["method"] for r in everything} == {"draft_model", "suffix"}
    summary = summarize(everything)
    assert summary["mean_probs"]["accepted"]["n"] == accepted_with_probs > 0
    assert "mean draft q / target p" in format_summary(summary)


def test_hybrid_records_say_which_method_proposed(tmp_path, tiny_dir, near_draft_dir):
    """The same prompt twice, one after the other: the second request's answer is in the suffix structure."""
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    engine = make_engine(target, draft.model, hybrid=True)
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="hybrid")
    methods = []
    for i in range(2):
        log.start(f"s{i}", f"req-{i}")
        # A fixed k: which method proposes then follows the acceptance records (not `auto`'s timings).
        engine.add_request(
            Request(
                f"s{i}", tuple(range(10, 30)), SamplingParams(max_tokens=40, ignore_eos=True), num_speculative_tokens=4
            )
        )
        while engine.has_work:
            for out in engine.step():
                log.observe(out.seq_id, out)
                if out.round is not None and out.round.proposed_token_ids:
                    methods.append(out.round.method)
    log.close()
    records = list(read_records([tmp_path / "proposals.jsonl"]))
    assert [r["method"] for r in records if r["proposed"]] == methods
    assert "suffix" in methods


def test_opted_in_records_carry_the_tokens_before_their_round(tmp_path, tiny_dir, near_draft_dir):
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    engine = make_engine(target, draft.model)
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="d", include_context_tokens=8)
    prompt = list(range(10, 30))
    log.start("s", "req", prompt)
    engine.add_request(
        Request("s", tuple(prompt), SamplingParams(max_tokens=20, ignore_eos=True), num_speculative_tokens=3)
    )
    tokens = list(prompt)
    while engine.has_work:
        for out in engine.step():
            log.observe(out.seq_id, out)
            tokens += out.new_token_ids
    log.close()
    records = list(read_records([tmp_path / "proposals.jsonl"]))
    assert records
    for r in records:
        before = len(prompt) + r["position"]  # tokens committed before the round
        assert r["context"] == tokens[before - 8 : before]


def test_context_is_off_by_default(tmp_path, tiny_dir, near_draft_dir):
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    engine = make_engine(target, draft.model)
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="d")
    log.start("s", "req", list(range(10, 30)))
    engine.add_request(
        Request("s", tuple(range(10, 30)), SamplingParams(max_tokens=12, ignore_eos=True), num_speculative_tokens=3)
    )
    while engine.has_work:
        for out in engine.step():
            log.observe(out.seq_id, out)
    log.close()
    records = list(read_records([tmp_path / "proposals.jsonl"]))
    assert records and not any("context" in r for r in records)
