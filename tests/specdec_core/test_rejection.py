"""The rejection sampler: table-driven greedy cases, exact distribution by enumeration, determinism."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdec_core.rejection import greedy_accept, rejection_sample

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
    sampled = rejection_sample(drafts, num_draft, p, q, torch.rand(B, K, generator=gen, dtype=torch.float64),
                               torch.rand(B, generator=gen, dtype=torch.float64))
    greedy = greedy_accept(drafts, num_draft, argmax)
    assert torch.equal(sampled.output_token_ids, greedy.output_token_ids)
    assert torch.equal(sampled.num_accepted, greedy.num_accepted)


# -- exact enumeration -------------------------------------------------------------------------------------------
#
# A toy "model" is a table from prefix to distribution. For every draft sequence x in V^K, the sampler's output
# is a deterministic, piecewise-constant function of its uniforms; integrating it over the cells between its
# breakpoints (cell length x the output at the cell's midpoint) gives its output distribution *exactly*.
# Completing each round's output with plain sampling from p to K+1 tokens must give exactly p's joint law.

V, K = 3, 2


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


def _cells(breaks: set[float]) -> list[tuple[float, float]]:
    """(midpoint, length) of each cell of [0, 1) cut at `breaks`."""
    points = sorted({0.0, 1.0} | {b for b in breaks if 0.0 < b < 1.0})
    return [((a + b) / 2, b - a) for a, b in zip(points, points[1:])]


def _round_distribution(sampler, p_model, q_model, point_mass_q: bool) -> dict[tuple[int, ...], float]:
    """Exact law of (round output completed to K+1 tokens by plain sampling from p).

    With `point_mass_q` the drafter is deterministic: it always proposes the greedy path of `q_model`.
    """
    law: dict[tuple[int, ...], float] = {}
    drafts = itertools.product(range(V), repeat=K)
    if point_mass_q:
        greedy: tuple[int, ...] = ()
        for _ in range(K):
            greedy += (int(q_model[greedy].argmax()),)
        drafts = [greedy]
    for x in drafts:
        q_rows = [q_model[x[:i]] for i in range(K)]  # [K][V]
        if point_mass_q:
            q_rows = [torch.nn.functional.one_hot(torch.tensor(x[i]), V).double() for i in range(K)]
        prob_x = torch.prod(torch.stack([q_rows[i][x[i]] for i in range(K)])).item()
        if prob_x == 0:
            continue
        p_rows = [p_model[x[:i]] for i in range(K + 1)]  # [K+1][V]
        # Breakpoints: acceptance thresholds p/q, and every cdf step of every residual and of p.
        accept_cells = [_cells({(p_rows[i][x[i]] / q_rows[i][x[i]]).item()}) for i in range(K)]
        sample_breaks = set()
        for i in range(K + 1):
            for w in [p_rows[i]] + ([(p_rows[i] - q_rows[i]).clamp(min=0)] if i < K else []):
                if w.sum() > 0:
                    sample_breaks |= set((w.cumsum(0) / w.sum()).tolist())
        grid = list(itertools.product(*accept_cells, _cells(sample_breaks)))
        B = len(grid)
        u_acc = torch.tensor([[c[i][0] for i in range(K)] for c in grid], dtype=torch.float64)  # [B, K]
        u_smp = torch.tensor([c[K][0] for c in grid], dtype=torch.float64)  # [B]
        weight = [math.prod(c[i][1] for i in range(K + 1)) for c in grid]
        out = sampler(
            torch.tensor([x] * B),
            torch.full((B,), K),
            torch.stack(p_rows).expand(B, K + 1, V),
            None if point_mass_q else torch.stack(q_rows).expand(B, K, V),
            u_acc,
            u_smp,
        )
        for b in range(B):
            tokens = tuple(out.tokens(b))
            for completion, w in _complete(tokens, p_model):
                law[completion] = law.get(completion, 0.0) + prob_x * weight[b] * w
    return law


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
    law = _round_distribution(rejection_sample, p_model, q_model, point_mass_q)
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
    law = _round_distribution(wrong, p_model, q_model, point_mass_q=False)
    assert _total_variation(law, _target_law(p_model)) > 1e-3


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
    out = rejection_sample(torch.zeros(200, 1, dtype=torch.long), torch.ones(200, dtype=torch.long), p, q,
                           u.unsqueeze(1), u.flip(0))
    assert (out.num_accepted == 0).all()
    assert (out.output_token_ids[:, 0] != 0).all()
