"""The rejection sampler: table-driven greedy cases, exact distribution by enumeration (mixed batches too),
determinism."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from specdec_core.config import TokenShaping
from specdec_core.rejection import greedy_accept, rejection_sample
from specdec_core.sparse_q import SparseQ
from specdec_core.target import VerifyItem, _dense_q

# -- greedy ----------------------------------------------------------------------------------------------------

GREEDY_CASES = [
    # drafts,     num_draft, target argmax at K+1 positions, expected output tokens, accepted
    ([5, 6, 7], 3, [5, 6, 7, 8], [5, 6, 7, 8], 3),  # all accepted: bonus token 8
    ([5, 6, 7], 3, [5, 9, 7, 8], [5, 9], 1),  # second rejected: recovered token 9
    ([5, 6, 7], 3, [1, 6, 7, 8], [1], 0),  # first rejected
    ([5, 6, -1], 2, [5, 6, 4, 8], [5, 6, 4], 2),  # only 2 drafts: bonus at position 2
    ([-1, -1, -1], 0, [3, 0, 0, 0], [3], 0),  # no drafts: plain decoding
]


@pytest.mark.parametrize("drafts,num_draft,argmax,expected,accepted", GREEDY_CASES)
def test_greedy_accept_table(drafts, num_draft, argmax, expected, accepted):
    result = greedy_accept(torch.tensor([drafts]), torch.tensor([num_draft]), torch.tensor([argmax]))
    assert result.tokens(0) == expected
    assert int(result.num_accepted[0]) == accepted


def test_greedy_is_rejection_sampling_with_point_masses():
    gen = torch.Generator().manual_seed(0)
    B, K, V = 64, 3, 5
    argmax = torch.randint(V, (B, K + 1), generator=gen)
    drafts = torch.where(torch.rand(B, K, generator=gen) < 0.6, argmax[:, :K], torch.randint(V, (B, K), generator=gen))
    num_draft = torch.randint(K + 1, (B,), generator=gen)
    p = torch.nn.functional.one_hot(argmax, V).double()
    q = torch.nn.functional.one_hot(drafts, V).double()
    sampled = rejection_sample(
        drafts,
        num_draft,
        p,
        q,
        torch.rand(B, K, generator=gen, dtype=torch.float64),
        torch.rand(B, generator=gen, dtype=torch.float64),
    )
    greedy = greedy_accept(drafts, num_draft, argmax)
    assert torch.equal(sampled.output_token_ids, greedy.output_token_ids)
    assert torch.equal(sampled.num_accepted, greedy.num_accepted)


# -- exact enumeration -------------------------------------------------------------------------------------------
#
# A toy "model" is a table from prefix to distribution. For every draft sequence x, the sampler's output for a row
# is a deterministic, piecewise-constant function of its uniforms; integrating it over the cells between its
# breakpoints (cell length x the output at the cell's midpoint) gives its output distribution *exactly*.
# Completing each round's output with plain sampling from p to K+1 tokens must give exactly p's joint law.
# A verify batch holds one row per drafter; q reaches the sampler as the target builds it (`_dense_q`).

V, K = 3, 2
SAMPLED = TokenShaping(temperature=1.0)


def _toy_model(seed: int, sharp: float) -> dict[tuple[int, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    table = {}
    for n in range(K + 2):
        for prefix in itertools.product(range(V), repeat=n):
            logits = torch.randn(V, generator=gen, dtype=torch.float64) * sharp
            if seed % 2 == 0:
                logits[(sum(prefix) + seed) % V] = -torch.inf  # zero-probability tokens must be handled too
            table[prefix] = torch.softmax(logits, dim=0)
    return table


@dataclass(frozen=True)
class _Proposal:
    """A draft sequence a drafter can propose, with its probability."""

    drafts: tuple[int, ...]  # n <= K; the row is padded past them
    prob: float
    q: torch.Tensor  # [n, V] the drafter's q; point masses for a deterministic drafter
    point_mass: bool  # deterministic: sent as q = None, as n-gram and suffix drafters send it


def _model_drafter(q_model, n: int = K) -> list[_Proposal]:
    """A draft model: every sequence of n >= 1 drafts sampled from `q_model`."""
    out = []
    for x in itertools.product(range(V), repeat=n):
        q = torch.stack([q_model[x[:i]] for i in range(n)])  # [n, V]
        prob = math.prod(q[i, x[i]].item() for i in range(n))
        if prob > 0:
            out.append(_Proposal(x, prob, q, point_mass=False))
    return out


def _deterministic_drafter(q_model, n: int = K) -> list[_Proposal]:
    """A deterministic drafter: it always proposes the greedy path of `q_model`."""
    x: tuple[int, ...] = ()
    for _ in range(n):
        x += (int(q_model[x].argmax()),)
    q = torch.nn.functional.one_hot(torch.tensor(x, dtype=torch.long), V).double()  # [n, V]
    return [_Proposal(x, 1.0, q, point_mass=True)]


def _cells(breaks: set[float]) -> list[tuple[float, float]]:
    """(midpoint, length) of each cell of [0, 1) cut at `breaks`."""
    points = sorted({0.0, 1.0} | {b for b in breaks if 0.0 < b < 1.0})
    return [((a + b) / 2, b - a) for a, b in zip(points, points[1:])]


class _Rows(NamedTuple):
    """The sampler's inputs for a proposal's rows, one row per cell of its uniforms; concatenated, a batch's."""

    draft: torch.Tensor  # [B, K] long, -1 past the proposal's drafts
    num_draft: torch.Tensor  # [B]
    p: torch.Tensor  # [B, K+1, V]
    u_acc: torch.Tensor  # [B, K]
    u_smp: torch.Tensor  # [B]
    weight: torch.Tensor  # [B] float64: the cell's length, the probability of its uniforms


