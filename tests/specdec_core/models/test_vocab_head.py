"""A draft's LM head cut to its first ids, the special tokens and the contexts' ids (`models.vocab_head`)."""

from __future__ import annotations

import copy

import torch

from specdec_core.models.vocab_head import ROW_MULTIPLE, VocabHead, context_ids, cut_vocabulary


def _head(V=300, D=16, keep=64, always=(299,), seed=0):
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(seed))
    return weight, VocabHead(weight, keep, always)


def test_the_cut_head_scores_what_the_whole_head_does_on_its_ids_and_nothing_elsewhere():
    weight, head = _head()
    x = torch.randn(2, 3, 16)  # [B, N, D]
    extra = torch.tensor([70, 150, 150, 20])  # 20 is kept anyway; 150 twice
    out = head(x, extra)  # [B, N, V]
    full = x @ weight.T
    scored = torch.zeros(300, dtype=torch.bool)
    scored[:64] = True
    scored[[70, 150, 299]] = True
    assert out.shape == (2, 3, 300)
    torch.testing.assert_close(out[..., scored], full[..., scored])
    assert torch.isneginf(out[..., ~scored]).all()


def test_each_call_scores_its_own_extra_ids():
    """Rows are widened once per `extra` tensor (a round's steps share one): a new tensor is a new set."""
    weight, head = _head()
    x = torch.randn(1, 1, 16)
    first = head(x, torch.tensor([100]))
    again = head(x, torch.tensor([200]))
    assert torch.isfinite(first[0, 0, 100]) and torch.isneginf(first[0, 0, 200])
    assert torch.isfinite(again[0, 0, 200]) and torch.isneginf(again[0, 0, 100])
    torch.testing.assert_close(again[0, 0, 200], (x @ weight.T)[0, 0, 200])
    assert torch.isneginf(head(x)[0, 0, 200]) and torch.isfinite(head(x)[0, 0, 299])  # no extra: the always ids


def test_keep_is_rounded_up_to_whole_blocks_of_rows():
    _, head = _head(keep=65)
    assert head.keep == 2 * ROW_MULTIPLE and head.head.out_features == head.keep


def test_a_cut_that_would_keep_everything_leaves_the_model_alone(tiny_target):
    model = copy.deepcopy(tiny_target.model)
    head = model.lm_head
    V = head.weight.shape[0]
    assert not cut_vocabulary(model, 0, ()) and not cut_vocabulary(model, V, ())
    assert model.lm_head is head
    assert cut_vocabulary(model, 64, [V - 1]) and isinstance(model.lm_head, VocabHead)
    assert model.lm_head.weight.data_ptr() == head.weight.data_ptr()  # the head's rows (a tied embedding's): no copy


def test_context_ids_are_the_distinct_ids_past_the_kept_ones():
    ids = context_ids([[1, 70, 70, 5], [300, 90, 70]], keep=64, vocab_size=300)
    assert ids.tolist() == [70, 90]
    assert context_ids([], keep=64, vocab_size=300).numel() == 0
