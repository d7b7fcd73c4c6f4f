"""The proposal log: records written off the round's path, read back by `specdec proposals stats`."""

from __future__ import annotations

import json
import subprocess
import sys

from deployments.proposals import ProposalLog, read_records, summarize
from specdec_core.config import SamplingParams
from specdec_core.models.loader import load_model
from tests.helpers import make_engine


def test_the_log_round_trips_through_proposals_stats(tmp_path, tiny_dir, near_draft_dir):
    target, draft = load_model(tiny_dir / "target", dtype="float32"), load_model(near_draft_dir, dtype="float32")
    engine = make_engine(target, draft.model)
    log = ProposalLog(tmp_path, sample_rate=1.0, target="t", draft="d")
    finals, drafted_rounds = {}, 0
    for i in range(3):
        sid = f"s{i}"
        log.start(sid, f"req-{i}")
        engine.add_request(sid, list(range(10 + i, 30 + i)), SamplingParams(max_tokens=15, ignore_eos=True), 3)
    while engine.has_work:
        for out in engine.step():
            log.observe(out.request_id, out)
            drafted_rounds += out.round is not None and out.round.k > 0  # rounds with nothing to propose: no record
            if out.finished:
                finals[out.request_id] = out
    log.close()
    records = list(read_records([tmp_path / "proposals.jsonl"]))
    assert len(records) == drafted_rounds > 0
    assert {r["request_id"] for r in records} == {"req-0", "req-1", "req-2"}
    assert all(set(r) >= {"ts", "round", "position", "k", "proposed", "accepted", "bonus"} for r in records)
    summary = summarize(records)
    assert summary["proposed"] == sum(f.stats.proposed for f in finals.values())
    assert summary["accepted"] == sum(f.stats.accepted for f in finals.values())
    first = summary["acceptance_by_position"][0]
    assert all(rate <= first + 1e-9 for rate in summary["acceptance_by_position"].values())  # a prefix is kept
    result = subprocess.run(
        [sys.executable, "-m", "specdec_core.cli.main", "proposals", "stats", "--json", str(tmp_path / "proposals.jsonl")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accepted"] == summary["accepted"]


def test_unsampled_requests_leave_no_records(tmp_path, tiny_dir):
    log = ProposalLog(tmp_path, sample_rate=1e-12, target="t", draft="d")
    log.start("s", "r")
    log.close()
    assert list(read_records([tmp_path / "proposals.jsonl"])) == []
