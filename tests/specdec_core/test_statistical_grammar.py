"""Constrained sampling through the whole engine has the target's law under the grammar: chi-square tests with the
power to fail, as test_statistical.py's for unconstrained sampling.

Many seeded requests sample a short output under a regex at temperature 1 with top-k (applied after the mask); the
exact law of the output (up to its eos, or `max_tokens` tokens) is enumerated from the target itself, its logits
masked by the grammar's state after each prefix. The draft is a perturbed copy of the target. Two grammars:

- FORCING, `[a-z]{1,2}=count[a-z]`: after the letters `=` and `count` are forced, then one letter, then the eos.
  Rounds verify forced tokens with no draft call, the draft model drafts across forced positions (masked, q = 1
  there) and the forced eos is committed with no forward pass.
- FORBIDDING, `x[_a-z]{1,3}`: `x` is forced (the prefill samples it), then the draft's favourite token after it
  (`ģ`, half of its top-4 mass, beside `_`, `ĸ` and `ver`) is refused, so its masked q differs from its q where
  it drafts.

The same test catches the mistake the grammar core warns of: drafts drawn from the draft's *unmasked* q, cut where
they leave the grammar. Drawn from the unmasked q and verified whole, they are exact (the seam a draft worker that
ignores the grammar relies on).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.masks import draft_masks
from specdec_core.grammar.state import GrammarState
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sampling import processed_probs
from specdec_core.structured import FORCED
from tests.helpers import chi_square_p_value, logits_after, make_engine, one_torch_thread, perturbed

pytestmark = pytest.mark.slow  # thousands of seeded requests a test: `make test` runs them, `make test-fast` not
PROMPT = [17, 230, 41, 9, 100]
SAMPLES = 3000
TOP_K = 4
GRAMMARS = {  # name -> (regex, max_tokens)
    "forcing": (r"[a-z]{1,2}=count[a-z]", 6),  # its longest output, eos included, fits
    "forbidding": (r"x[_a-z]{1,3}", 4),  # x and three letters fill it: those outputs end by length
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _state(loaded, regex: str) -> GrammarState:
    compiler = GrammarCompiler(loaded.tokenizer, loaded.model.vocab_size, sorted(loaded.eos_token_ids))
    return GrammarState(compiler.compile(Constraint("regex", regex)))


def _exact_law(loaded, regex: str, max_tokens: int) -> dict[tuple[int, ...], float]:
    """P(output) = prod_i p_masked(t_i | prompt, t_<i), enumerating the support prefix by prefix; an output ends
    with its eos or at max_tokens."""
    runner = ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=64))
    state = _state(loaded, regex)
    law, frontier = {}, {(): 1.0}
    while frontier:
        grown = {}
        for prefix, mass in frontier.items():
            assert state.advance(list(prefix)) == len(prefix)
            if state.is_terminated() or len(prefix) == max_tokens:
                law[prefix] = mass
            else:
                slot = runner.allocate()
                logits = runner.extend([slot], [PROMPT + list(prefix)])  # [1, V]
                runner.release(slot)
                p = processed_probs(
                    logits.double(),
                    torch.tensor([1.0]),
                    torch.tensor([TOP_K]),
                    torch.tensor([1.0], dtype=torch.float64),
                    state.allowed_mask().unsqueeze(0),
                )[0]
                for token in torch.nonzero(p).flatten().tolist():
                    grown[prefix + (token,)] = mass * p[token].item()
            state.rollback(len(prefix))
        frontier = grown
    return law


def _sample(loaded, draft, regex: str, max_tokens: int, hybrid: bool = False):
    """Counts of each output over SAMPLES seeded requests (k = 2), and the rounds' methods. `hybrid`: requests
    alternate between the suffix structure and the draft model, so batches mix point-mass and model-drafted rows."""
    engine = make_engine(loaded, draft, num_slots=256, max_seq_len=64, hybrid=hybrid)
    constraint = Constraint("regex", regex)
    for i in range(SAMPLES):
        params = SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=max_tokens, constraint=constraint)
        engine.add_request(
            Request(
                str(i),
                tuple(PROMPT),
                params,
                2,
                speculation_method=("suffix", "draft_model")[i % 2] if hybrid else None,
            )
        )
    outputs: dict[str, list[int]] = {}
    methods: dict[str | None, int] = {}
    while engine.has_work:
        for out in engine.step():
            outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.round is not None and out.round.proposed_token_ids:
                methods[out.round.method] = methods.get(out.round.method, 0) + 1
    counts: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts, methods


@pytest.fixture(scope="module")
def draft(tiny_target):
    return perturbed(tiny_target.model, 0.05, seed=4)


@pytest.fixture(scope="module", params=list(GRAMMARS))
def grammar(request, tiny_target):
    regex, max_tokens = GRAMMARS[request.param]
    return request.param, regex, max_tokens, _exact_law(tiny_target, regex, max_tokens)


def test_the_forbidding_grammar_refuses_the_drafts_favourite(tiny_target, draft):
    state = _state(tiny_target, GRAMMARS["forbidding"][0])
    x = tiny_target.tokenizer.convert_tokens_to_ids("x")
    assert state.allowed_mask().nonzero().flatten().tolist() == [x]
    state.advance([x])
    favourite = int(logits_after(draft, PROMPT + [x])[-1].argmax())
    assert not state.allowed_mask()[favourite]


@pytest.mark.parametrize("hybrid", [False, True], ids=["draft_model", "hybrid"])
def test_constrained_speculative_sampling_matches_the_masked_target(tiny_target, draft, grammar, hybrid):
    name, regex, max_tokens, law = grammar
    counts, methods = _sample(tiny_target, draft, regex, max_tokens, hybrid)
    assert methods.get("draft_model", 0) > SAMPLES // 4, methods
    if name == "forcing":
        assert methods.get(FORCED, 0) > SAMPLES // 2, methods
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def test_plain_constrained_sampling_matches_the_masked_target(tiny_target, grammar):
    _, regex, max_tokens, law = grammar
    counts, _ = _sample(tiny_target, None, regex, max_tokens)
    assert chi_square_p_value(counts, law, SAMPLES) > 1e-3


def _drafting_unmasked(monkeypatch):
    """The draft model drafts from its unmasked q: the grammar is dropped from its requests."""
    propose = DraftModelDrafter.propose
    monkeypatch.setattr(
        DraftModelDrafter, "propose", lambda self, requests: propose(self, [replace(r, grammar=None) for r in requests])
    )


def _cut_everything(grammar, proposal):
    """The engine cutting every proposal where it leaves the grammar, those with a q too."""
    if grammar is None or not proposal.token_ids:
        return proposal
    return proposal.prefix(draft_masks(grammar, proposal.token_ids).num_valid)


def test_unmasked_drafts_cut_at_the_grammar_fail_the_same_test(tiny_target, draft, monkeypatch):
    regex, max_tokens = GRAMMARS["forbidding"]
    _drafting_unmasked(monkeypatch)
    monkeypatch.setattr("specdec_core.structured.cut_to_grammar", _cut_everything)
    counts, _ = _sample(tiny_target, draft, regex, max_tokens)
    assert chi_square_p_value(counts, _exact_law(tiny_target, regex, max_tokens), SAMPLES) < 1e-6


def test_unmasked_drafts_verified_whole_pass(tiny_target, draft, monkeypatch):
    """What the engine does with a proposal that has a q: never cut, so a drafter that ignores the grammar (a draft
    worker, which gets no masks over the wire) costs acceptance, never exactness."""
    regex, max_tokens = GRAMMARS["forbidding"]
    _drafting_unmasked(monkeypatch)
    counts, _ = _sample(tiny_target, draft, regex, max_tokens)
    assert chi_square_p_value(counts, _exact_law(tiny_target, regex, max_tokens), SAMPLES) > 1e-3
