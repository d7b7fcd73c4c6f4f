"""CUDA graphs of the runner's forwards (`cuda_graphs.py`): the buckets, and the static-shape forward a graph
captures, run eagerly on the CPU against the eager path: the same logits, the same cache for every sequence,
padding rows confined to the scratch slot. Capture itself needs CUDA: refused here, checked by the last test on a
machine with a GPU."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from specdec_core.cuda_graphs import GraphConfig, GraphCounters, batch_sizes, bucket_for, buckets
from specdec_core.errors import ResourceExhausted
from specdec_core.kv_cache import slot_bytes
from specdec_core.models.moe import MoEArgs
from specdec_core.models.transformer import ModelArgs, Transformer
from specdec_core.models.vocab_head import cut_vocabulary
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import one_torch_thread

ATOL = 1e-5  # fp32 on both sides: only the batch shape of the matrix products differs
MAX_SEQ_LEN = 96
WIDTHS = (1, 3, 5)  # gaps on purpose: a call of 2 or 4 tokens pads within its rows


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are thousands of small ops: a second thread only contends for the cores (`one_torch_thread`)."""
    with one_torch_thread():
        yield


def _pair(model, graphs: GraphConfig, **config) -> tuple[ModelRunner, ModelRunner]:
    """An eager runner and one with static-shape forwards (run eagerly: no CUDA here), alike otherwise."""
    config = {"num_slots": 6, "max_seq_len": MAX_SEQ_LEN, "max_extend": 6, **config}
    return ModelRunner(model, RunnerConfig(**config)), ModelRunner(model, RunnerConfig(**config, cuda_graphs=graphs))


def _prefill(runners, prompts) -> list[int]:
    """Each prompt in a slot of its own in every runner (the same slots in each); eager everywhere: no bucket is
    as wide as a prompt."""
    slots = []
    for prompt in prompts:
        (slot,) = {runner.allocate() for runner in runners}
        for runner in runners:
            runner.extend([slot], [prompt])
        slots.append(slot)
    return slots


def _valid(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    """The keys and values of `slot`'s valid positions, every layer."""
    n = runner.length(slot)
    return [k[slot, :, :n] for k in runner.cache.keys] + [v[slot, :, :n] for v in runner.cache.values]


def _random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


# -- buckets ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "max_batch, sizes", [(1, (1,)), (2, (1, 2)), (6, (1, 2, 4, 6)), (8, (1, 2, 4, 8)), (9, (1, 2, 4, 8, 9))]
)
def test_batch_sizes_are_powers_of_two_then_max_batch(max_batch, sizes):
    assert batch_sizes(max_batch) == sizes


CONFIGS = [GraphConfig(1, (1,)), GraphConfig(5, (2,)), GraphConfig(6, (1, 2, 3, 4, 5)), GraphConfig(8, (1, 4, 9))]


@pytest.mark.parametrize("config", CONFIGS)
def test_buckets_are_every_batch_size_with_every_width_largest_first(config):
    captured = buckets(config)
    assert set(captured) == set(itertools.product(batch_sizes(config.max_batch), config.widths))
    assert len(captured) == len(set(captured))
    areas = [b * w for b, w in captured]
    assert areas == sorted(areas, reverse=True)


@pytest.mark.parametrize("config", CONFIGS)
def test_bucket_for_is_the_smallest_captured_bucket_that_holds_the_call(config):
    """Against a brute-force search: of the buckets at least as large in both, the one no larger in either than any
    other; None where there is none."""
    for batch in range(1, config.max_batch + 3):
        for width in range(1, config.widths[-1] + 3):
            holding = [(b, w) for b, w in buckets(config) if b >= batch and w >= width]
            smallest = [c for c in holding if all(c[0] <= d[0] and c[1] <= d[1] for d in holding)]
            assert bucket_for(batch, width, config) == (smallest[0] if smallest else None), (batch, width)


