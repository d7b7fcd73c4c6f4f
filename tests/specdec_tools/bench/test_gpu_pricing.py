"""The arithmetic of `specdec bench gpu`: recorded rounds priced by hand-computed formulas, bytes read and the read
limit, the copy bandwidth's bytes, the graphs-on verdict on differing tokens, the goals' verdicts, and the runner
that notes each forward's bucket."""

from __future__ import annotations

import pytest
import torch

from specdec_core.cuda_graphs import GraphConfig
from specdec_core.runner import RunnerConfig
from specdec_tools.bench.gpu import device as gpu_device
from specdec_tools.bench.gpu.compare import graphs_verdict
from specdec_tools.bench.gpu.goals import NOT_A_GPU, Goal
from specdec_tools.bench.gpu.projection import Costs, Recorded, price, project, recorded_methods, verify_at
from specdec_tools.bench.gpu.rounds import Forward, LoggingRunner
from specdec_tools.bench.gpu.shapes import (
    TINY_PAIRS,
    forward_bytes,
    kv_bytes_per_position,
    random_model,
    read_limit_ms,
    weight_bytes_read,
)

COSTS = Costs(draft_step_ms=1.0, verify_ms={1: 2.0, 5: 3.0, 9: 4.0}, round_host_ms=0.5, plain_host_ms=0.25)


# -- the projection ---------------------------------------------------------------------------------------------------


def test_a_verify_between_measured_widths_is_interpolated_and_flat_beyond_them():
    assert verify_at(COSTS, 5) == 3.0
    assert verify_at(COSTS, 3) == pytest.approx(2.5)
    assert verify_at(COSTS, 7) == pytest.approx(3.5)
    assert verify_at(COSTS, 17) == 4.0


def test_recorded_rounds_are_priced_as_computed_by_hand():
    recorded = [
        Recorded("draft_model", rounds=2, proposed=8, accepted=6, tokens=8),  # mean width 5
        Recorded("suffix", rounds=2, proposed=4, accepted=2, tokens=4),  # mean width 3: no draft steps
        Recorded("none", rounds=1, proposed=0, accepted=0, tokens=1),
    ]
    # draft_model: 2 x (3.0 + 0.5) + 8 x 1.0 = 15; suffix: 2 x (2.5 + 0.5) = 6; none: 2.0 + 0.5 = 2.5
    # plain: 13 tokens x (2.0 + 0.25) = 29.25
    priced = price(recorded, COSTS)
    assert priced["tokens"] == 13 and priced["rounds"] == 5
    assert priced["speculative_ms"] == pytest.approx(23.5)
    assert priced["plain_ms"] == pytest.approx(29.25)
    assert priced["speculative_tokens_per_s"] == pytest.approx(1000 * 13 / 23.5)
    assert priced["plain_tokens_per_s"] == pytest.approx(1000 * 13 / 29.25)
    assert priced["speedup"] == pytest.approx(29.25 / 23.5)


def by_method(**parts):
    return {label: dict(zip(("rounds", "proposed", "accepted", "tokens"), counts)) for label, counts in parts.items()}


def test_a_report_is_read_per_method_over_its_headline_group_and_says_what_it_lacks():
    report = {
        "methods": ["off", "draft_model", "ngram", "hybrid"],
        "headline_group": "turns_2_plus",
        "results": {"draft_model": {"turns_2_plus": {"decode_speedup": 1.5}}},
        "requests": [
            {"method": "off", "group": "turns_2_plus", "by_method": by_method(none=(5, 0, 0, 5))},
            {"method": "draft_model", "group": "turn_1", "by_method": by_method(draft_model=(9, 9, 9, 9))},
            {"method": "draft_model", "group": "turns_2_plus", "by_method": by_method(draft_model=(1, 4, 4, 5))},
            {"method": "draft_model", "group": "turns_2_plus", "by_method": by_method(draft_model=(1, 4, 0, 1))},
            {"method": "ngram", "group": "turns_2_plus", "rounds": 3},
        ],
    }
    methods = recorded_methods(report)
    assert methods["draft_model"] == [Recorded("draft_model", 2, 8, 4, 6)]  # turn 1 left out
    assert "by_method" in methods["ngram"] and methods["hybrid"] == "no requests recorded"
    assert "off" not in methods
    projected = project(report, COSTS)
    assert projected["draft_model"]["speedup"] == pytest.approx(6 * 2.25 / (2 * 3.5 + 8 * 1.0))
    assert projected["draft_model"]["acceptance"] == 0.5
    assert projected["draft_model"]["recorded_decode_speedup"] == 1.5
    assert "error" in projected["ngram"] and "error" in projected["hybrid"]


# -- bytes read and the read limit -------------------------------------------------------------------------------------


