"""From logits to the distribution a request samples from, and drawing from it with randomness passed in.

Speculative sampling is exact with respect to whatever distribution the target would sample from alone. Here that
is the *processed* distribution: a grammar's mask if the request has one (structured output), then logits /
temperature, then top-k, then top-p (nucleus), renormalised. The draft's q is processed the same way; rejection
sampling is exact for any q, this only makes it agree more often.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec_core.config import TokenShaping


def mask_logits(
    logits: torch.Tensor,  # [..., V]
    allowed: torch.Tensor,  # [..., V] bool, each row with at least one True
) -> torch.Tensor:  # [..., V]
    """Logits with the disallowed tokens at -inf: softmax then renormalises over the allowed ones, and argmax
    picks among them."""
    return logits.masked_fill(~allowed, float("-inf"))


def processed_probs(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] > 0
    top_k: torch.Tensor,  # [N] long, 0 = off
    top_p: torch.Tensor,  # [N] in (0, 1], 1 = off
    allowed: torch.Tensor | None = None,  # [N, V] bool: a grammar's mask, applied first
) -> torch.Tensor:  # [N, V] rows sum to 1
    # The mask comes before temperature, top-k and top-p, which then shape the law *under the grammar*: a top-k or
    # top-p applied first could keep only tokens the grammar forbids, and leave nothing to sample.
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    logits = logits / temperature.unsqueeze(-1)
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1).any())
    if not (use_k or use_p):
        return torch.softmax(logits, dim=-1)
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    if use_k:
        k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # [N]
        ranks = torch.arange(V, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(-1), float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    if use_p:
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass *before* it is < top_p.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= top_p.unsqueeze(-1), 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def token_probs(
    logits: torch.Tensor,  # [N, V]
    shaping: Sequence[TokenShaping],  # [N]
    token_ids: torch.Tensor,  # [N] long
) -> torch.Tensor:  # [N]
    """The probability of each row's token under the row's processed distribution, as the proposal log reports
    it. A greedy row has no distribution to sample from: it reports the plain softmax (temperature 1)."""
    rows = [(1.0, 0, 1.0) if s.greedy else (s.temperature, s.top_k, s.top_p) for s in shaping]
    temperature, top_k, top_p = zip(*rows)
    device = logits.device
    probs = processed_probs(
        logits.float(),
        torch.tensor(temperature, device=device),
        torch.tensor(top_k, device=device),
        torch.tensor(top_p, device=device),
    )  # [N, V]
    return probs.gather(-1, token_ids.to(device).unsqueeze(-1)).squeeze(-1)  # [N]


def sample_from(
    weights: torch.Tensor,  # [N, V] non-negative, need not be normalised
    uniform: torch.Tensor,  # [N] in [0, 1)
) -> torch.Tensor:  # [N] long
    """Inverse-CDF sampling: token i where cdf[i-1] <= u * total < cdf[i].

    A token of weight 0 is never returned: its cdf step is empty. Rounding that pushes u * total to the total
    is clamped onto the last token of positive weight.
    """
    cdf = weights.cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()  # [N, 1]
    drawn = torch.searchsorted(cdf, uniform.unsqueeze(-1).to(cdf.device, cdf.dtype) * total, right=True)  # [N, 1]
    last_positive = torch.searchsorted(cdf, total, right=False)  # [N, 1]
    return torch.minimum(drawn, last_positive).squeeze(-1)
