"""The KV cache's sliding-window layers (`kv_cache.Ring`): memory that follows the window, rollback by a length that
never reads a key the ring lost, batches of rows at different positions, prefix caching. Checked on the cache
itself and through a tiny random Gemma 3 (window 8) against transformers' logits for the same tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec_core.kv_cache import KVCache, Ring
from specdec_core.models.loader import load_model
from specdec_core.models.window import held_positions
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import build_tiny_gemma3, one_torch_thread

TOL = 1e-4  # fp32 on both sides (as family_checks.LOGITS_TOLERANCE)
SEQUENCE = [(11 * i * i + 5 * i + 2) % 380 for i in range(48)]
# max_extend 4: rings of 8 + 2 * 4 = 16 positions, so 48 positions wrap them three times.
SMALL = dict(max_seq_len=64, max_extend=4)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are thousands of small ops: a second thread only contends for the cores (`one_torch_thread`)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def gemma_dir(tiny_dir, tmp_path_factory):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "m", tiny_dir / "tokenizer", seed=41)


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_model(gemma_dir, dtype="float32").model


@pytest.fixture(scope="module")
def reference(gemma_dir):
    """transformers' logits [T, V] after each token of `tokens` (one forward, no cache of ours)."""
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([tokens])).logits[0]

    return logits


def _cache(ring_size: int = 6, window: int = 4) -> KVCache:
    """Two layers, the first a ring; head dim 1, so a key can be its own position."""
    return KVCache(2, 2, 1, 32, 1, torch.float32, ring=Ring(frozenset({0}), window, ring_size))


def _write(cache: KVCache, slot: int, start: int, end: int) -> None:
    positions = torch.arange(start, end).view(1, -1)  # [1, T]
    k = positions.float().view(1, -1, 1, 1)  # [1, T, Hkv, hd]: each key is its position
    for layer in range(2):
        cache.write(layer, torch.tensor([slot]), positions, k, k)
    cache.wrote(slot, start, end)


def test_a_ring_holds_the_last_positions_at_position_mod_its_size():
    cache = _cache()
    assert cache.keys[0].shape == (2, 1, 6, 1) and cache.keys[1].shape == (2, 1, 32, 1)
    _write(cache, 0, 0, 7)
    _write(cache, 0, 7, 10)
    held = cache.read_held(0, torch.tensor([0]))[0].flatten().tolist()
    assert held == [6, 7, 8, 9, 4, 5]
    assert held == held_positions(torch.tensor([[10]]), 6)[0].tolist()  # what the attention mask assumes
    _write(cache, 1, 0, 15)  # one write longer than the ring: its last 6 positions stay
    assert cache.read_held(0, torch.tensor([1]))[0].flatten().tolist() == [12, 13, 14, 9, 10, 11]
    assert cache.read_held(1, torch.tensor([1]))[0][0, 0, :15].flatten().tolist() == list(range(15))


def test_a_rollback_deeper_than_the_ring_holds_is_refused():
    """After positions [0, 12) the ring (6) holds 6..11: a length needs the 3 (W - 1) positions before it."""
    cache = _cache()
    _write(cache, 0, 0, 12)
    for length in (12, 10, 9):
        cache.set_length(0, length)
    with pytest.raises(ValueError, match="deeper than their ring"):
        cache.set_length(0, 8)  # needs 5, which position 11 overwrote
    assert cache.lengths[0] == 9
    assert not cache.holds_window(0, 9, write=(9, 13))  # a write up to 12 would take position 6 too
    cache.set_length(0, 0)  # a new sequence in the slot: it needs nothing before position 0...
    assert cache.holds_window(0, 3, write=(0, 3))  # ...nor before 3, all written now
    _write(cache, 0, 0, 3)
    cache.set_length(0, 3)


def test_memory_per_slot_of_windowed_layers_is_bounded_by_the_window(gemma):
    """Rings of W + 2 * max_extend positions whatever the context; the full layer grows with it; bytes per
    position count the full layer only, and a KV budget holds as many more slots as that saves."""
    short, long = (ModelRunner(gemma, RunnerConfig(num_slots=2, max_seq_len=n)) for n in (64, 512))
    for runner in (short, long):
        ring, capacity = runner.cache.ring, runner.cache.capacity
        assert ring is not None and ring.size == 8 + 2 * 16
        assert [runner.cache.held(i) for i in range(3)] == [ring.size, capacity, ring.size]
    kv_bytes = 2 * 2 * 16 * 4  # keys and values, 2 KV heads of 16 floats
    assert long.cache.bytes_per_position == kv_bytes  # one full layer of three
    assert long.cache.ring_bytes == 2 * 40 * kv_bytes
    per_slot = (long.cache.capacity + 2 * 40) * kv_bytes
    budget = ModelRunner(gemma, RunnerConfig(num_slots=16, max_seq_len=512, max_cache_bytes=5 * per_slot))
    assert budget.cache.num_slots == 5
    assert 5 * per_slot // (3 * long.cache.capacity * kv_bytes) == 1  # what the same budget holds without rings


