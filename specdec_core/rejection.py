"""Lossless verification of draft tokens: speculative (rejection) sampling.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling".

Notation, as in the papers and everywhere in this project: `p` is the target's distribution, `q` the draft's.
For drafts x_1..x_k sampled from q, draft token x_i is *accepted* with probability min(1, p_i(x_i) / q_i(x_i)),
scanning left to right and stopping at the first rejection. At the first rejected position i a *recovered*
token is drawn from the residual norm(max(0, p_i - q_i)); if all k drafts are accepted a *bonus* token is drawn
from p_{k+1}. Either way one round emits (accepted + 1) tokens distributed exactly as k+1 steps of sampling
from p. With q a point mass (a deterministic drafter such as n-gram lookup) acceptance is p_i(x_i) and the
residual is p_i with x_i removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec_core.sampling import sample_from


@dataclass(frozen=True)
class VerifyResult:
    output_token_ids: torch.Tensor  # [B, K+1] long: accepted drafts, then the recovered/bonus token; -1 after
    num_accepted: torch.Tensor  # [B] long: drafts accepted per row (the row emits num_accepted + 1 tokens)

    def tokens(self, row: int) -> list[int]:
        n = int(self.num_accepted[row])
        return self.output_token_ids[row, : n + 1].tolist()


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, K] long; entries past num_draft are ignored
    num_draft: torch.Tensor,  # [B] long, each <= K: drafts actually proposed for the row
    p: torch.Tensor,  # [B, K+1, V] target probabilities at the K draft positions and the bonus position
    q: torch.Tensor | None,  # [B, K, V] draft probabilities; None: drafts were deterministic (point masses)
    uniform_accept: torch.Tensor,  # [B, K] in [0, 1): one acceptance test per draft position
    uniform_sample: torch.Tensor,  # [B] in [0, 1): draws the recovered or bonus token
) -> VerifyResult:
    """Verify a batch of drafts against the target (pure: all randomness comes in as uniforms)."""
    B, K = draft_token_ids.shape
    rows = torch.arange(B, device=p.device)
    draft = draft_token_ids.clamp(min=0)  # [B, K] padding made indexable; masked by `valid` below
    valid = torch.arange(K, device=p.device).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    p_x = p[:, :K].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]  p_i(x_i)
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, K]
    # u < p/q written as u * q < p: no division, and p(x) = 0 is never accepted.
    accepted = (uniform_accept * q_x < p_x) & valid  # [B, K]
    n = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] leading run of acceptances
    bonus = n == num_draft  # [B]
    p_n = p[rows, n]  # [B, V] target distribution where the extra token goes
    weights = torch.where(bonus.unsqueeze(-1), p_n, _residual(p_n, q, draft, rows, n, K))  # [B, V]
    extra = sample_from(weights, uniform_sample)  # [B]
    return _assemble(draft_token_ids, n, extra)


def _residual(
    p_n: torch.Tensor,  # [B, V]
    q: torch.Tensor | None,  # [B, K, V]
    draft: torch.Tensor,  # [B, K]
    rows: torch.Tensor,  # [B]
    n: torch.Tensor,  # [B]
    K: int,
) -> torch.Tensor:  # [B, V] unnormalised norm(max(0, p - q)); only read on rows that rejected
    if K == 0:
        return p_n
    at = n.clamp(max=K - 1)  # [B] rows with a bonus read a dummy position; their residual is discarded
    if q is None:
        return p_n.scatter(-1, draft[rows, at].unsqueeze(-1), 0.0)
    residual = (p_n - q[rows, at]).clamp(min=0.0)  # [B, V]
    # A rejection implies p != q, so the residual has mass; rounding aside, guard the degenerate row.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, p_n, residual)


def _assemble(draft_token_ids: torch.Tensor, n: torch.Tensor, extra: torch.Tensor) -> VerifyResult:
    B, K = draft_token_ids.shape
    cols = torch.arange(K + 1, device=draft_token_ids.device).unsqueeze(0)  # [1, K+1]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], dim=1)  # [B, K+1]
    out = torch.where(cols < n.unsqueeze(1), padded, torch.full_like(padded, -1))
    out[torch.arange(B, device=out.device), n] = extra
    return VerifyResult(output_token_ids=out, num_accepted=n)


def greedy_accept(
    draft_token_ids: torch.Tensor,  # [B, K]
    num_draft: torch.Tensor,  # [B]
    target_argmax: torch.Tensor,  # [B, K+1] the target's argmax at each draft position and the bonus one
) -> VerifyResult:
    """Temperature 0: `rejection_sample` with p and q point masses on each model's argmax.

    A draft is accepted iff it equals the target's argmax; the recovered or bonus token is the target's argmax
    at the first mismatch. Output is token for token that of plain greedy decoding. Works on argmax ids only,
    so no vocabulary-sized distribution is ever built or copied.
    """
    B, K = draft_token_ids.shape
    valid = torch.arange(K, device=target_argmax.device).unsqueeze(0) < num_draft.unsqueeze(1)  # [B, K]
    accepted = (draft_token_ids == target_argmax[:, :K]) & valid  # [B, K]
    n = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    extra = target_argmax[torch.arange(B, device=n.device), n]  # [B]
    return _assemble(draft_token_ids, n, extra)
