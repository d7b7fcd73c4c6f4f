"""The registry of drafting methods: the names configs and flags use, and what each method builds."""

from __future__ import annotations

import pytest

from specdec_core.drafters import registry
from specdec_core.drafters.base import DraftContext, DraftSpec, Hybrid
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.drafters.ngram import NgramDrafter
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.errors import InvalidArgument
from specdec_core.runner import ModelRunner, RunnerConfig


def test_the_names_are_the_config_values():
    assert registry.choices() == (
        "draft_model",
        "ngram",
        "suffix",
        "hybrid",
        "none",
    )  # contracts: configs and flags spell them so
    assert all(method.name == name for name, method in registry.METHODS.items())
    assert registry.resolve("none") is None  # plain decoding: no method, no drafter


def test_an_unknown_name_is_refused_naming_every_choice():
    with pytest.raises(InvalidArgument) as err:
        registry.resolve("beam")
    assert err.value.field == "draft.method"
    assert all(name in err.value.message for name in registry.choices())


def test_each_method_builds_its_drafter_from_the_context(tiny_draft):
    runner = ModelRunner(tiny_draft.model, RunnerConfig(num_slots=1, max_seq_len=64))
    spec = DraftSpec("ngram", ngram_max=3, ngram_min=2)
    ngram = registry.resolve("ngram").build(DraftContext(spec, 400))
    assert isinstance(ngram, NgramDrafter) and (ngram.max_n, ngram.min_n) == (3, 2)
    assert not registry.resolve("ngram").runs_draft_model
    spec = DraftSpec(
        "suffix",
        suffix_max_depth=16,
        suffix_min_match=3,
        suffix_max_requests=5,
        suffix_max_bytes=12_345,
        suffix_min_prob=0.2,
        suffix_index_prompts=False,
    )
    suffix = registry.resolve("suffix").build(DraftContext(spec, 400))
    assert isinstance(suffix, SuffixDrafter) and not registry.resolve("suffix").runs_draft_model
    assert (suffix.max_depth, suffix.min_match, suffix.global_.max_requests, suffix.min_prob) == (16, 3, 5, 0.2)
    assert not suffix.index_prompts and suffix.global_.max_bytes == 12_345
    model = registry.resolve("draft_model").build(DraftContext(DraftSpec("draft_model"), 400, runner))
    assert isinstance(model, DraftModelDrafter) and model.runner is runner and model.target_vocab_size == 400
    assert registry.resolve("draft_model").runs_draft_model
    with pytest.raises(InvalidArgument, match="draft.model"):
        registry.resolve("draft_model").build(DraftContext(DraftSpec("draft_model"), 400))


def test_hybrid_pairs_the_draft_model_with_suffix_decoding(tiny_draft):
    """The draft workers run hybrid's `build` (the draft model); `assemble` adds the suffix structure beside it
    (or beside the router's stand-in for the workers), built from the same spec."""
    hybrid = registry.resolve("hybrid")
    assert hybrid.runs_draft_model and hybrid.free_part == "suffix"
    runner = ModelRunner(tiny_draft.model, RunnerConfig(num_slots=1, max_seq_len=64))
    context = DraftContext(DraftSpec("hybrid", suffix_min_match=3), 400, runner)
    model = hybrid.build(context)
    assert isinstance(model, DraftModelDrafter)
    pair = registry.assemble(hybrid, model, context)
    assert isinstance(pair, Hybrid) and pair.model is model
    assert isinstance(pair.free, SuffixDrafter) and pair.free.min_match == 3
    assert registry.assemble(registry.resolve("ngram"), model, context) is model  # one drafter: nothing to pair