def test_rollback_after_a_verify_across_the_ring_boundary(gemma, reference):
    """A verify of 5 positions crossing the ring's end (14..18 of a 16-position ring), all its drafts wrong and
    rolled back, then the real tokens: every logit is transformers' for the real sequence."""
    runner = ModelRunner(gemma, RunnerConfig(num_slots=1, **SMALL))
    slot = runner.allocate()
    got = [runner.extend([slot], [SEQUENCE[:14]], all_logits=True)[0]]
    wrong = [SEQUENCE[14], 1, 2, 3, 4]  # the last committed token and 4 drafts no one would accept
    got.append(runner.extend([slot], [wrong], all_logits=True)[0, :1])  # the committed token's row is real
    runner.truncate(slot, 15)  # the committed token stays, the drafts go
    for at, n in ((15, 4), (19, 1), (20, 5), (25, 1), (26, 22)):
        got.append(runner.extend([slot], [SEQUENCE[at : at + n]], all_logits=True)[0])
    torch.testing.assert_close(torch.cat(got), reference(SEQUENCE), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="deeper than their ring"):
        runner.truncate(slot, 30)  # 48 written: the ring (16) no longer holds 23..29


def test_batched_rows_at_different_lengths(gemma, reference):
    """Rows at 3, 21 and 38 positions (different phases of their rings), then one padded batch of 4, 1 and 3
    tokens; and two rows prefilled together in one forward longer than the ring."""
    runner = ModelRunner(gemma, RunnerConfig(num_slots=5, **SMALL))
    seqs = [SEQUENCE[i : i + 45] for i in (0, 1, 2)]
    slots = [runner.allocate() for _ in seqs]
    for slot, seq, n in zip(slots, seqs, (3, 21, 38)):
        runner.extend([slot], [seq[:n]])
    counts = (4, 1, 3)
    logits = runner.extend(slots, [seq[n : n + c] for seq, n, c in zip(seqs, (3, 21, 38), counts)], all_logits=True)
    for b, (seq, n, c) in enumerate(zip(seqs, (3, 21, 38), counts)):
        torch.testing.assert_close(logits[b, :c], reference(seq[: n + c])[n:], rtol=TOL, atol=TOL)
    pair = [runner.allocate(), runner.allocate()]
    long = runner.extend(pair, [SEQUENCE[:30], SEQUENCE[5:35]], all_logits=True)  # [2, 30, V]
    torch.testing.assert_close(long[1], reference(SEQUENCE[5:35]), rtol=TOL, atol=TOL)


def test_a_slot_a_long_sequence_left_serves_a_short_one(gemma, reference):
    """Its rings hold only the old sequence's last positions: the new one, from position 0, needs none of them."""
    runner = ModelRunner(gemma, RunnerConfig(num_slots=1, **SMALL))
    runner.extend([slot := runner.allocate()], [SEQUENCE[:40]])
    runner.release(slot)
    got = runner.extend([runner.allocate()], [SEQUENCE[3:6]], all_logits=True)[0]
    torch.testing.assert_close(got, reference(SEQUENCE[3:6]), rtol=TOL, atol=TOL)


def test_padding_that_would_overwrite_a_window_is_refused_before_the_forward(gemma):
    runner = ModelRunner(gemma, RunnerConfig(num_slots=2, **SMALL))
    a, b = runner.allocate(), runner.allocate()
    runner.extend([a], [SEQUENCE[:20]])
    with pytest.raises(ValueError, match="overwrite a window"):
        runner.extend([a, b], [SEQUENCE[20:21], SEQUENCE[:12]])  # row a padded by 11: past its slack of 9
    assert (runner.length(a), runner.length(b)) == (20, 0)


def test_prefix_caching_reuses_a_window_its_ring_still_holds_and_declines_one_it_lost(gemma, reference):
    """An ended sequence of 30 tokens (its rings hold 14..29): a new one extending all of it starts from its 30
    (taken over in place); one sharing its first 12 would need 5..11, long overwritten, so it starts from nothing;
    a copy of 33 from the first, running again, holds the window too. Each then gives transformers' logits."""
    runner = ModelRunner(gemma, RunnerConfig(num_slots=3, prefix_caching=True, **SMALL))
    first = runner.allocate()
    runner.extend([first], [SEQUENCE[:20]])
    runner.extend([first], [SEQUENCE[20:30]])
    runner.release(first)
    other = SEQUENCE[:12] + SEQUENCE[30:40]
    assert runner.cached_prefix(other[:-1]) == 0 and runner.cached_prefix(SEQUENCE[:35]) == 30
    cases = [(SEQUENCE[:36], 30), (other, 0), (SEQUENCE[:34], 33)]  # the last copies from the first, now running
    slots = []
    for tokens, cached in cases:
        slots.append(slot := runner.allocate(tokens[:-1]))
        assert runner.length(slot) == cached
        got = runner.extend([slot], [tokens[cached:]], all_logits=True)[0]
        torch.testing.assert_close(got, reference(tokens)[cached:], rtol=TOL, atol=TOL)
    assert slots[0] == first and slots[2] not in (first, slots[1])