def hand_count(config):
    """Parameters of a Llama-layout model of `config`, counted by hand: the embedding rows once, a head of its own
    unless tied."""
    D, F, V, L = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    hd = D // H
    bias = (H + 2 * KV) * hd if config["model_type"] == "qwen2" else 0  # Qwen2's q/k/v biases
    layer = D * H * hd + 2 * D * KV * hd + H * hd * D + bias + 3 * D * F + 2 * D
    return V * D, L * layer + D, 0 if config["tie_word_embeddings"] else V * D


@pytest.mark.parametrize("pair", TINY_PAIRS, ids=lambda p: p.key)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_forward_reads_every_weight_once_and_not_an_untied_embedding_table(pair, role):
    config = getattr(pair, role)
    model = random_model(config, torch.device("cpu"), torch.float32)
    embedding, body, head = hand_count(config)
    tied = config["tie_word_embeddings"]
    assert weight_bytes_read(model) == 4 * (body + (embedding if tied else head))
    layers, kv, hd = config["num_hidden_layers"], config["num_key_value_heads"], model.args.head_dim
    assert kv_bytes_per_position(model) == layers * 2 * kv * hd * 4


def test_the_read_limit_is_bytes_over_bandwidth():
    nbytes = forward_bytes(weights=3_000_000_000, kv_per_position=28_672, batch=2, positions=605)
    assert nbytes == 3_000_000_000 + 2 * 605 * 28_672
    assert read_limit_ms(nbytes, 4e12) == pytest.approx(1000 * nbytes / 4e12)
    assert read_limit_ms(2e9, 4e12) == pytest.approx(0.5)


def test_the_copy_bandwidth_counts_the_bytes_read_and_written(monkeypatch):
    monkeypatch.setattr(gpu_device, "median_ms", lambda call, device, repeats: 10.0)
    assert gpu_device.copy_bandwidth(torch.device("cpu"), 1 << 20, 3) == pytest.approx(2 * (1 << 20) / 0.010)


# -- verdicts ---------------------------------------------------------------------------------------------------------


def rows(**tokens):
    return {seq_id: {"tokens": list(t)} for seq_id, t in tokens.items()}


def test_graphs_on_tokens_must_equal_graphs_off_and_plain_decoding():
    plain = rows(p0=[1, 2, 3], p1=[4, 5])
    never_a_tie = lambda seq_id, expected, got: False  # noqa: E731
    same = graphs_verdict(plain, rows(p0=[1, 2, 3], p1=[4, 5]), rows(p0=[1, 2, 3], p1=[4, 5], s0=[9]), never_a_tie)
    assert same.identical and same.ok
    off_plain = graphs_verdict(plain, rows(p0=[1, 2, 3], p1=[4, 5]), rows(p0=[1, 2, 7], p1=[4, 5]), never_a_tie)
    assert off_plain.vs_plain == ("p0",) and off_plain.vs_graphs_off == ("p0",) and not off_plain.ok
    off_eager = graphs_verdict(plain, rows(p0=[1, 2, 3], p1=[4, 6]), rows(p0=[1, 2, 3], p1=[4, 5]), never_a_tie)
    assert off_eager.vs_plain == () and off_eager.vs_graphs_off == ("p1",) and not off_eager.ok
    ties = graphs_verdict(plain, plain, rows(p0=[1, 2, 7], p1=[4, 5]), lambda seq_id, expected, got: True)
    assert not ties.identical and ties.near_ties_only and ties.ok


def test_goals_are_judged_on_a_gpu_only():
    goal = Goal("qwen", "plain step", 1.5, 2.0, "ms")
    assert goal.verdict(on_gpu=True) == "met" and goal.verdict(on_gpu=False) == NOT_A_GPU
    assert Goal("qwen", "plain step", 2.5, 2.0, "ms").verdict(on_gpu=True) == "NOT met"
    assert Goal("qwen", "plain step", None, 2.0, "ms").verdict(on_gpu=True) == "not measured"


def test_the_logging_runner_notes_each_forwards_bucket():
    model = random_model(TINY_PAIRS[0].target, torch.device("cpu"), torch.float32)
    log: list[Forward] = []
    graphs = GraphConfig(max_batch=2, widths=(1, 2, 5))
    runner = LoggingRunner(model, RunnerConfig(num_slots=2, max_seq_len=64, cuda_graphs=graphs), "target", log)
    slots = [runner.allocate(), runner.allocate()]
    runner.extend(slots, [[3] * 10, [4] * 10])  # wider than any bucket: eager
    runner.extend(slots[:1], [[5, 6, 7]], all_logits=True)  # 1 row of 3 tokens: bucket (1, 5)
    runner.extend_next(slots, torch.tensor([8, 9]))  # 2 rows of 1: bucket (2, 1)
    assert log == [Forward("target", 2, 10, None), Forward("target", 1, 3, (1, 5)), Forward("target", 2, 1, (2, 1))]
