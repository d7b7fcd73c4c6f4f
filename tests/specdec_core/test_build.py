"""`build_engine`: an engine for every registered drafting method, and for none."""

from __future__ import annotations

import pytest

from specdec_core.build import DraftSpec, build_engine
from specdec_core.config import SamplingParams
from specdec_core.drafters import registry
from specdec_core.errors import InvalidArgument
from specdec_core.runner import RunnerConfig
from tests.helpers import run_to_completion

RUNNER = RunnerConfig(num_slots=2, max_seq_len=128)
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: n-gram lookup finds matches too


@pytest.mark.parametrize("name", [*registry.METHODS, registry.NONE])
def test_every_method_gives_plain_decodings_greedy_tokens(pair, name):
    target, draft = pair
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = build_engine(target, None, DraftSpec(registry.NONE), runner_config=RUNNER)
    assert plain.drafter is None
    expected = run_to_completion(plain, [("r", PROMPT, params, 0)])["r"][0]
    # suffix: 1-token matches too, as ngram's defaults allow (the tiny target's output barely repeats)
    engine = build_engine(target, draft, DraftSpec(name, suffix_min_match=1), runner_config=RUNNER)
    tokens, _, last = run_to_completion(engine, [("r", PROMPT, params, 3)])["r"]
    assert tokens == expected
    assert (engine.drafter is None) == (name == registry.NONE)
    assert engine.methods == {"none": (), "hybrid": ("suffix", "draft_model")}.get(name, (name,))
    if engine.drafter is not None:
        assert last.stats.proposed > 0


def test_a_method_that_runs_a_draft_model_refuses_to_build_without_one(tiny_target):
    with pytest.raises(InvalidArgument, match="draft.model"):
        build_engine(tiny_target, None, DraftSpec("draft_model"), runner_config=RUNNER)
    with pytest.raises(InvalidArgument, match="draft.method"):
        build_engine(tiny_target, None, DraftSpec("beam"), runner_config=RUNNER)


def test_a_negative_draft_vocabulary_is_refused(tiny_dir):
    from specdec_core.build import prepare_model

    with pytest.raises(InvalidArgument, match="vocabulary"):
        prepare_model(tiny_dir / "draft", dtype="float32", vocabulary=-1)


def test_a_cut_draft_head_always_scores_the_special_tokens(tiny_dir):
    from specdec_core.build import prepare_model, special_ids
    from specdec_core.models.vocab_head import VocabHead

    draft = prepare_model(tiny_dir / "draft", dtype="float32", vocabulary=64)
    specials = special_ids(draft)
    assert set(draft.eos_token_ids) | set(draft.tokenizer.all_special_ids) <= specials
    head = draft.model.lm_head
    assert type(head) is VocabHead and head.keep == 64
    assert set(head.always.tolist()) == {i for i in specials if 64 <= i < head.vocab_size}
