"""The draft-model drafter: a sequence that fell behind catches up without disturbing the rest of its batch; q
stays sparse and changes no draw; a constrained row drafts from its masked q."""

from __future__ import annotations

import pytest
import torch

from specdec_core.config import TokenShaping
from specdec_core.drafters.base import DraftRequest
from specdec_core.drafters.draft_model import Q_SUPPORT, DraftModelDrafter, _truncate
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.grammar.constraint import Constraint
from specdec_core.grammar.state import GrammarState
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sampling import sample_from

MAX_SEQ_LEN = 128


def _drafter(model, prefix_caching: bool = False) -> DraftModelDrafter:
    runner = ModelRunner(model, RunnerConfig(num_slots=4, max_seq_len=MAX_SEQ_LEN, prefix_caching=prefix_caching))
    return DraftModelDrafter(runner, runner.vocab_size)


def _request(seq_id: str, tokens: list[int], k: int = 3) -> DraftRequest:
    return DraftRequest(seq_id=seq_id, token_ids=tokens, num_tokens=k, shaping=TokenShaping(), uniform=None)


def test_a_stale_row_beside_a_long_one_drafts_as_each_would_alone(tiny_target):
    """Row "long" is near the end of its context; row "stale" has 60 unread tokens (it sat at k = 0). Padded
    together, "stale"'s feed would push "long"'s padding past its cache slot; read alone first, it does not,
    and each row drafts exactly what a freshly started drafter drafts for it."""
    vocab = tiny_target.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(0, vocab, (MAX_SEQ_LEN - 8,), generator=gen).tolist()
    stale = torch.randint(0, vocab, (70,), generator=gen).tolist()
    drafter = _drafter(tiny_target.model)
    drafter.start("long", long)
    drafter.start("stale", stale[:10])  # then 60 tokens committed while it did not draft
    together = drafter.propose([_request("long", long), _request("stale", stale)])
    for seq_id, tokens, proposal in [("long", long, together[0]), ("stale", stale, together[1])]:
        fresh = _drafter(tiny_target.model)
        fresh.start(seq_id, tokens)
        (alone,) = fresh.propose([_request(seq_id, tokens)])
        assert proposal.token_ids == alone.token_ids, seq_id
    assert drafter.runner.length(drafter._slots["stale"]) == len(stale) + 2  # read it all, plus two drafts


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_drafts_rejected_rounds_ago_are_not_read_as_context(tiny_target, accepted):
    """A remote draft worker hears of the committed tokens only with its next Propose: here one round drafts 4,
    the target accepts `accepted` of them and replaces the next, and three plain rounds (no drafts, no observe)
    commit more before the next Propose. The rejected drafts must not stay in the cache behind the prefix that
    grew past them: the next proposal and its q are those of a drafter started on the committed tokens."""
    vocab = tiny_target.model.vocab_size
    prompt = torch.randint(0, vocab, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    drafter = _drafter(tiny_target.model)
    drafter.start("r", prompt)
    (first,) = drafter.propose([_request("r", prompt, k=4)])
    replaced = (first.token_ids[accepted] + 1) % vocab
    committed = prompt + first.token_ids[:accepted] + [replaced] + [5, 6, 7]
    request = DraftRequest("r", committed, 3, TokenShaping(), None, return_probs=True)
    (after,) = drafter.propose([request])
    fresh = _drafter(tiny_target.model)
    fresh.start("r", committed)
    (alone,) = fresh.propose([request])
    assert after.token_ids == alone.token_ids
    assert after.draft_probs == pytest.approx(alone.draft_probs, abs=1e-5)


def test_a_sparse_row_draws_what_its_dense_row_draws():
    """The drafter samples from q's sparse rows: ids ascending, the same uniform draws the same token as the dense
    row would, so q's sparseness changes no output."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.softmax(torch.randn(64, 400, generator=gen) * 3, dim=-1)  # [S, V]
    q = _truncate(dense, 16)  # [S, 16]
    uniform = torch.rand(64, generator=gen, dtype=torch.float64)
    at = sample_from(q.probs, uniform).unsqueeze(-1)  # [S, 1]
    assert torch.equal(q.token_ids.gather(-1, at).squeeze(-1), sample_from(q.dense(400), uniform))


def test_sampled_proposals_carry_a_sparse_q_the_drafts_come_from(tiny_target):
    vocab = tiny_target.model.vocab_size
    drafter = _drafter(tiny_target.model)
    drafter.start("s", [5, 6, 7])
    request = DraftRequest("s", [5, 6, 7], 4, TokenShaping(temperature=1.0), torch.rand(4, dtype=torch.float64))
    (proposal,) = drafter.propose([request])
    assert proposal.q.token_ids.shape == (4, Q_SUPPORT) < (4, vocab)
    dense = proposal.q.dense(vocab)  # [k, V]
    assert torch.allclose(dense.sum(dim=-1), torch.ones(4))
    assert all(dense[i, t] > 0 for i, t in enumerate(proposal.token_ids))


def test_a_start_reads_only_what_its_prefix_cache_lacks_and_drafts_the_same(tiny_target):
    tokens = list(range(5, 45))
    drafter = _drafter(tiny_target.model, prefix_caching=True)
    assert drafter.start("a", tokens[:30]) == 0
    drafter.release("a")  # its 29 tokens stay cached (the last one is read by a propose)
    assert drafter.start("b", tokens, cache_salt="other") == 0
    drafter.release("b")
    before = drafter.runner.computed_tokens
    assert drafter.start("c", tokens) == 29
    assert drafter.runner.computed_tokens - before == len(tokens) - 1 - 29
    (got,) = drafter.propose([_request("c", tokens, k=4)])
    fresh = _drafter(tiny_target.model)
    assert fresh.start("c", tokens) == 0
    (want,) = fresh.propose([_request("c", tokens, k=4)])
    assert got.token_ids == want.token_ids


def test_sequences_started_together_read_in_a_forward_per_length_and_draft_as_if_alone(tiny_target, monkeypatch):
    """Four sequences start drafting in one round: the two of one length are read in one forward, a cached prefix
    shortens one read, and each drafts what it drafts when started alone. A slot that cannot be had starts none."""
    gen = torch.Generator().manual_seed(1)
    contexts = {
        name: torch.randint(0, 300, (n,), generator=gen).tolist() for name, n in [("a", 12), ("b", 12), ("c", 20)]
    }
    contexts["d"] = contexts["c"][:15] + [7, 8, 9]  # 15 of its 17 context tokens are in "c"'s slot once it ends
    drafter = _drafter(tiny_target.model, prefix_caching=True)
    drafter.start("c", contexts["c"])
    drafter.release("c")
    forwards = []
    extend = drafter.runner.extend
    monkeypatch.setattr(
        drafter.runner,
        "extend",
        lambda slots, feeds, **kw: (forwards.append(sorted(len(f) for f in feeds)), extend(slots, feeds, **kw))[1],
    )
    cached = drafter.start_many([(name, contexts[name], None) for name in "abd"])
    assert cached == [0, 0, 15]
    assert sorted(forwards) == [[2], [11, 11]]  # a and b together; d reads its last 2 context tokens
    together = drafter.propose([_request(name, contexts[name]) for name in "abd"])
    for name, proposal in zip("abd", together):
        fresh = _drafter(tiny_target.model)
        fresh.start(name, contexts[name])
        (alone,) = fresh.propose([_request(name, contexts[name])])
        assert proposal.token_ids == alone.token_ids, name
    full = _drafter(tiny_target.model)
    full.start_many([(f"s{i}", contexts["a"], None) for i in range(3)])
    with pytest.raises(Exception, match="kv_slots|slots"):
        full.start_many([("x", contexts["a"], None), ("y", contexts["b"], None)])  # one slot left for two
    assert full.runner.cache.free_slots == 1 and set(full._slots) == {"s0", "s1", "s2"}


def _grammar(tiny_target, regex: str) -> GrammarState:
    compiler = GrammarCompiler(tiny_target.tokenizer, tiny_target.model.vocab_size, sorted(tiny_target.eos_token_ids))
    return GrammarState(compiler.compile(Constraint("regex", regex)))


def test_a_constrained_row_draws_from_its_masked_q_and_leaves_the_grammar_where_it_was(tiny_target):
    """Sampled beside an unconstrained row: every draft and all of q's mass stay on the allowed tokens (a or b:
    nothing else spells `[ab]{6}` here), each position's mask the grammar's after the drafts before it."""
    vocab = tiny_target.model.vocab_size
    a, b = tiny_target.tokenizer.convert_tokens_to_ids(["a", "b"])
    grammar = _grammar(tiny_target, "[ab]{6}")
    drafter = _drafter(tiny_target.model)
    for seq_id in ("constrained", "free"):
        drafter.start(seq_id, [5, 6, 7])
    shaping = TokenShaping(temperature=1.0)
    requests = [
        DraftRequest(seq_id, [5, 6, 7], 4, shaping, torch.rand(4, dtype=torch.float64), grammar=g)
        for seq_id, g in (("constrained", grammar), ("free", None))
    ]
    constrained, free = drafter.propose(requests)
    assert set(constrained.token_ids) <= {a, b} and len(constrained.token_ids) == 4
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[a, b]] = True
    assert (constrained.q.dense(vocab)[:, ~allowed] == 0).all()
    assert (free.q.dense(vocab)[:, ~allowed] > 0).any()  # the other row's q is its own: unmasked
    assert grammar.num_tokens == 0


def test_a_constrained_row_stops_drafting_at_its_eos(tiny_target):
    """Greedy under `ab`: a and b are forced, then only the eos; nothing after it could be committed."""
    a, b = tiny_target.tokenizer.convert_tokens_to_ids(["a", "b"])
    (eos,) = tiny_target.eos_token_ids
    grammar = _grammar(tiny_target, "ab")
    drafter = _drafter(tiny_target.model)
    drafter.start("s", [5, 6, 7])
    (proposal,) = drafter.propose([DraftRequest("s", [5, 6, 7], 6, TokenShaping(), None, grammar=grammar)])
    assert proposal.token_ids == [a, b, eos]
    assert grammar.num_tokens == 0


def test_a_row_stops_drafting_after_a_draft_it_is_unsure_of(tiny_target):
    """With a confidence threshold each greedy row's proposal is the unthresholded one cut after its first draft
    the draft gave less than the threshold (kept), or whole where every draft was sure enough; rows stop apart."""
    vocab = tiny_target.model.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (12,), generator=gen).tolist() for _ in range(4)]
    plain = _drafter(tiny_target.model)
    for i, prompt in enumerate(prompts):
        plain.start(str(i), prompt)
    requests = [DraftRequest(str(i), p, 6, TokenShaping(), None, return_probs=True) for i, p in enumerate(prompts)]
    full = plain.propose(requests)
    probs = [p for proposal in full for p in proposal.draft_probs]
    ranked = sorted(probs)
    at = len(ranked) // 3  # a third of the drafts fall below it, none near it (batches move probabilities ~1e-6)
    threshold = (ranked[at - 1] + ranked[at]) / 2
    assert ranked[at] - ranked[at - 1] > 1e-4
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=8, max_seq_len=MAX_SEQ_LEN))
    unsure = DraftModelDrafter(runner, runner.vocab_size, confidence_threshold=threshold)
    for i, prompt in enumerate(prompts):
        unsure.start(str(i), prompt)
    cut = unsure.propose(requests)
    for whole, part in zip(full, cut):
        below = [j for j, p in enumerate(whole.draft_probs) if p < threshold]
        expected = below[0] + 1 if below else len(whole.token_ids)
        assert part.token_ids == whole.token_ids[:expected]
        assert part.draft_probs == pytest.approx(whole.draft_probs[:expected], rel=1e-4)
    assert len({len(p.token_ids) for p in cut}) > 1  # not every row stopped at the same draft


def test_a_confidence_threshold_outside_0_1_is_refused(tiny_target):
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=1, max_seq_len=MAX_SEQ_LEN))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="confidence_threshold"):
            DraftModelDrafter(runner, runner.vocab_size, confidence_threshold=bad)


def test_a_cut_head_drafts_from_its_kept_ids_and_the_contexts_only(tiny_target):
    """A draft whose head keeps 64 ids (`models.vocab_head`) draws from a q over those, its special ids and the ids
    of the round's contexts: q is 0 elsewhere, and the drafts come from it."""
    import copy

    from specdec_core.models.vocab_head import cut_vocabulary

    model = copy.deepcopy(tiny_target.model)
    vocab = model.vocab_size
    assert cut_vocabulary(model, 64, [vocab - 1])
    drafter = _drafter(model)
    context = [5, 300, 6, 7, 250]
    drafter.start("s", context)
    uniform = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (proposal,) = drafter.propose([DraftRequest("s", context, 4, TokenShaping(temperature=1.0), uniform)])
    dense = proposal.q.dense(vocab)  # [k, V]
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[:64] = True
    allowed[[250, 300, vocab - 1]] = True
    assert (dense[:, ~allowed] == 0).all() and (dense[:, [250, 300]] > 0).all()
    assert all(dense[i, t] > 0 for i, t in enumerate(proposal.token_ids))
    drafter.observe("s", len(context))  # none of those drafts committed
    greedy = drafter.propose([_request("s", context, k=4)])[0].token_ids
    assert all(allowed[t] for t in greedy)