@pytest.mark.parametrize(
    "max_batch, widths, field",
    [(0, (1,), "max_batch"), (2, (), "widths"), (2, (0, 1), "widths"), (2, (3, 1), "widths"), (2, (1, 1), "widths")],
)
def test_a_graph_config_refuses_bad_values_naming_them(max_batch, widths, field):
    with pytest.raises(ValueError, match=field):
        GraphConfig(max_batch, widths)


# -- the static-shape forward against the eager one ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_static_forwards_give_the_eager_logits_and_cache(tiny_target, seed):
    """Random batches of rows at different lengths, of every width up to the widest bucket and past it, last or all
    logits, with random rollbacks: every call's logits, every length and every valid key are the eager path's. The
    keys written past a row's length by a bucket's padding are never read: later calls would show it."""
    rng = random.Random(seed)
    vocab = tiny_target.model.vocab_size
    eager, static = _pair(tiny_target.model, GraphConfig(max_batch=4, widths=WIDTHS), max_seq_len=160)
    slots = _prefill((eager, static), [_random_tokens(rng, rng.randint(6, 20), vocab) for _ in range(6)])
    counts = {"replays": 0, "eager_prefill": len(slots), "eager_unfit": 0}
    for _ in range(40):
        rows = rng.sample(slots, rng.randint(1, len(slots)))
        feeds = [_random_tokens(rng, rng.randint(1, WIDTHS[-1] + 1), vocab) for _ in rows]
        all_logits = rng.random() < 0.5
        wide, many = max(map(len, feeds)) > WIDTHS[-1], len(rows) > 4
        counts["eager_prefill" if wide else "eager_unfit" if many else "replays"] += 1
        expected = eager.extend(rows, feeds, all_logits=all_logits)
        got = static.extend(rows, feeds, all_logits=all_logits)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        for slot in rows:
            if rng.random() < 0.3:  # a verify's rejected drafts
                keep = rng.randint(eager.length(slot) - 3, eager.length(slot))
                eager.truncate(slot, keep)
                static.truncate(slot, keep)
        assert [static.length(s) for s in slots] == [eager.length(s) for s in slots]
        for slot in slots:
            torch.testing.assert_close(_valid(static, slot), _valid(eager, slot), atol=ATOL, rtol=0)
    assert static.graph_counters() == GraphCounters(**counts)
    assert counts["replays"] > 10  # most calls went through a bucket: the comparison is of the static path
    assert eager.graph_counters() == GraphCounters()


def test_padding_rows_write_only_the_scratch_slot(tiny_target):
    """Three rows in a bucket of four, every slot holding a sequence: the whole cache but the scratch slot is what the
    eager forward leaves (buckets as wide as the call, so both pad rows alike), and the padding row wrote positions
    0 .. W-1 of the scratch slot (filled with a sentinel before: the tiny model's keys of token 0 are zeros)."""
    rng = random.Random(3)
    vocab = tiny_target.model.vocab_size
    eager, static = _pair(tiny_target.model, GraphConfig(max_batch=4, widths=(1, 2, 3, 4)))
    slots = _prefill((eager, static), [_random_tokens(rng, 8 + i, vocab) for i in range(6)])
    scratch = static.cache.scratch_slot
    assert scratch == static.cache.num_slots == 6
    for k in static.cache.keys + static.cache.values:
        k[scratch] = 7.0
    rows, feeds = [slots[4], slots[0], slots[2]], [[5, 6, 7], [8], [9, 10]]
    torch.testing.assert_close(
        static.extend(rows, feeds, all_logits=True), eager.extend(rows, feeds, all_logits=True), atol=ATOL, rtol=0
    )
    assert static.graph_counters().replays == 1
    for mine, theirs in zip(static.cache.keys + static.cache.values, eager.cache.keys + eager.cache.values):
        torch.testing.assert_close(mine[:scratch], theirs, atol=ATOL, rtol=0)  # [slots, Hkv, capacity, hd]
    for k in static.cache.keys + static.cache.values:  # [slots + 1, Hkv, capacity, hd]
        assert (k[scratch, :, :3] != 7.0).all() and (k[scratch, :, 3:] == 7.0).all()


