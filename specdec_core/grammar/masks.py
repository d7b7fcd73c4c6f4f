"""The masks of one speculative round, and why masking keeps it exact.

A mask row is the set of tokens the grammar allows next. Applied to logits before any other processing (`sampling.
processed_probs(..., allowed=)`), it turns the target's p into its law under the grammar (p masked and
renormalised), and the draft's q likewise. Rejection sampling is exact for the masked p whatever q is, as long as
the drafts are drawn from the q it is given; masking q too makes every sampled draft stay in the grammar, and
where the grammar allows one token, p = q = 1 there: a free draft.

Cutting a proposal where it leaves the grammar (`DraftMasks.num_valid`) turns the draft at the cut into the bonus
position, sampled from p rather than from the residual norm(max(0, p - q)). That is exact for a point-mass
proposal (n-gram, suffix: the residual of a point mass on a token p gives nothing to is p itself) and never
happens to drafts sampled from a masked q; it would bias drafts sampled from an unmasked q wherever the grammar
allows more than one token, which is why q must be masked (`tests/specdec_core/grammar/test_exactness.py`
measures the bias). Such drafts are exact verified whole (`verify_masks`): the masked p is 0 at the draft that
leaves the grammar, which is rejected and replaced from the residual as rejection sampling prescribes.

The drafting side and the verifying side read the same rows: `GrammarState` computes each position's mask once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec_core.grammar.bits import PackedMasks
from specdec_core.grammar.state import GrammarState


@dataclass(frozen=True)
class DraftMasks:
    """A proposal's masks and how much of it the grammar accepts."""

    packed: PackedMasks  # [n+1, W]: at the committed state, then after each of the first n drafts
    num_valid: int  # n: the longest prefix of the drafts the grammar accepts; the proposal is cut there

    @property
    def allowed(self) -> torch.Tensor:  # [n+1, V] bool
        return self.packed.dense()


def draft_masks(state: GrammarState, draft_token_ids: Sequence[int]) -> DraftMasks:
    """The masks a round with these drafts verifies under: p at position i is masked by row i (row n for the
    recovered or bonus token). Advances `state` through the drafts and rolls it back: unchanged on return, but the
    masks stay cached for whatever reads the same positions (drafting, verifying, committing)."""
    rows = [state.allowed_words()]  # [W]
    n = 0
    for token in draft_token_ids:
        if state.advance([token]) == 0:
            break
        n += 1
        rows.append(state.allowed_words())
    state.rollback(n)
    return DraftMasks(PackedMasks(np.stack(rows), state.grammar.vocab_size), n)  # [n+1, W]; numpy: see bits.py


def verify_masks(state: GrammarState, draft_token_ids: Sequence[int]) -> PackedMasks:  # [len(drafts)+1, W]
    """The masks to verify all of these drafts under, the state unchanged. Past a draft the grammar refuses (one
    drawn from a q that ignored the grammar, verified whole), the rows repeat the row at it: that draft has masked
    p = 0, so it is rejected and no later position is read; any row with an allowed token serves."""
    masks = draft_masks(state, draft_token_ids)
    missing = len(draft_token_ids) - masks.num_valid
    if not missing:
        return masks.packed
    words = masks.packed.words  # [num_valid+1, W]
    return PackedMasks(np.concatenate([words, np.repeat(words[-1:], missing, axis=0)]), masks.packed.vocab_size)
