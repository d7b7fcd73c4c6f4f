"""The whole engine on tiny models: greedy exactness, batching, stopping, cancellation, bad input."""

from __future__ import annotations

import pytest

from specdec_core.adaptive import AcceptanceEstimate, CostModel
from specdec_core.config import MIN_TEMPERATURE, SamplingParams
from specdec_core.errors import InvalidArgument
from specdec_core.request import Request
from specdec_core.stopping import FinishReason
from tests.helpers import contrarian, logits_after, make_engine, perturbed, reference_prob, run_to_completion

PROMPTS = ["def add(a, b):", "The quick brown fox", "for index, value in enumerate(range(10)):\n    print("]


def _ids(loaded, text):
    return loaded.tokenizer(text)["input_ids"]


def _plain(loaded, prompt_ids, params):
    engine = make_engine(loaded)
    return run_to_completion(engine, [("r", prompt_ids, params, 0)])["r"]


@pytest.mark.parametrize("agreement", ["always", "sometimes", "never"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_speculation_equals_plain_decoding(tiny_target, agreement, k):
    draft = {
        "always": lambda m: m,
        "sometimes": lambda m: perturbed(m, 0.2, seed=3),
        "never": contrarian,
    }[agreement](tiny_target.model)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    proposed = accepted = 0
    for text in PROMPTS:
        ids = _ids(tiny_target, text)
        expected, _, _ = _plain(tiny_target, ids, params)
        tokens, _, last = run_to_completion(make_engine(tiny_target, draft), [("r", ids, params, k)])["r"]
        assert tokens == expected
        assert last.finish_reason == FinishReason.LENGTH and len(tokens) == 40
        proposed, accepted = proposed + last.stats.proposed, accepted + last.stats.accepted
    rate = accepted / proposed
    assert {"always": rate == 1.0, "sometimes": 0.0 < rate < 1.0, "never": rate == 0.0}[agreement], rate


def test_drafts_stopped_by_the_drafts_confidence_leave_greedy_output_unchanged(tiny_target):
    """A confidence threshold cuts proposals short (fewer drafts than k in some rounds) and changes no token."""
    draft = perturbed(tiny_target.model, 0.2, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short = rounds = 0
    for text in PROMPTS:
        ids = _ids(tiny_target, text)
        expected, _, _ = _plain(tiny_target, ids, params)
        engine = make_engine(tiny_target, draft, confidence_threshold=0.05)
        engine.add_request(Request("r", tuple(ids), params, 4))
        tokens = []
        while engine.has_work:
            for out in engine.step():
                tokens += out.new_token_ids
                if out.round is not None and out.round.k == 4:
                    rounds += 1
                    short += len(out.round.proposed_token_ids) < 4
        assert tokens == expected
    assert 0 < short < rounds, (short, rounds)


def test_ngram_drafting_is_exact_and_proposes(tiny_target):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ids = _ids(tiny_target, "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n") * 2
    expected, _, _ = _plain(tiny_target, ids, params)
    tokens, _, last = run_to_completion(make_engine(tiny_target, "ngram"), [("r", ids, params, 4)])["r"]
    assert tokens == expected
    assert last.stats.proposed > 0


class _LabelledOracle:
    """Knows the target's greedy continuation. Rounds alternate between two labels: "span" proposals are right to
    their end; "first" proposals are right in their first token only."""

    name = "oracle"

    def __init__(self, prompt: list[int], continuation: list[int], vocab: int) -> None:
        self.prompt, self.continuation, self.vocab = prompt, continuation, vocab
        self.round = 0

    def start(self, seq_id, prompt_ids, cache_salt=None):
        return 0

    def cached(self, seq_id, token_ids, cache_salt=None):
        return 0

    def observe(self, seq_id, num_committed):
        pass

    def release(self, seq_id):
        pass

    def propose(self, requests):
        from specdec_core.drafters.base import Proposal

        (r,) = requests
        done = len(r.token_ids) - len(self.prompt)
        right = self.continuation[done : done + r.num_tokens]
        self.round += 1
        if self.round % 2:
            return [Proposal(right, None, label="span")]
        return [Proposal(right[:1] + [(t + 1) % self.vocab for t in right[1:]], None, label="first")]


class _FixedCosts(CostModel):
    def __init__(self) -> None:
        super().__init__()
        self.verify = {b: {t: 0.1 * (1 + 0.02 * (t - 1)) for t in range(1, 10)} for b in (1, 2)}

    def observe_verify(self, batch_size, tokens_per_row, seconds):
        pass


def test_labelled_proposals_are_cut_to_what_their_label_earns(tiny_target):
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    prompt = _ids(tiny_target, PROMPTS[0])
    expected, _, _ = _plain(tiny_target, prompt, params)
    engine = make_engine(tiny_target)
    engine.drafter = _LabelledOracle(prompt, expected, engine.target.vocab_size)
    engine.costs = _FixedCosts()  # the tiny model's timings are noise: verify costs 2% more per token
    engine.add_request(Request("r", tuple(prompt), params, 6))
    tokens, lengths = [], {"span": [], "first": []}
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
            if out.round is not None and out.round.proposed_token_ids:
                label = "span" if engine.drafter.round % 2 else "first"
                lengths[label].append(len(out.round.proposed_token_ids))
    assert tokens == expected  # cutting a proposal never changes the output
    # Once each label has a record, "span" proposals are kept whole and "first" ones cut towards their one good
    # token (the second stays while the record of that position, one trial at a time, still allows it to pay).
    assert lengths["span"][-5:] == [6] * 5
    assert max(lengths["first"][-4:]) <= 2, lengths


def test_concurrent_requests_do_not_disturb_each_other(tiny_target):
    """Different prompts, lengths, k and sampling settings in one batch give what each gives alone."""
    draft = perturbed(tiny_target.model, 0.3, seed=1)
    requests = [
        ("a", _ids(tiny_target, PROMPTS[0]), SamplingParams(max_tokens=30, ignore_eos=True), 3),
        ("b", _ids(tiny_target, PROMPTS[1]), SamplingParams(max_tokens=12, ignore_eos=True), 1),
        (
            "c",
            _ids(tiny_target, PROMPTS[2]),
            SamplingParams(max_tokens=25, temperature=0.9, seed=5, ignore_eos=True),
            2,
        ),
        ("d", _ids(tiny_target, "import os"), SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=9), 0),
    ]
    together = run_to_completion(make_engine(tiny_target, draft), requests)
    for request in requests:
        alone = run_to_completion(make_engine(tiny_target, draft), [request])[request[0]]
        assert together[request[0]][0] == alone[0], request[0]


def test_stop_string_inside_accepted_drafts_ends_where_plain_decoding_does(tiny_target):
    ids = _ids(tiny_target, PROMPTS[0])
    free, text, _ = _plain(tiny_target, ids, SamplingParams(max_tokens=40, ignore_eos=True))
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string that first appears mid-output
    assert stop.strip()
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))
    plain_tokens, plain_text, plain_last = _plain(tiny_target, ids, params)
    # The draft is the target itself: every draft is accepted, so the stop is met inside an accepted run.
    tokens, spec_text, last = run_to_completion(make_engine(tiny_target, tiny_target.model), [("r", ids, params, 6)])[
        "r"
    ]
    assert (tokens, spec_text) == (plain_tokens, plain_text)
    assert last.finish_reason == plain_last.finish_reason == FinishReason.STOP
    assert stop not in spec_text and len(tokens) < 40
    assert text.startswith(spec_text + stop)