def test_calls_no_bucket_takes_run_eagerly_and_are_counted(tiny_target):
    """Wider than the widest bucket (a prompt), more rows than max_batch, and a row whose bucket's width would run
    past its slot (max_extend 1: a slot holds one position past max_seq_len): eager, counted, and right."""
    eager, static = _pair(tiny_target.model, GraphConfig(max_batch=2, widths=(1, 4)), max_extend=1)
    slots = _prefill((eager, static), [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    assert static.graph_counters() == GraphCounters(eager_prefill=3)

    def both(rows: list[int], feeds: list[list[int]]) -> None:
        torch.testing.assert_close(static.extend(rows, feeds), eager.extend(rows, feeds), atol=ATOL, rtol=0)

    both(slots, [[1], [2], [3]])  # three rows, max_batch 2
    both(slots[:2], [[4, 5], [6]])  # bucket (2, 4)
    both(slots[:1], [[7] * (MAX_SEQ_LEN - 2 - eager.length(slots[0]))])  # a prefill-sized catch-up
    both(slots[:1], [[8, 9]])  # at max_seq_len - 2: padded to 4 it would leave the slot
    assert static.length(slots[0]) == MAX_SEQ_LEN
    assert static.graph_counters() == GraphCounters(replays=1, eager_prefill=4, eager_unfit=2)


def _decode(runner: ModelRunner, prompts: list[list[int]], rounds: int) -> list[list[int]]:
    """Greedy tokens in rounds of a verify over every row at once: the last token and 0-3 drafts made up from it,
    accepted while the argmax agrees, the rest rolled back."""
    vocab = runner.vocab_size
    slots = [runner.allocate() for _ in prompts]
    out = [[int(runner.extend([s], [p])[0].argmax())] for s, p in zip(slots, prompts)]
    for _ in range(rounds):
        feeds = [[o[-1], *[(o[-1] * 7 + i) % vocab for i in range(1, 1 + len(o) % 4)]] for o in out]
        logits = runner.extend(slots, feeds, all_logits=True)  # [B, T, V]
        for b, (slot, feed) in enumerate(zip(slots, feeds)):
            picks = logits[b, : len(feed)].argmax(-1).tolist()
            accepted = 0
            while accepted < len(feed) - 1 and picks[accepted] == feed[accepted + 1]:
                accepted += 1
            out[b] += picks[: accepted + 1]
            runner.truncate(slot, runner.length(slot) - (len(feed) - 1 - accepted))
    return out


PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [27, 18, 28, 18, 28], [16, 18, 3, 39, 88, 74, 98, 94, 8, 48, 20]]


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPTS[:1]])  # one row too: no `single` views in a bucket
def test_a_speculative_loop_decodes_the_same_tokens_through_buckets(tiny_target, prompts):
    eager, static = _pair(tiny_target.model, GraphConfig(max_batch=4, widths=(1, 2, 3, 4)))
    assert _decode(static, prompts, rounds=12) == _decode(eager, prompts, rounds=12)
    assert static.graph_counters() == GraphCounters(replays=12, eager_prefill=len(prompts))


# -- the scratch slot and the budget -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_scratch_slot_is_never_allocated(tiny_target, prefix_caching):
    config = RunnerConfig(num_slots=3, max_seq_len=64, prefix_caching=prefix_caching, cuda_graphs=GraphConfig(2, (1,)))
    runner = ModelRunner(tiny_target.model, config)
    scratch = runner.cache.scratch_slot
    assert scratch == 3 and runner.cache.keys[0].shape[0] == 4
    assert scratch not in runner.cache.free_slot_ids
    handed = set()
    for round_ in range(3):  # allocate all, release all, again: with prefix caching the released slots are entries
        slots = [runner.allocate(reuse=[1, 2, 3, round_]) for _ in range(3)]
        with pytest.raises(ResourceExhausted, match="kv_slots"):
            runner.allocate()
        for slot in slots:
            runner.extend([slot], [[1, 2, 3, round_]])
            runner.release(slot)
        handed.update(slots)
    assert handed == {0, 1, 2}


