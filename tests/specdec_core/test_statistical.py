"""The whole speculative loop samples from the target's distribution: a chi-square test with the power to fail.

Many seeded requests draw 4 tokens each at temperature 1 with top-k and top-p; the draft is a perturbed copy
of the target, so drafts are accepted only sometimes and the residual, the bonus token and acceptance across
two draft positions all matter. The exact law of the 4 tokens is enumerated from the target itself. The same
test run on deliberately broken samplers must reject them: that is what shows it can fail.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from specdec_core import engine as engine_module
from specdec_core import overlap as overlap_module
from specdec_core import rejection
from specdec_core import target as target_module
from specdec_core.config import SamplingParams
from specdec_core.models.vocab_head import cut_vocabulary
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sampling import processed_probs
from tests.helpers import chi_square_p_value, make_engine, perturbed

pytestmark = pytest.mark.slow  # thousands of seeded requests a test: `make test` runs them, `make test-fast` not
NUM_TOKENS = 4  # prefill token, then one round with k = 2 (accept, residual, bonus), then whatever is left
SAMPLES = 6000
PARAMS = dict(temperature=1.0, top_k=4, top_p=0.9, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPT = [17, 230, 41, 9, 100]


def _exact_law(loaded, num_tokens: int = NUM_TOKENS, params: dict = PARAMS) -> dict[tuple[int, ...], float]:
    """P(t1..tn) = prod_i p(t_i | prompt, t_<i), enumerating the support prefix by prefix."""
    runner = ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=64))
    law = {(): 1.0}
    for _ in range(num_tokens):
        nxt = {}
        for prefix, mass in law.items():
            slot = runner.allocate()
            logits = runner.extend([slot], [PROMPT + list(prefix)])  # [1, V]
            runner.release(slot)
            p = processed_probs(
                logits.double(),
                torch.tensor([1.0]),
                torch.tensor([params["top_k"]]),
                torch.tensor([params["top_p"]], dtype=torch.float64),
            )[0]
            for token in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (token,)] = mass * p[token].item()
        law = nxt
    return law


def _sample(
    loaded,
    draft,
    hybrid: bool = False,
    mixed: list[int] | None = None,
    confidence_threshold: float = 0.0,
    lengths: list[int] | None = None,
    num_tokens: int = NUM_TOKENS,
    k: int = 2,
    rounds: list[tuple[bool, bool]] | None = None,
    params: dict = PARAMS,
    **config,
) -> tuple[dict[tuple[int, ...], int], float]:
    """Counts of each 4-token output over SAMPLES seeded requests, and the acceptance rate. `hybrid`: requests
    alternate between the suffix structure and the draft model (`speculation_method`), so batches mix point-mass
    and model-drafted rows; `mixed`, when given, gets 1 for each step whose rounds verified both kinds together;
    `lengths`, each round's number of drafts; `rounds`, per step (some row verified a pre-drafted branch, some row
    fresh drafts). `config`: the engine's (`EngineConfig`)."""
    engine = make_engine(
        loaded, draft, num_slots=256, max_seq_len=64, hybrid=hybrid, confidence_threshold=confidence_threshold, **config
    )
    for i in range(SAMPLES):
        method = ("suffix", "draft_model")[i % 2] if hybrid else None
        seeded = SamplingParams(seed=i, **{**params, "max_tokens": num_tokens})
        engine.add_request(Request(str(i), tuple(PROMPT), seeded, k, speculation_method=method))
    outputs: dict[str, list[int]] = {}
    proposed = accepted = 0
    while engine.has_work:
        step = engine.step()
        if mixed is not None:
            methods = {out.round.method for out in step if out.round is not None and out.round.proposed_token_ids}
            mixed.append(int({"suffix", "draft_model"} <= methods))
        if rounds is not None:
            kinds = {out.round.predrafted for out in step if out.round is not None and out.round.proposed_token_ids}
            rounds.append((True in kinds, False in kinds))
        for out in step:
            if lengths is not None and out.round is not None and out.round.proposed_token_ids:
                lengths.append(len(out.round.proposed_token_ids))
            outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.finished:
                proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
    counts: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts, accepted / proposed if proposed else 0.0


@pytest.fixture(scope="module")
def law(tiny_target):
    return _exact_law(tiny_target)


@pytest.fixture(scope="module")
def draft(tiny_target):
    return perturbed(tiny_target.model, 0.05, seed=4)


