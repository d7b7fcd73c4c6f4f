"""Pearson's chi-square test of a sampler's output against a joint law, for `sampler_law.py`: the law of k + 1 tokens
drawn from p, and the counts of a batch of rounds' outputs, each completed to k + 1 tokens. No scipy: its tail is
the Wilson-Hilferty approximation, ample at the p-values that decide here."""

from __future__ import annotations

import math
from typing import Any

import torch

from specdec_core.rejection import VerifyResult

ALPHA = 1e-4  # a correct sampler fails with this probability per check


def completed_law(result: VerifyResult, p: list[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """Counts [V**(k+1)] of the rounds' outputs, each completed to k + 1 tokens by sampling from p."""
    tokens = result.output_token_ids.clone()  # [n, k+1], -1 past the round's output
    V = p[0].shape[-1]
    code = tokens[:, 0].clone()  # [n]
    for j in range(1, tokens.shape[1]):
        empty = tokens[:, j] < 0  # [n]
        drawn = torch.multinomial(p[j][code], 1, generator=gen).squeeze(-1)  # [n]
        tokens[:, j] = torch.where(empty, drawn, tokens[:, j])
        code = code * V + tokens[:, j]
    return torch.bincount(code, minlength=V ** tokens.shape[1]).cpu()


def joint_law(p: list[torch.Tensor]) -> torch.Tensor:  # [V**(k+1)] float64: k + 1 tokens sampled from p
    law = p[0][0].double().cpu()
    for level in p[1:]:
        law = (law.unsqueeze(-1) * level.double().cpu()).reshape(-1)
    return law / law.sum()


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof), by the Wilson-Hilferty cube-root normal approximation (no scipy)."""
    if dof <= 0:
        return 1.0
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square(counts: torch.Tensor, law: torch.Tensor) -> dict[str, Any]:
    """Pearson's test of `counts` [C] against `law` [C]; cells expecting fewer than 5 pooled into one. A count in a
    cell of probability 0 fails outright."""
    n = int(counts.sum())
    expected = law * n  # [C]
    observed = counts.double()
    small = (expected < 5) & (law > 0)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs - exp) ** 2 / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    impossible = int(counts[law == 0].sum())
    tv = 0.5 * float((observed / n - law).abs().sum())
    pvalue = chi2_sf(stat, dof)
    return {
        "rows": n,
        "chi2": round(stat, 1),
        "dof": dof,
        "p_value": pvalue,
        "impossible": impossible,
        "total_variation": round(tv, 5),
        "pass": impossible == 0 and pvalue >= ALPHA,
    }