def _rows(proposal: _Proposal, p_model) -> _Rows:
    """A row per cell of the uniforms' space on which the sampler's output for this proposal is constant."""
    x, q, n = proposal.drafts, proposal.q, len(proposal.drafts)  # q: [n, V]
    padding = [torch.full((V,), 1 / V, dtype=torch.float64)] * (K - n)  # p past the bonus position: never read
    p = torch.stack([p_model[x[:i]] for i in range(n + 1)] + padding)  # [K+1, V]
    # Breakpoints: acceptance thresholds p/q, and every cdf step of every residual and of p.
    accept_cells = [_cells({(p[i, x[i]] / q[i, x[i]]).item()}) for i in range(n)]
    accept_cells += [_cells(set())] * (K - n)  # a padding position is never accepted, whatever its uniform
    sample_breaks = set()
    for i in range(n + 1):
        for w in [p[i]] + ([(p[i] - q[i]).clamp(min=0)] if i < n else []):
            if w.sum() > 0:
                sample_breaks |= set((w.cumsum(0) / w.sum()).tolist())
    grid = list(itertools.product(*accept_cells, _cells(sample_breaks)))
    B = len(grid)
    return _Rows(
        torch.tensor(x + (-1,) * (K - n)).expand(B, K),
        torch.full((B,), n),
        p.expand(B, K + 1, V),
        torch.tensor([[c[i][0] for i in range(K)] for c in grid], dtype=torch.float64),
        torch.tensor([c[K][0] for c in grid], dtype=torch.float64),
        torch.tensor([math.prod(c[i][1] for i in range(K + 1)) for c in grid], dtype=torch.float64),
    )


def _item(proposal: _Proposal) -> VerifyItem:
    """The row as the target receives it. `_dense_q` reads only its drafts and q; the uniforms go to the sampler."""
    q = None if proposal.point_mass else SparseQ.from_dense(proposal.q)
    return VerifyItem("row", 0, list(proposal.drafts), q, SAMPLED, None, None)


def _round_distributions(sampler, p_model, drafters, dense_q=_dense_q) -> list[dict[tuple[int, ...], float]]:
    """Exact law of each drafter's row (round output completed to K+1 tokens by plain sampling from p).

    Each batch puts every drafter's rows side by side, for one combination of their proposals; weighing each row
    by the combination's probability makes its law the marginal over the other rows' proposals.
    """
    laws: list[dict[tuple[int, ...], float]] = [{} for _ in drafters]
    for proposals in itertools.product(*drafters):
        parts = [_rows(proposal, p_model) for proposal in proposals]
        batch = _Rows(*(torch.cat(column) for column in zip(*parts)))
        owner = [j for j, part in enumerate(parts) for _ in range(len(part.weight))]  # [B] each row's drafter
        items = [_item(proposal) for proposal in proposals]
        q = dense_q([items[j] for j in owner], K, batch.p)  # [B, K, V]; None when every row is deterministic
        out = sampler(batch.draft, batch.num_draft, batch.p, q, batch.u_acc, batch.u_smp)
        prob = math.prod(proposal.prob for proposal in proposals)  # the drafters propose independently
        for b, (j, weight) in enumerate(zip(owner, batch.weight.tolist())):
            for completion, w in _complete(tuple(out.tokens(b)), p_model):
                laws[j][completion] = laws[j].get(completion, 0.0) + prob * weight * w
    return laws


def _complete(tokens: tuple[int, ...], p_model) -> list[tuple[tuple[int, ...], float]]:
    if len(tokens) == K + 1:
        return [(tokens, 1.0)]
    out = []
    for t in range(V):
        w = p_model[tokens][t].item()
        if w > 0:
            out += [(seq, w * rest) for seq, rest in _complete(tokens + (t,), p_model)]
    return out


def _target_law(p_model) -> dict[tuple[int, ...], float]:
    return dict(_complete((), p_model))


