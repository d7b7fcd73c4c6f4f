"""Prefix caching on the runner: a new sequence starts from the longest prefix a running sequence or an ended one's
entry holds for its salt, computes only the rest and gets the logits of a full computation; entries are evicted
least recently used first within the same slots; a failed forward never leaves a corrupt entry."""

from __future__ import annotations

import pytest
import torch

from specdec_core.errors import ResourceExhausted
from specdec_core.prefix_cache import common_prefix
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import logits_after

PROMPT = list(range(5, 40))


def _runner(loaded, **config) -> ModelRunner:
    return ModelRunner(
        loaded.model, RunnerConfig(**{"num_slots": 4, "max_seq_len": 128, "prefix_caching": True, **config})
    )


def _start(runner: ModelRunner, tokens: list[int], salt: str | None = None) -> tuple[int, torch.Tensor]:
    """What a prefill does: a slot holding the longest cached prefix of all but the last token, then the rest
    computed. Returns the slot and the logits after the last token [V]."""
    slot = runner.allocate(tokens[:-1], salt)
    return slot, runner.extend([slot], [tokens[runner.length(slot) :]])[0]


def _cache_bytes(runner: ModelRunner) -> int:
    return sum(t.numel() * t.element_size() for t in [*runner.cache.keys, *runner.cache.values])