def test_max_tokens_is_exact_when_a_round_would_overshoot(tiny_target):
    ids = _ids(tiny_target, PROMPTS[1])
    for max_tokens in (1, 2, 5, 7):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        tokens, _, last = run_to_completion(make_engine(tiny_target, tiny_target.model), [("r", ids, params, 4)])["r"]
        assert len(tokens) == max_tokens and last.finish_reason == FinishReason.LENGTH
        assert tokens == _plain(tiny_target, ids, params)[0]


def test_eos_ends_output_like_plain_decoding(tiny_target):
    eos = min(tiny_target.eos_token_ids)
    params = SamplingParams(max_tokens=100)
    for text in PROMPTS + ["Speculative decoding", "class Counter:"]:
        ids = _ids(tiny_target, text)
        expected, _, plain_last = _plain(tiny_target, ids, params)
        tokens, _, last = run_to_completion(make_engine(tiny_target, tiny_target.model), [("r", ids, params, 5)])["r"]
        assert tokens == expected and last.finish_reason == plain_last.finish_reason
        if last.finish_reason == FinishReason.EOS:
            assert tokens[-1] == eos and eos not in tokens[:-1]


def test_cancel_frees_caches_in_target_and_draft(tiny_target):
    engine = make_engine(tiny_target, tiny_target.model, num_slots=2)
    engine.add_request(
        Request("a", tuple(_ids(tiny_target, PROMPTS[0])), SamplingParams(max_tokens=50, ignore_eos=True), 2)
    )
    engine.add_request(
        Request("b", tuple(_ids(tiny_target, PROMPTS[1])), SamplingParams(max_tokens=50, ignore_eos=True), 2)
    )
    engine.step(), engine.step()
    assert engine.target.runner.cache.slots_in_use == 2 and engine.drafter.active_sequences == 2
    final = engine.abort("a")
    assert final.finish_reason == FinishReason.CANCELLED
    assert engine.target.runner.cache.slots_in_use == 1 and engine.drafter.active_sequences == 1
    assert engine.abort("nope") is None
    while engine.has_work:
        engine.step()
    assert engine.target.runner.cache.slots_in_use == 0 and engine.drafter.active_sequences == 0