def _total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("point_mass_q", [False, True])
def test_output_distribution_is_exactly_the_targets(seed, point_mass_q):
    p_model, q_model = _toy_model(seed, 1.5), _toy_model(seed + 100, 1.5)
    drafter = _deterministic_drafter(q_model) if point_mass_q else _model_drafter(q_model)
    (law,) = _round_distributions(rejection_sample, p_model, [drafter])
    assert _total_variation(law, _target_law(p_model)) < 1e-12


def _wrong_residual(draft, num_draft, p, q, u_acc, u_smp):
    """A wrong sampler: on rejection it resamples from p instead of norm(max(0, p - q))."""
    from specdec_core import rejection

    original = rejection._residual
    rejection._residual = lambda p_n, q, draft, rows, n, K: p_n
    try:
        return rejection_sample(draft, num_draft, p, q, u_acc, u_smp)
    finally:
        rejection._residual = original


def _drops_bonus(draft, num_draft, p, q, u_acc, u_smp):
    """A wrong sampler: after accepting every draft it samples the bonus from the last draft position's p."""
    p = p.clone()
    p[:, -1] = p[:, -2]
    return rejection_sample(draft, num_draft, p, q, u_acc, u_smp)


@pytest.mark.parametrize("wrong", [_wrong_residual, _drops_bonus])
def test_enumeration_catches_a_wrong_sampler(wrong):
    """The exact check has the power to fail: known-wrong samplers are far from the target's law."""
    p_model, q_model = _toy_model(1, 1.5), _toy_model(101, 1.5)
    (law,) = _round_distributions(wrong, p_model, [_model_drafter(q_model)])
    assert _total_variation(law, _target_law(p_model)) > 1e-3


def _mixed_batch(seed: int) -> list[list[_Proposal]]:
    """One verify batch's drafters: draft models next to deterministic drafters (another toy model's greedy path),
    with K drafts and fewer (padding past them)."""
    q_model, greedy_model = _toy_model(seed + 100, 1.5), _toy_model(seed + 200, 1.5)
    return [_model_drafter(q_model, n) for n in (K, 1)] + [_deterministic_drafter(greedy_model, n) for n in (K, 1, 0)]


def _mixed_batch_tvs(seed: int, dense_q=_dense_q) -> list[float]:  # one per drafter of `_mixed_batch`
    p_model = _toy_model(seed, 1.5)
    laws = _round_distributions(rejection_sample, p_model, _mixed_batch(seed), dense_q)
    return [_total_variation(law, _target_law(p_model)) for law in laws]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_row_of_a_mixed_batch_is_exactly_the_targets(seed):
    """Model-drafted and deterministic rows verified together, q built by the target's `_dense_q`."""
    tvs = _mixed_batch_tvs(seed)
    assert max(tvs) < 1e-12, tvs


def _zero_point_masses(items, K, p):  # [S, K, V]
    """The old bug: next to model-drafted rows, a deterministic row's q stayed 0, accepting wherever p > 0."""
    q = _dense_q(items, K, p)  # [S, K, V]
    q[[i for i, item in enumerate(items) if item.q is None]] = 0.0
    return q


def test_enumeration_catches_zero_q_for_deterministic_rows():
    """The mixed-batch check has the power to fail: the rows with deterministic drafts are far from p's law;
    the model-drafted rows and the row without drafts do not read that q, and stay exact."""
    model, model_short, full, short, none = _mixed_batch_tvs(1, dense_q=_zero_point_masses)
    assert min(full, short) > 1e-3, (full, short)
    assert max(model, model_short, none) < 1e-12, (model, model_short, none)


# -- determinism and edge cases ----------------------------------------------------------------------------------


def test_same_randomness_same_output():
    gen = torch.Generator().manual_seed(7)
    B, Kd, Vd = 16, 4, 11
    p = torch.softmax(torch.randn(B, Kd + 1, Vd, generator=gen), -1)
    q = torch.softmax(torch.randn(B, Kd, Vd, generator=gen), -1)
    drafts = torch.randint(Vd, (B, Kd), generator=gen)
    u_acc, u_smp = torch.rand(B, Kd, generator=gen), torch.rand(B, generator=gen)
    a = rejection_sample(drafts, torch.full((B,), Kd), p, q, u_acc, u_smp)
    b = rejection_sample(drafts, torch.full((B,), Kd), p, q, u_acc, u_smp)
    assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_zero_probability_tokens_are_never_emitted():
    # p puts no mass on token 0; the draft proposes it: always rejected, and the recovered token is never 0.
    p = torch.tensor([[[0.0, 0.5, 0.5], [0.0, 0.2, 0.8]]]).expand(200, 2, 3)
    q = torch.tensor([[[1.0, 0.0, 0.0]]]).expand(200, 1, 3)
    u = torch.linspace(0, 0.999999, 200)
    out = rejection_sample(
        torch.zeros(200, 1, dtype=torch.long), torch.ones(200, dtype=torch.long), p, q, u.unsqueeze(1), u.flip(0)
    )
    assert (out.num_accepted == 0).all()
    assert (out.output_token_ids[:, 0] != 0).all()