@pytest.mark.parametrize(
    "a, b, n",
    [
        ([], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        (list(range(600)), list(range(600)), 600),
        (list(range(600)), [*range(300), -1, *range(301, 600)], 300),
    ],
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_a_conversations_next_turn_computes_only_what_is_new(tiny_target):
    runner = _runner(tiny_target)
    first, _ = _start(runner, PROMPT)
    runner.extend([first], [[77]])  # an output token, read by a decode step
    runner.release(first)
    turn = [*PROMPT, 77, 12, 13, 14]
    before = runner.computed_tokens
    slot, logits = _start(runner, turn)
    assert slot == first  # every token of the entry is in the prefix: taken over, nothing copied
    assert runner.computed_tokens - before == 3  # 12, 13, 14
    torch.testing.assert_close(logits, logits_after(tiny_target.model, turn)[-1], rtol=0, atol=1e-5)
    stats = runner.prefix_cache_stats()
    assert (stats.hit_tokens, stats.queried_tokens) == (len(PROMPT) + 1, len(PROMPT) - 1 + len(turn) - 1)
    assert stats.entries == 0 and stats.bytes == 0


def test_a_partial_prefix_is_copied_and_the_entry_it_came_from_stays(tiny_target):
    runner = _runner(tiny_target)
    first, _ = _start(runner, PROMPT)
    runner.release(first)
    other = [*PROMPT[:20], 300, 301, 302]
    slot, logits = _start(runner, other)
    assert slot != first and runner.length(slot) == len(other)
    assert runner.prefix_cache_stats().hit_tokens == 20
    torch.testing.assert_close(logits, logits_after(tiny_target.model, other)[-1], rtol=0, atol=1e-5)
    again, logits = _start(runner, [*PROMPT, 9])  # the whole first prompt is still cached
    assert again == first and runner.prefix_cache_stats().hit_tokens == 20 + len(PROMPT)
    torch.testing.assert_close(logits, logits_after(tiny_target.model, [*PROMPT, 9])[-1], rtol=0, atol=1e-5)


def test_a_running_sequence_shares_its_prefix_and_goes_on_undisturbed(tiny_target):
    runner = _runner(tiny_target)
    running, _ = _start(runner, PROMPT)
    follower, logits = _start(runner, [*PROMPT, 200, 201])
    assert follower != running and runner.prefix_cache_stats().hit_tokens == len(PROMPT)
    torch.testing.assert_close(logits, logits_after(tiny_target.model, [*PROMPT, 200, 201])[-1], rtol=0, atol=1e-5)
    nxt = runner.extend([running], [[3, 4]], all_logits=True)[0]  # the source goes on as if alone
    torch.testing.assert_close(nxt, logits_after(tiny_target.model, [*PROMPT, 3, 4])[-2:], rtol=0, atol=1e-5)


def test_entries_are_evicted_least_recently_used_first_and_running_sequences_are_untouched(tiny_target):
    one_slot = _cache_bytes(_runner(tiny_target, num_slots=1))
    runner = _runner(tiny_target, num_slots=8, max_cache_bytes=3 * one_slot)  # the budget holds three sequences
    assert runner.cache.num_slots == 3
    prompts = {name: [i, *range(50 + 10 * i, 70 + 10 * i)] for i, name in enumerate("abcde")}
    slots = {name: _start(runner, prompts[name])[0] for name in "abc"}
    runner.release(slots["a"])
    runner.release(slots["b"])  # two entries, a the older; c runs
    assert runner.cache.free_slots == 2  # entries are free slots: admission is unchanged
    d, _ = _start(runner, prompts["d"])
    assert d == slots["a"] and runner.prefix_cache_stats().evictions == 1
    e, _ = _start(runner, prompts["e"])
    assert e == slots["b"] and runner.prefix_cache_stats().evictions == 2
    assert runner.cache.free_slots == 0
    with pytest.raises(ResourceExhausted, match="kv_slots"):
        runner.allocate(prompts["a"])  # three running: no entry to evict, nothing else to take
    nxt = runner.extend([slots["c"]], [[9]])[0]  # the running sequence never lost a position
    torch.testing.assert_close(nxt, logits_after(tiny_target.model, [*prompts["c"], 9])[-1], rtol=0, atol=1e-5)
    runner.release(d)
    slot, _ = _start(runner, prompts["a"])  # a's entry was evicted: computed again, from nothing
    assert runner.length(slot) == len(prompts["a"])
    assert runner.prefix_cache_stats().hit_tokens == 0
    assert _cache_bytes(runner) == 3 * one_slot  # memory never grew


def test_salts_share_prefixes_only_within_themselves(tiny_target):
    runner = _runner(tiny_target)
    slot, _ = _start(runner, PROMPT, salt="alice")
    runner.release(slot)
    for salt, cached in [("bob", 0), (None, 0), ("alice", len(PROMPT) - 1)]:
        before = runner.prefix_cache_stats()
        assert runner.cached_prefix(PROMPT[:-1], salt) == cached, salt  # a look: nothing claimed or counted
        assert runner.prefix_cache_stats() == before
        other = runner.allocate(PROMPT[:-1], salt)
        assert runner.length(other) == cached, salt
        runner.release(other)
    assert runner.cached_prefix([*PROMPT[:10], 999], "alice") == 10
    assert _runner(tiny_target, prefix_caching=False).cached_prefix(PROMPT) == 0


def test_a_failed_forward_leaves_the_valid_prefix_and_nothing_else(tiny_target):
    runner = _runner(tiny_target)
    slot, _ = _start(runner, PROMPT)

    def fail(*_):
        raise RuntimeError("device lost")

    hook = runner.model.layers[-1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="device lost"):  # every layer but the last wrote its keys
            runner.extend([slot], [[1, 2, 3, 4]], all_logits=True)
    finally:
        hook.remove()
    assert runner.length(slot) == len(PROMPT) and runner.prefix.tokens(slot) == PROMPT
    runner.release(slot)
    tokens = [*PROMPT, 1, 2, 9]  # agrees with what the failed forward half wrote: none of it may be reused
    again, logits = _start(runner, tokens)
    assert runner.length(again) == len(tokens) and runner.prefix_cache_stats().hit_tokens == len(PROMPT)
    torch.testing.assert_close(logits, logits_after(tiny_target.model, tokens)[-1], rtol=0, atol=1e-5)


def test_without_prefix_caching_every_sequence_computes_its_whole_prompt(tiny_target):
    runner = _runner(tiny_target, prefix_caching=False)
    slot, _ = _start(runner, PROMPT)
    runner.release(slot)
    before = runner.computed_tokens
    again, _ = _start(runner, PROMPT)
    assert runner.computed_tokens - before == len(PROMPT)
    assert runner.prefix_cache_stats().queried_tokens == 0
