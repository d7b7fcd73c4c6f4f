"""Processed distributions (temperature, top-k, top-p) and inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch

from specdec_core.sampling import processed_probs, sample_from


def _reference(logits: list[float], temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward per-row filtering, written independently of the vectorised version."""
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    order = sorted(range(len(logits)), key=lambda i: -x[i].item())
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.zeros_like(x)
    probs[keep] = torch.softmax(x[keep], 0)
    if top_p < 1:
        mass, nucleus = 0.0, []
        for i in keep:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i].item()
        trimmed = torch.zeros_like(probs)
        trimmed[nucleus] = probs[nucleus]
        probs = trimmed / trimmed.sum()
    return probs


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.7), (0.8, 4, 0.9), (2.0, 1, 1.0), (1.0, 0, 1e-6)],
)
def test_processed_probs_matches_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    got = processed_probs(
        logits, torch.full((5,), temperature), torch.full((5,), top_k), torch.full((5,), top_p, dtype=torch.float64)
    )
    for row in range(5):
        torch.testing.assert_close(got[row], _reference(logits[row].tolist(), temperature, top_k, top_p))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 2, 1.0), (1.0, 0, 0.6), (0.8, 3, 0.9)])
def test_a_mask_applies_before_shaping(temperature, top_k, top_p):
    """Masked, the law is the shaped law of the allowed tokens alone: top-k and top-p rank only allowed tokens,
    and nothing outside the mask keeps any mass."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    allowed = torch.rand(5, 9, generator=gen) < 0.5  # [5, 9]
    allowed[:, 0] = True  # never empty
    allowed[4] = False
    allowed[4, 7] = True  # a forced token: all the mass, whatever the logits
    got = processed_probs(
        logits,
        torch.full((5,), temperature),
        torch.full((5,), top_k),
        torch.full((5,), top_p, dtype=torch.float64),
        allowed,
    )
    for row in range(5):
        keep = allowed[row].nonzero().flatten()
        want = torch.zeros(9, dtype=torch.float64)
        want[keep] = _reference(logits[row, keep].tolist(), temperature, top_k, top_p)
        torch.testing.assert_close(got[row], want)
    assert got[4, 7] == 1.0


def test_rows_keep_their_own_settings():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    got = processed_probs(logits, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1, 0, 2]), torch.tensor([1.0, 1.0, 1.0]))
    assert got[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert (got[1] > 0).all()
    assert got[2][2:].tolist() == [0.0, 0.0]


def test_sample_from_is_the_inverse_cdf():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0]])  # cdf 0, 2, 2, 3, 4 (total 4)
    cases = {0.0: 1, 0.49: 1, 0.5: 3, 0.74: 3, 0.75: 4, 0.999999: 4}
    for u, token in cases.items():
        assert int(sample_from(weights, torch.tensor([u]))[0]) == token


def test_sample_from_never_returns_zero_weight_even_at_rounding_edge():
    weights = torch.tensor([[0.3, 0.7, 0.0, 0.0]])
    assert int(sample_from(weights, torch.tensor([1.0]))[0]) == 1  # u*total == total: clamped to last positive