class _Recording:
    """A drafter wrapper that records which sequences were started, and can refuse to start them."""

    def __init__(self, inner, refuse: bool = False) -> None:
        self.inner, self.refuse, self.started = inner, refuse, []
        self.name = inner.name

    def start(self, seq_id, prompt_ids, cache_salt=None):
        if self.refuse:
            raise RuntimeError("no room for drafts")
        self.started.append((seq_id, len(prompt_ids)))
        return self.inner.start(seq_id, prompt_ids, cache_salt)

    def cached(self, seq_id, token_ids, cache_salt=None):
        return self.inner.cached(seq_id, token_ids, cache_salt)

    def propose(self, requests):
        assert all(r.num_tokens > 0 for r in requests)  # rows at k = 0 are not the drafter's business
        return self.inner.propose(requests)

    def observe(self, seq_id, num_committed):
        self.inner.observe(seq_id, num_committed)

    def release(self, seq_id):
        self.inner.release(seq_id)


def test_the_drafter_starts_a_sequence_only_when_it_first_drafts(tiny_target):
    draft = perturbed(tiny_target.model, 0.2, seed=3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = make_engine(tiny_target, draft)
    engine.drafter = recorder = _Recording(engine.drafter)
    prompt = _ids(tiny_target, PROMPTS[2])
    engine.add_request(Request("plain", tuple(prompt), params, 0))
    engine.add_request(Request("spec", tuple(prompt), params, 3))
    engine.step()  # admission: prefill only
    assert recorder.started == []
    engine.step()  # the first round: "spec" drafts, and is started with all it has (prompt and first token)
    assert recorder.started == [("spec", len(prompt) + 1)]
    while engine.has_work:
        engine.step()
    assert recorder.started == [("spec", len(prompt) + 1)] and recorder.inner.active_sequences == 0
    assert engine.costs.catch_up is not None  # the start read long enough a context to be timed


class _PaysAloneOnly(CostModel):
    """Measured costs under which speculation pays for one sequence (verify is flat in k) and never for four
    (verify grows with every token), with a price on starting drafts."""

    def __init__(self) -> None:
        super().__init__()
        self.verify = {1: {t: 0.1 for t in range(1, 10)}, 4: {t: 0.1 * t for t in range(1, 10)}}
        self.verify_samples = {b: dict.fromkeys(range(1, 10), 99) for b in (1, 4)}
        self.draft = {b: {k: 0.001 * k for k in range(1, 9)} for b in (1, 4)}
        self.catch_up = 1e-4

    def observe_verify(self, batch_size, tokens_per_row, seconds):
        pass

    def observe_draft(self, batch_size, steps, seconds):
        pass

    def observe_catch_up(self, tokens, seconds):
        pass


@pytest.mark.parametrize("joining", [0, 3])
def test_drafts_are_not_started_for_a_batch_about_to_grow_past_where_they_pay(tiny_target, joining):
    """One sequence runs; `joining` more wait to be admitted right after this round. Alone, starting its drafts
    pays; in the batch of four that the round is about to become, it never would."""
    engine = make_engine(tiny_target, tiny_target.model, num_slots=4)
    engine.drafter = recorder = _Recording(engine.drafter)
    engine.costs = _PaysAloneOnly()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(Request("first", tuple(_ids(tiny_target, PROMPTS[0])), params, "auto"))
    engine.step()
    for name in ["a", "b", "c"][:joining]:
        engine.add_request(Request(name, tuple(_ids(tiny_target, PROMPTS[1])), params, "auto"))
    engine.step(), engine.step()
    assert [seq_id for seq_id, _ in recorder.started] == ([] if joining else ["first"])


class _DearStarts(_PaysAloneOnly):
    """Speculation pays for one sequence, and the drafter reads a context at 20 ms a token: a start that reads
    150 tokens (3 s) costs more than its drafts save over 20 tokens, one that reads 20 does not."""

    def __init__(self) -> None:
        super().__init__()
        self.catch_up = 0.02


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_start_is_priced_at_what_the_drafters_prefix_cache_lacks(tiny_target, prefix_caching):
    """A conversation's next turn: the draft model's prefix cache holds the last turn, so starting its drafts reads
    only the new message, and `auto` speculates; without the cache the same start reads the whole context, and
    does not."""
    engine = make_engine(tiny_target, tiny_target.model, prefix_caching=prefix_caching)
    engine.costs = _DearStarts()
    engine.acceptance = AcceptanceEstimate.starting_at(0.9, weight=1e6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    first = (_ids(tiny_target, PROMPTS[2]) * 8)[:120]
    answer, _, _ = run_to_completion(engine, [("turn1", first, params, 3)])["turn1"]
    second = first + answer + _ids(tiny_target, PROMPTS[1])[:10]
    tokens, _, last = run_to_completion(engine, [("turn2", second, params, "auto")])["turn2"]
    assert tokens == _plain(tiny_target, second, params)[0]
    assert (last.stats.proposed > 0) == prefix_caching, last.stats


def _nearly_free_verification(explore_samples: int) -> CostModel:
    """Measured costs at one sequence under which every further draft pays: a verify of 17 tokens a row costs
    about what one does, and a draft step almost nothing."""
    costs = CostModel()
    for tokens in range(1, 18):
        for _ in range(explore_samples):  # enough samples that nothing is left to explore
            costs.observe_verify(1, tokens, 0.1 + 1e-4 * tokens)
    for k in range(1, 17):
        costs.observe_draft(1, k, 1e-4 * k)
    return costs


@pytest.mark.parametrize("largest", [16, 5])
def test_auto_chooses_up_to_the_engines_max_speculative_tokens_and_no_further(tiny_target, largest):
    """`auto` considers every k a request may ask for (max_speculative_tokens, up to 16 in the config): where
    drafts are nearly always accepted and verification is nearly free, the largest allowed is best."""
    engine = make_engine(tiny_target, tiny_target.model, max_speculative_tokens=largest)
    engine.costs = _nearly_free_verification(engine.config.policy.explore_samples)
    engine.acceptance = AcceptanceEstimate.starting_at(0.99, weight=1e6)  # where a new request's estimate starts
    engine.add_request(
        Request("r", tuple(_ids(tiny_target, PROMPTS[0])), SamplingParams(max_tokens=40, ignore_eos=True), "auto")
    )
    engine.step()  # admission: prefill only
    (output,) = engine.step()
    assert output.round.k == largest


def test_a_drafter_that_cannot_start_a_sequence_costs_speculation_not_the_request(tiny_target):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = _ids(tiny_target, PROMPTS[0])
    expected, _, _ = _plain(tiny_target, prompt, params)
    engine = make_engine(tiny_target, tiny_target.model)
    engine.drafter = _Recording(engine.drafter, refuse=True)
    tokens, _, last = run_to_completion(engine, [("r", prompt, params, 3)])["r"]
    assert tokens == expected and last.finish_reason == FinishReason.LENGTH
    assert last.stats.proposed == 0


def test_sequences_that_cannot_start_together_are_started_one_by_one(tiny_target):
    """Several sequences start drafting in one round: together where the drafter can (`start_many`); where that
    fails, each alone, so one that cannot start costs only its own speculation."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = {f"r{i}": _ids(tiny_target, text) for i, text in enumerate(PROMPTS)}
    for fails in (False, True):
        engine = make_engine(tiny_target, tiny_target.model)
        calls = []
        start_many = engine.drafter.start_many

        def together(starts, start_many=start_many, fails=fails, calls=calls):
            calls.append(len(starts))
            if fails and len(starts) > 1:
                raise RuntimeError("no room for all of them")
            return start_many(starts)  # `start` comes here too, with one

        engine.drafter.start_many = together
        done = run_to_completion(engine, [(name, ids, params, 2) for name, ids in prompts.items()])
        assert calls == [len(PROMPTS)] + [1] * len(PROMPTS) * fails
        for name, ids in prompts.items():
            tokens, _, last = done[name]
            assert tokens == _plain(tiny_target, ids, params)[0] and last.stats.proposed > 0, (fails, name)


class _Flaky:
    """Fault injection: a drafter whose `propose` raises on every `every`-th call, after the drafter it wraps has
    drafted (its state has moved on by drafts the engine never sees)."""

    def __init__(self, inner, every: int) -> None:
        self.inner, self.every, self.name = inner, every, inner.name
        self.calls = self.raised = 0

    def start(self, seq_id, prompt_ids, cache_salt=None):
        return self.inner.start(seq_id, prompt_ids, cache_salt)

    def cached(self, seq_id, token_ids, cache_salt=None):
        return self.inner.cached(seq_id, token_ids, cache_salt)

    def propose(self, requests):
        self.calls += 1
        proposals = self.inner.propose(requests)
        if self.calls % self.every == 0:
            self.raised += 1
            raise RuntimeError("injected drafter fault")
        return proposals

    def observe(self, seq_id, num_committed):
        self.inner.observe(seq_id, num_committed)

    def release(self, seq_id):
        self.inner.release(seq_id)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_a_drafter_that_raises_costs_speculation_not_the_requests(tiny_target, draft):
    """Every third batched propose raises: the round goes on with no drafts for its rows, and later rounds draft
    again. Greedy tokens are plain decoding's, and no request ends with an error. The draft model is the target
    itself, so every draft is right only if the drafter, started again, read exactly the committed context."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [_ids(tiny_target, text) for text in PROMPTS]
    engine = make_engine(tiny_target, tiny_target.model if draft == "model" else "ngram")
    engine.drafter = flaky = _Flaky(engine.drafter, every=3)
    requests = [(f"r{i}", ids, params, k) for i, (ids, k) in enumerate(zip(prompts, [3, 2, "auto"]))]
    results = run_to_completion(engine, requests)
    for i, ids in enumerate(prompts):
        tokens, _, last = results[f"r{i}"]
        assert tokens == _plain(tiny_target, ids, params)[0]
        assert last.finish_reason == FinishReason.LENGTH and last.error is None
    assert flaky.raised >= 3
    proposed = sum(r[2].stats.proposed for r in results.values())
    assert proposed > 0
    if draft == "model":
        assert sum(r[2].stats.accepted for r in results.values()) == proposed
        assert flaky.inner.active_sequences == 0  # every sequence's draft state released


def test_a_drafter_that_keeps_raising_is_logged_once_and_tried_ever_more_rarely(tiny_target, caplog):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = _ids(tiny_target, PROMPTS[0])
    engine = make_engine(tiny_target, tiny_target.model)
    engine.drafter = flaky = _Flaky(engine.drafter, every=1)
    with caplog.at_level("WARNING", logger="specdec_core.faults"):
        tokens, _, last = run_to_completion(engine, [("r", prompt, params, 3)])["r"]
    assert tokens == _plain(tiny_target, prompt, params)[0] and last.finish_reason == FinishReason.LENGTH
    assert last.stats.rounds == 39 and last.stats.proposed == 0
    assert [r.name for r in caplog.records] == ["specdec_core.faults"]  # one burst: one record
    assert "injected drafter fault" in caplog.records[0].getMessage()
    assert flaky.calls <= 8  # rests of 0, 1, 3, 7, 15, ... rounds: not a call a round
    assert flaky.inner.active_sequences == 0


def test_a_sequence_back_from_plain_rounds_catches_up_exactly(tiny_target):
    """Rounds at k = 0 leave the draft behind; the next round with drafts reads what it missed (past the batch's
    padding allowance, in a forward of its own). Output stays exact; with a draft that always agrees, every
    draft after the catch-up is accepted, so the draft read the right context."""
    engine = make_engine(tiny_target, tiny_target.model)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = _ids(tiny_target, PROMPTS[1])
    expected, _, _ = _plain(tiny_target, prompt, params)
    schedule = iter([2, 2] + [0] * 25 + [3] * 100)
    engine._choose_ks = lambda seqs, offers: ([next(schedule)] * len(seqs), [False] * len(seqs))
    tokens, _, last = run_to_completion(engine, [("r", prompt, params, "auto")])["r"]
    assert tokens == expected
    assert last.stats.proposed > 20 and last.stats.accepted == last.stats.proposed


def test_waiting_requests_are_admitted_as_slots_free(tiny_target):
    engine = make_engine(tiny_target, tiny_target.model, num_slots=2)
    requests = [
        (f"r{i}", _ids(tiny_target, PROMPTS[i % 3]), SamplingParams(max_tokens=8, ignore_eos=True), 2) for i in range(5)
    ]
    results = run_to_completion(engine, requests)
    assert all(len(tokens) == 8 for tokens, _, _ in results.values())


@pytest.mark.parametrize(
    "prompt,params,k,field",
    [
        ([], SamplingParams(), None, "prompt"),
        ([1, 10_000], SamplingParams(), None, "prompt_token_ids"),
        ([-1], SamplingParams(), None, "prompt_token_ids"),
        ([1] * 300, SamplingParams(), None, "prompt"),
        ([1] * 200, SamplingParams(max_tokens=100), None, "max_tokens"),
        ([1, 2], SamplingParams(), 99, "num_speculative_tokens"),
        ([1, 2], SamplingParams(), "sometimes", "num_speculative_tokens"),
    ],
)
def test_bad_requests_fail_before_any_work(tiny_target, prompt, params, k, field):
    engine = make_engine(tiny_target, tiny_target.model)
    with pytest.raises(InvalidArgument) as err:
        engine.add_request(Request("r", tuple(prompt), params, k))
    assert err.value.field == field and field in str(err.value)
    assert not engine.has_work and engine.target.runner.cache.slots_in_use == 0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e-45}, "temperature"),  # logits / temperature would overflow to inf, then NaN
        ({"temperature": 0.0009}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_the_smallest_temperature_allowed_samples_valid_tokens(tiny_target):
    """MIN_TEMPERATURE, drafts and all, is far enough from 0 that nothing overflows."""
    params = SamplingParams(temperature=MIN_TEMPERATURE, seed=3, max_tokens=8, ignore_eos=True)
    tokens, _, last = run_to_completion(make_engine(tiny_target, tiny_target.model), [("r", [5, 6, 7], params, 3)])["r"]
    assert last.error is None and last.finish_reason == FinishReason.LENGTH
    assert len(tokens) == 8 and all(0 <= t < tiny_target.model.vocab_size for t in tokens)


def test_duplicate_stop_strings_are_merged():
    assert SamplingParams(stop=("a", "b", "a")).stop == ("a", "b")


def test_return_probs_reports_the_models_probabilities_of_the_proposals(tiny_target):
    """q and p of each proposed token, recomputed from each model's logits over the round's context (committed
    tokens plus the drafts before it); None when the request did not ask."""
    draft = perturbed(tiny_target.model, 0.2, seed=3)
    ids = _ids(tiny_target, PROMPTS[0])
    # top_k 50 < the drafter's q support (128): the q it draws from is exactly the processed distribution.
    cases = {
        "greedy": SamplingParams(max_tokens=30, ignore_eos=True),
        "sampled": SamplingParams(max_tokens=30, temperature=0.8, top_k=50, seed=4, ignore_eos=True),
    }
    engine = make_engine(tiny_target, draft)
    for name, params in cases.items():
        engine.add_request(Request(name, tuple(ids), params, 3, return_probs=True))
    engine.add_request(Request("off", tuple(ids), cases["sampled"], 3))
    rounds, outputs = {name: [] for name in (*cases, "off")}, {name: [] for name in (*cases, "off")}
    while engine.has_work:
        for out in engine.step():
            if out.round is not None:
                rounds[out.seq_id].append((len(outputs[out.seq_id]), out.round))
            outputs[out.seq_id] += out.new_token_ids
    assert outputs["off"] == outputs["sampled"]  # asking changes nothing that is drawn
    assert all(info.draft_probs is None and info.target_probs is None for _, info in rounds["off"])
    checked = {"accepted": 0, "rejected": 0}
    for name, params in cases.items():
        for position, info in rounds[name]:
            drafts = list(info.proposed_token_ids)
            assert len(info.draft_probs) == len(info.target_probs) == len(drafts)
            context = ids + outputs[name][:position] + drafts
            target_logits, draft_logits = logits_after(tiny_target.model, context), logits_after(draft, context)
            for i, token in enumerate(drafts):
                row = len(ids) + position + i - 1  # the logits that predict draft i
                assert abs(info.target_probs[i] - reference_prob(target_logits[row], token, params)) < 1e-4
                assert abs(info.draft_probs[i] - reference_prob(draft_logits[row], token, params)) < 1e-4
                checked["accepted" if i < info.num_accepted else "rejected"] += 1
    assert checked["accepted"] > 0 and checked["rejected"] > 0


# -- prefix caching ---------------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=12, ignore_eos=True)


def _uncached(loaded, draft, prompt, params, k):
    """The tokens of an engine without a prefix cache."""
    return run_to_completion(make_engine(loaded, draft), [("r", prompt, params, k)])["r"][0]


def test_a_conversations_second_turn_computes_only_its_new_tokens(tiny_target):
    engine = make_engine(tiny_target, prefix_caching=True)
    runner = engine.target.runner
    first = _ids(tiny_target, PROMPTS[0])
    reply = run_to_completion(engine, [("t1", first, GREEDY, 0)])["t1"][0]
    new = [40, 41, 42, 43]
    second = first + reply + new
    before = runner.computed_tokens
    engine.add_request(Request("t2", tuple(second), GREEDY, 0))
    (out,) = engine.step()  # the prefill alone: nothing else runs
    # The target held turn one's prompt and every reply token but the last (sampled, never read): that one and
    # the new tokens are computed, nothing else.
    assert runner.computed_tokens - before == len(new) + 1
    assert out.num_cached_tokens == len(second) - len(new) - 1
    tokens, last = list(out.new_token_ids), out
    while engine.has_work:
        for last in engine.step():
            tokens += last.new_token_ids
    assert last.finished and last.num_cached_tokens == out.num_cached_tokens
    assert tokens == _uncached(tiny_target, None, second, GREEDY, 0)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 3])
