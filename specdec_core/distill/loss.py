"""The distillation loss: forward KL(p || q) from the target's top-k distribution to the draft's, per position.

Why forward KL on p: greedy acceptance needs the draft's argmax to be the target's, and sampled acceptance is
sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al. 2023, section 3.5); KL(p || q) bounds TV by Pinsker and puts
its weight where p has mass, which is where proposals are verified.

Only p's top-k ids are stored (the whole vocabulary per position would be ~600 KB for Qwen). The rest of the
vocabulary is kept as one bucket rather than renormalised away: both distributions are coarsened to
(x_1 .. x_k, "any other id"), with p_rest = 1 - sum_i p(x_i) and q_rest = 1 - sum_i q(x_i), and the KL is taken
between those k + 1 outcomes. It is a true KL of coarsened distributions, so it is >= 0, and 0 exactly when q
matches p on every top-k id (then the rest matches too); renormalising over the k ids would instead be 0 for any q
proportional to p there, however much mass q wasted elsewhere.
"""

from __future__ import annotations

import torch


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends (Maechler 2012). x is clamped below 0: a bucket whose
    mass rounds to 0 gets log ~ -28 rather than -inf."""
    x = x.clamp(max=-1e-12)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_kl(
    draft_logits: torch.Tensor,  # [N, V] the draft's logits at N positions
    top_ids: torch.Tensor,  # [N, K] the target's top-k ids there
    top_logprobs: torch.Tensor,  # [N, K] log p of those ids (full softmax)
    weights: torch.Tensor,  # [N] how much each position counts
) -> torch.Tensor:  # [] the weighted mean of KL(p || q) over the (k + 1)-bucket coarsening
    log_q = torch.log_softmax(draft_logits.float(), dim=-1).gather(-1, top_ids)  # [N, K]
    log_p = top_logprobs.float()  # [N, K]
    log_p_rest = log1mexp(log_p.logsumexp(-1))  # [N]
    log_q_rest = log1mexp(log_q.logsumexp(-1))  # [N]
    p_rest = log_p_rest.exp()  # [N]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [N]
    # p_rest is 0 when the top-k holds all of p: the bucket then adds nothing (0 log 0 = 0).
    kl = kl + torch.where(p_rest > 0, p_rest * (log_p_rest - log_q_rest), torch.zeros_like(p_rest))
    return (weights * kl).sum() / weights.sum()
