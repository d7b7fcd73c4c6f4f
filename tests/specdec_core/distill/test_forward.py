"""The cache-free forward used for training and scoring gives the served forward's logits."""

from __future__ import annotations

import torch

from specdec_core.distill.forward import logits_at, use_causal_attention
from specdec_core.models.loader import load_model
from tests.helpers import logits_after


def test_logits_match_the_cached_forward_for_padded_rows(tiny_dir):
    model = load_model(tiny_dir / "target", dtype="float32").model
    rows = [list(range(5, 25)), list(range(40, 47))]
    expected = [logits_after(model, row) for row in rows]  # [T, V] each, through the runner and its cache
    use_causal_attention(model)
    picks = [[0, 7, 19], [2, 6]]
    got = logits_at(model, rows, picks)  # [5, V]
    want = torch.cat([expected[0][picks[0]], expected[1][picks[1]]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