def test_speculative_sampling_matches_the_target(tiny_target, draft, law):
    counts, acceptance = _sample(tiny_target, draft)
    assert 0.2 < acceptance < 0.9, acceptance  # drafts are neither always nor never right
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def test_sampling_with_drafts_stopped_by_the_drafts_confidence_matches_the_target(tiny_target, draft, law):
    """A row stops drafting after a draft it drew with q below the threshold: where a proposal ends depends on the
    draft's own draws, so the output's law is still the target's."""
    lengths: list[int] = []
    counts, acceptance = _sample(tiny_target, draft, confidence_threshold=0.35, lengths=lengths)
    stopped = sum(n == 1 for n in lengths) / len(lengths)
    assert 0.1 < stopped < 0.9, stopped  # some proposals were cut to one draft, others ran to k = 2
    assert 0.2 < acceptance < 0.95, acceptance
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def test_sampling_with_a_cut_draft_head_matches_the_target(tiny_target, draft, law):
    """A draft head scoring only ids below 192 and the context's (`models.vocab_head`): its q is 0 on the
    target's likeliest tokens until they appear in the output, so many drafts differ; the law is still p's."""
    cut = copy.deepcopy(draft)
    assert cut_vocabulary(cut, 192, ())
    counts, acceptance = _sample(tiny_target, cut)
    assert 0.1 < acceptance < 0.9, acceptance
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def test_suffix_sampling_matches_the_target(tiny_target, law):
    """Point-mass proposals from SuffixDecoding's global structure: requests that end teach it the prompt's
    continuations, so later ones are drafted, and accepted only sometimes."""
    counts, acceptance = _sample(tiny_target, "suffix")
    assert 0.05 < acceptance < 0.95, acceptance
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def test_hybrid_sampling_matches_the_target(tiny_target, draft, law):
    """Hybrid drafting verifies suffix proposals (point masses) and the draft model's (its q) in the same batches."""
    mixed: list[int] = []
    counts, acceptance = _sample(tiny_target, draft, hybrid=True, mixed=mixed)
    assert sum(mixed) >= len(mixed) // 2, mixed  # most steps verified both kinds of row together
    assert 0.05 < acceptance < 0.95, acceptance
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


OVERLAP_TOKENS = 5  # prefill token, a round of k = 1 that pre-drafts, a round that may verify its branch, the rest
# Two tokens of support a position: few enough outputs (32) that a biased branch shows at this sample size.
OVERLAP_PARAMS = dict(temperature=1.0, top_k=2, top_p=1.0, max_tokens=OVERLAP_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def law5(tiny_target):
    return _exact_law(tiny_target, OVERLAP_TOKENS, OVERLAP_PARAMS)


def _overlap_sample(loaded, draft, rounds):
    return _sample(loaded, draft, num_tokens=OVERLAP_TOKENS, k=1, rounds=rounds, params=OVERLAP_PARAMS, overlap="on")


def test_sampling_with_pre_drafted_branches_matches_the_target(tiny_target, draft, law5):
    """`overlap: on`: rows verifying a pre-drafted branch (drawn from q on the prefix the last round committed)
    and rows verifying fresh drafts, in the same batches; the 5 tokens' law is still p's."""
    rounds: list[tuple[bool, bool]] = []
    counts, acceptance = _overlap_sample(tiny_target, draft, rounds)
    assert any(pre and fresh for pre, fresh in rounds)  # mixed batches
    assert 0.2 < acceptance < 0.95, acceptance
    assert chi_square_p_value(counts, law5, SAMPLES) > 1e-3


def _unshifted_branches(drafted, num_committed, num_assumed):
    """A bug: the main branch's drafts verified with the q of the positions before them (the guess's q at the
    first)."""
    branches = _real_branches_of(drafted, num_committed, num_assumed)
    if not branches or drafted.q is None or len(drafted.token_ids) < 2:
        return branches
    main = branches[0]
    q = drafted.q.prefix(len(main.proposal.token_ids))
    return (overlap_module.Branch(main.num_context, main.guess, replace(main.proposal, q=q)), *branches[1:])


_real_branches_of = overlap_module.branches_of


def test_a_branch_verified_with_the_wrong_q_fails_the_same_test(tiny_target, draft, law5, monkeypatch):
    monkeypatch.setattr(engine_module, "branches_of", _unshifted_branches)
    counts, _ = _overlap_sample(tiny_target, draft, [])
    assert chi_square_p_value(counts, law5, SAMPLES) < 1e-6


def _zero_q_for_point_masses(items, K, p):
    """The old bug: a deterministic row beside model-drafted rows got q = 0 (accepted wherever p > 0)."""
    q = _real_dense_q(items, K, p)
    if q is not None:
        for i, item in enumerate(items):
            if item.q is None:
                q[i] = 0.0
    return q


_real_dense_q = target_module._dense_q


def test_zero_q_for_point_masses_in_a_mixed_batch_fails_the_same_test(tiny_target, draft, law, monkeypatch):
    monkeypatch.setattr(target_module, "_dense_q", _zero_q_for_point_masses)
    counts, _ = _sample(tiny_target, draft, hybrid=True)
    assert chi_square_p_value(counts, law, SAMPLES) < 1e-6


def test_plain_sampling_matches_the_target(tiny_target, law):
    counts, _ = _sample(tiny_target, None)
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def _no_residual(p_n, q, draft, rows, n, K):
    return p_n  # resample from p on rejection: biased towards the rejected token


def _bonus_from_last_draft_position(*args):
    draft_ids, num_draft, p, q, u_acc, u_smp = args
    if p.shape[1] > 1:
        p = p.clone()
        p[:, -1] = p[:, -2]
    return rejection.rejection_sample(draft_ids, num_draft, p, q, u_acc, u_smp)


@pytest.mark.parametrize("bug", ["no_residual", "wrong_bonus"])
def test_a_wrong_sampler_fails_the_same_test(tiny_target, draft, law, monkeypatch, bug):
    if bug == "no_residual":
        monkeypatch.setattr(rejection, "_residual", _no_residual)
    else:
        monkeypatch.setattr(target_module, "rejection_sample", _bonus_from_last_draft_position)
    counts, _ = _sample(tiny_target, draft)
    assert chi_square_p_value(counts, law, SAMPLES) < 1e-6
