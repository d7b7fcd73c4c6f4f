"""Several draft variants behind one engine: each sequence drafts with its own variant for its whole life, rows of
several variants share a round's verify, and greedy output stays plain decoding's whichever variant drafted."""

from __future__ import annotations

import pytest

from specdec_core.config import SamplingParams
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.variants import VariantDrafter
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget
from tests.helpers import contrarian, make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
PROMPTS = {f"r{i}": [5 + i, 6, 7, 8 + i, 9, 10] for i in range(6)}


class Recording:
    """A drafter that proposes a fixed token and records every call it gets."""

    def __init__(self, name: str, token: int) -> None:
        self.name, self.token, self.calls = name, token, []

    def start(self, seq_id, prompt_ids, cache_salt=None):
        self.calls.append(("start", seq_id))
        return 0

    def cached(self, seq_id, token_ids, cache_salt=None):
        self.calls.append(("cached", seq_id))
        return 0

    def propose(self, requests):
        self.calls.append(("propose", tuple(r.seq_id for r in requests)))
        return [Proposal([self.token] * r.num_tokens, None) for r in requests]

    def observe(self, seq_id, num_committed):
        self.calls.append(("observe", seq_id))

    def release(self, seq_id):
        self.calls.append(("release", seq_id))


def _request(seq_id: str, k: int = 2) -> DraftRequest:
    return DraftRequest(seq_id=seq_id, token_ids=[1, 2], num_tokens=k, shaping=GREEDY.shaping, uniform=None)


def test_each_sequence_is_served_by_its_variant_and_rows_keep_their_order():
    a, b = Recording("draft_model", 7), Recording("draft_model", 9)
    variants = VariantDrafter({"a": a, "b": b}, default="a")
    variants.assign("s1", "b")
    variants.assign("s2", "a")
    variants.cached("s1", [1])
    variants.start("s1", [1])
    proposals = variants.propose([_request("s1"), _request("s2"), _request("s3"), _request("s4", k=3)])
    # s3 and s4 were never assigned: the default's
    assert [p.token_ids for p in proposals] == [[9, 9], [7, 7], [7, 7], [7, 7, 7]]
    assert ("propose", ("s1",)) in b.calls and ("propose", ("s2", "s3", "s4")) in a.calls
    variants.observe("s1", 3)
    variants.release("s1")
    assert b.calls[:2] == [("cached", "s1"), ("start", "s1")] and b.calls[-2:] == [("observe", "s1"), ("release", "s1")]
    assert not any("s1" in (seqs if call == "propose" else (seqs,)) for call, seqs in a.calls)
    variants.forget("s1")
    assert variants.variant_of("s1") == "a"
    with pytest.raises(KeyError):
        variants.assign("s5", "c")
    with pytest.raises(ValueError, match="default"):
        VariantDrafter({"a": a}, default="b")
    variants.close()


def test_a_failing_variant_fails_the_call():
    class Failing(Recording):
        def propose(self, requests):
            raise RuntimeError("draft replica lost")

    variants = VariantDrafter({"a": Recording("draft_model", 7), "b": Failing("draft_model", 9)}, default="a")
    variants.assign("s1", "b")
    with pytest.raises(RuntimeError, match="replica lost"):
        variants.propose([_request("s0"), _request("s1")])
    variants.close()


def test_greedy_output_is_plain_decodings_whichever_variant_drafts(pair):
    """A good draft and a contrarian one (wrong wherever it can be) share the engine's rounds: both give plain
    decoding's tokens, and each request's acceptance is its own variant's."""
    target, draft = pair
    expected = run_to_completion(make_engine(target), [(s, p, GREEDY, 0) for s, p in PROMPTS.items()])
    config = RunnerConfig(num_slots=8, max_seq_len=256)
    runner = ModelRunner(target.model, config)
    good = DraftModelDrafter(ModelRunner(draft.model, config), runner.vocab_size)
    bad = DraftModelDrafter(ModelRunner(contrarian(draft.model), config), runner.vocab_size)
    variants = VariantDrafter({"good": good, "bad": bad}, default="good")
    engine = SpecEngine(
        LocalTarget(runner), variants, target.tokenizer, target.eos_token_ids, EngineConfig(max_speculative_tokens=4)
    )
    assigned = {s: ("good", "bad")[i % 2] for i, s in enumerate(PROMPTS)}
    for seq_id, variant in assigned.items():
        variants.assign(seq_id, variant)
    got = run_to_completion(engine, [(s, p, GREEDY, 3) for s, p in PROMPTS.items()])
    assert {s: tokens for s, (tokens, *_) in got.items()} == {s: tokens for s, (tokens, *_) in expected.items()}
    rates = {v: [got[s][2].stats.acceptance_rate for s in PROMPTS if assigned[s] == v] for v in ("good", "bad")}
    assert min(rates["good"]) > max(rates["bad"])
    variants.close()
