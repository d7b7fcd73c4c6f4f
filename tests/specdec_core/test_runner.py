"""The runner and its position-written KV cache: rollback, batching of different lengths, limits."""

from __future__ import annotations

import pytest
import torch

from specdec_core.errors import ResourceExhausted
from specdec_core.runner import ModelRunner, RunnerConfig


@pytest.fixture()
def runner(tiny_target) -> ModelRunner:
    return ModelRunner(tiny_target.model, RunnerConfig(num_slots=4, max_seq_len=128))


def _valid_cache(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    n = runner.length(slot)
    return [k[slot, :, :n].clone() for k in runner.cache.keys] + [v[slot, :, :n].clone() for v in runner.cache.values]


def test_rollback_leaves_cache_as_if_no_draft_was_made(runner):
    prompt, drafts, nxt = [5, 17, 42, 99, 7], [11, 12, 13, 14], 23
    clean = runner.allocate()
    runner.extend([clean], [prompt])
    expected = runner.extend([clean], [[nxt]])

    spec = runner.allocate()
    runner.extend([spec], [prompt])
    runner.extend([spec], [drafts], all_logits=True)  # speculate 4 tokens ...
    runner.truncate(spec, len(prompt))  # ... and reject them all: only the length moves
    got = runner.extend([spec], [[nxt]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for a, b in zip(_valid_cache(runner, spec), _valid_cache(runner, clean)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_partial_acceptance_keeps_accepted_prefix(runner):
    prompt = [3, 1, 4, 1, 5]
    ref = runner.allocate()
    runner.extend([ref], [prompt + [9, 2]])
    expected = runner.extend([ref], [[6]])
    spec = runner.allocate()
    runner.extend([spec], [prompt])
    runner.extend([spec], [[9, 2, 8, 8]], all_logits=True)
    runner.truncate(spec, len(prompt) + 2)  # two drafts accepted, two rejected
    torch.testing.assert_close(runner.extend([spec], [[6]]), expected, rtol=0, atol=1e-5)


def test_batched_verify_of_different_lengths_equals_each_alone(runner):
    prompts = [[1, 2, 3], [10, 20, 30, 40, 50, 60, 70], [7]]
    feeds = [[4, 5, 6, 7], [8], [9, 10]]
    alone = []
    for prompt, feed in zip(prompts, feeds):
        slot = runner.allocate()
        runner.extend([slot], [prompt])
        alone.append(runner.extend([slot], [feed], all_logits=True)[0, : len(feed)])
        runner.release(slot)
    slots = [runner.allocate() for _ in prompts]
    for slot, prompt in zip(slots, prompts):
        runner.extend([slot], [prompt])
    batched = runner.extend(slots, feeds, all_logits=True)  # [3, 4, V]
    for b, feed in enumerate(feeds):
        torch.testing.assert_close(batched[b, : len(feed)], alone[b], rtol=0, atol=1e-5)
        assert runner.length(slots[b]) == len(prompts[b]) + len(feed)


def test_last_logits_of_each_row(runner):
    slots = [runner.allocate(), runner.allocate()]
    full = runner.extend(slots, [[1, 2, 3], [4]], all_logits=True)
    runner.truncate(slots[0], 0), runner.truncate(slots[1], 0)
    last = runner.extend(slots, [[1, 2, 3], [4]])
    torch.testing.assert_close(last[0], full[0, 2], rtol=0, atol=1e-5)
    torch.testing.assert_close(last[1], full[1, 0], rtol=0, atol=1e-5)


def test_chunked_prefill_equals_one_shot(runner):
    prompt = list(range(1, 40))
    a, b = runner.allocate(), runner.allocate()
    one = runner.extend([a], [prompt])
    runner.extend([b], [prompt[:13]])
    runner.extend([b], [prompt[13:30]])
    two = runner.extend([b], [prompt[30:]])
    torch.testing.assert_close(one, two, rtol=0, atol=1e-5)


def test_limits_are_clear_errors(runner):
    slot = runner.allocate()
    with pytest.raises(ResourceExhausted, match="max_seq_len"):
        runner.extend([slot], [[1] * 129])
    for _ in range(3):
        runner.allocate()
    with pytest.raises(ResourceExhausted, match="kv_slots"):
        runner.allocate()
    runner.release(slot)
    assert runner.allocate() == slot


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_fork_continues_like_its_source_and_leaves_it_untouched(tiny_target, prefix_caching):
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=3, max_seq_len=128, prefix_caching=prefix_caching))
    source = runner.allocate()
    runner.extend([source], [[5, 17, 42, 99, 7, 11]])
    before = _valid_cache(runner, source)
    fork = runner.fork(source, 4)  # a branch after the first 4 tokens
    assert runner.length(fork) == 4 and runner.length(source) == 6
    got = runner.extend([fork], [[23, 24]])

    alone = runner.allocate()
    runner.extend([alone], [[5, 17, 42, 99]])
    expected = runner.extend([alone], [[23, 24]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for a, b in zip(_valid_cache(runner, fork), _valid_cache(runner, alone)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(_valid_cache(runner, source), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ResourceExhausted, match="kv_slots"):
        runner.fork(source, 2)
    runner.discard(fork)
    runner.discard(alone)
    assert runner.cache.free_slots == 2
    # Dropped without becoming cache entries: what is left to find is the source's.
    assert runner.cached_prefix([5, 17, 42, 99, 23, 24]) == (4 if prefix_caching else 0)