def test_the_kv_budget_counts_the_scratch_slot(tiny_target):
    model = tiny_target.model

    def runner(budget: int, graphs: GraphConfig | None = None) -> ModelRunner:
        return ModelRunner(model, RunnerConfig(max_seq_len=64, max_cache_bytes=budget, cuda_graphs=graphs))

    cache = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=64)).cache
    k = cache.keys[0]  # [slots, Hkv, capacity, hd]
    per_slot = slot_bytes(len(cache.keys), k.shape[1], cache.capacity, k.shape[3], k.dtype)
    graphs = GraphConfig(4, (1, 2))
    assert runner(3 * per_slot).cache.num_slots == 3
    budgeted = runner(3 * per_slot, graphs)
    assert budgeted.cache.num_slots == 2
    assert sum(t.numel() * t.element_size() for t in budgeted.cache.keys + budgeted.cache.values) == 3 * per_slot
    assert runner(per_slot).cache.num_slots == 1
    with pytest.raises(ResourceExhausted, match="CUDA graphs one more"):
        runner(per_slot, graphs)


def test_buckets_stop_at_the_slots_the_cache_has(tiny_target):
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=3, max_seq_len=64, cuda_graphs=GraphConfig(8, (1,))))
    assert runner.graphs is not None and runner.graphs.config == GraphConfig(3, (1,))
    assert set(runner.graphs.inputs) == {(1, 1), (2, 1), (3, 1)}
    inputs = sum(8 * (2 * b * 1 + 2 * b) for b in (1, 2, 3))  # int64 tokens, positions, slots, last index
    assert runner.graphs.static_bytes == inputs + 4 * 3 * 1 * runner.vocab_size  # and float32 logits [3, 1, V]


# -- refusals -------------------------------------------------------------------------------------------------------


def test_capture_is_refused_without_cuda(tiny_target):
    runner = ModelRunner(tiny_target.model, RunnerConfig(num_slots=2, max_seq_len=64, cuda_graphs=GraphConfig(2, (1,))))
    assert runner.capture_report is None  # not captured at construction on the CPU
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device: .* on cpu"):
        runner.capture()
    with pytest.raises(ValueError, match="no cuda_graphs"):
        ModelRunner(tiny_target.model, RunnerConfig(num_slots=2, max_seq_len=64)).capture()


def _small_args(**features) -> ModelArgs:
    return ModelArgs(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        **features,
    )


def _cut_head() -> Transformer:
    model = Transformer(_small_args())
    assert cut_vocabulary(model, keep=64, always=[1])
    return model


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: Transformer(_small_args(sliding_window=4, windowed_layers=(0,))), "sliding-window"),
        (lambda: Transformer(_small_args(moe=MoEArgs(4, 2, 16, (1,), True, False))), "mixture of experts"),
        (_cut_head, "part of the vocabulary"),
    ],
)
def test_models_the_static_forward_cannot_run_are_refused(build, words):
    model = build()
    ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=32))  # the model itself runs
    with pytest.raises(ValueError, match=f"cuda_graphs: not for a model with .*{words}"):
        ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=32, cuda_graphs=GraphConfig(1, (1,))))


# -- on a GPU -------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_captured_graphs_decode_the_same_tokens_as_eager_forwards_on_cuda(tiny_dir):
    from specdec_core.models.loader import load_model

    model = load_model(tiny_dir / "target", dtype="float32").model.to("cuda")
    eager, graphed = _pair(model, GraphConfig(max_batch=4, widths=(1, 2, 3, 4)))
    report = graphed.capture_report
    assert report is not None and len(report.buckets) == 3 * 4 and report.seconds > 0
    assert report.reserved_bytes > 0  # the graphs' private pool
    assert report.static_bytes == graphed.graphs.static_bytes > 0
    assert _decode(graphed, PROMPTS, rounds=24) == _decode(eager, PROMPTS, rounds=24)
    assert graphed.graph_counters() == GraphCounters(replays=24, eager_prefill=len(PROMPTS))