def test_cache_hits_change_no_token(tiny_target, params, k):
    draft = perturbed(tiny_target.model, 0.2, seed=3)
    engine = make_engine(tiny_target, draft, prefix_caching=True)
    prompt = _ids(tiny_target, PROMPTS[2])
    reply = run_to_completion(engine, [("first", prompt, params, k)])["first"][0]
    assert reply == _uncached(tiny_target, draft, prompt, params, k)
    cases = {  # name: (prompt, fewest tokens cached)
        "same": (prompt, len(prompt) - 1),
        "partial": (prompt[:6] + [399, 398, 397], 6),
        "next turn": (prompt + reply + [11, 12], len(prompt) + len(reply) - 1),
    }
    for name, (tokens, cached) in cases.items():
        got, _, last = run_to_completion(engine, [(name, tokens, params, k)])[name]
        assert last.num_cached_tokens >= cached, name
        assert got == _uncached(tiny_target, draft, tokens, params, k), name


def test_the_draft_model_reuses_its_cache_too(tiny_target):
    draft = tiny_target.model  # a draft that always agrees: a draft cache that went wrong would show as rejections
    engine = make_engine(tiny_target, draft, prefix_caching=True)
    prompt = _ids(tiny_target, PROMPTS[1])
    reply = run_to_completion(engine, [("t1", prompt, GREEDY, 3)])["t1"][0]
    hits = engine.drafter.runner.prefix_cache_stats().hit_tokens
    second = prompt + reply + [40, 41, 42]
    tokens, _, last = run_to_completion(engine, [("t2", second, GREEDY, 3)])["t2"]
    # The draft held turn one's committed tokens but those of its last round (at most k + 1), which it had not
    # read yet when the turn ended.
    assert engine.drafter.runner.prefix_cache_stats().hit_tokens - hits >= len(prompt) + len(reply) - 4
    assert last.stats.accepted == last.stats.proposed > 0
    assert tokens == _uncached(tiny_target, draft, second, GREEDY, 3)


def test_salts_share_cached_prefixes_only_within_themselves(tiny_target):
    engine = make_engine(tiny_target, prefix_caching=True)
    prompt = _ids(tiny_target, PROMPTS[0])
    runs = [
        ("alice", "alice", 0),
        ("bob", "bob", 0),
        ("anonymous", None, 0),
        ("alice again", "alice", len(prompt) - 1),
        ("anonymous again", None, len(prompt) - 1),
    ]
    outputs = []
    for request_id, salt, cached in runs:
        tokens, _, last = run_to_completion(engine, [(request_id, prompt, GREEDY, 0, salt)])[request_id]
        assert last.num_cached_tokens == cached, request_id
        outputs.append(tokens)
    assert all(tokens == outputs[0] for tokens in outputs)


def test_a_cancelled_request_leaves_a_usable_cache_entry(tiny_target):
    draft = perturbed(tiny_target.model, 0.2, seed=3)
    engine = make_engine(tiny_target, draft, prefix_caching=True)
    prompt = _ids(tiny_target, PROMPTS[2])
    engine.add_request(Request("cut", tuple(prompt), SamplingParams(max_tokens=60, ignore_eos=True), 3))
    partial = []
    for _ in range(4):
        for out in engine.step():
            partial += out.new_token_ids
    assert engine.abort("cut").finish_reason is FinishReason.CANCELLED
    tokens = prompt + partial + [21, 22]
    got, _, last = run_to_completion(engine, [("next", tokens, GREEDY, 3)])["next"]
    assert last.num_cached_tokens == len(prompt) + len(partial) - 1  # the target held all it had committed
    assert got == _uncached(tiny_target, draft, tokens, GREEDY, 3)


def test_without_prefix_caching_nothing_is_cached(tiny_target):
    engine = make_engine(tiny_target)
    prompt = _ids(tiny_target, PROMPTS[0])
    for request_id in ("a", "b"):
        assert run_to_completion(engine, [(request_id, prompt, GREEDY, 0)])[request_id][2].num_cached_tokens == 0
