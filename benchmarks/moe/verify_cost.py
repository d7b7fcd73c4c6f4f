"""A mixture-of-experts target's verify cost by width on this machine, and the k that `auto` chooses with it.

A verify of w tokens reads every expert its w rows route to: up to w * top_k experts a layer, where a dense model's
verify reads the same weights as a decode step. The cost model (`specdec_core.adaptive.CostModel`) prices a round by
the verify costs it measured per width, whatever their shape; this shows that shape for Qwen3-30B-A3B's layers and
what `auto` makes of it.

Builds a random-weight model with Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, 8 a token,
32 query and 4 key/value heads of 128, vocabulary 151,936) and `--layers` of its 48 layers, in bf16 on the CPU
kernels; prefills `--context` tokens, then times a verify forward of w = 1..17 tokens (the median of `--repeats`,
the cache rolled back after each) and counts the distinct experts the w rows route to, per sparse layer. Then it
feeds the measured costs to a `CostModel`, with a draft step costing `--draft-ratio` of the measured decode step,
and prints the k that `AdaptivePolicy` chooses at several acceptance rates (`max_k` 16), and, beside it, what it
would choose were the verify cost flat in width (a dense model's rule of thumb). The default ratio, 0.15, is about
a Qwen3-0.6B draft in int8 (0.6 GB read a step) against the whole model's decode step (3.3B active parameters,
6.6 GB in bf16), with room for the draft's fixed costs: the model here has fewer layers, so its own step is not
the one a draft is weighed against.

    PYTHONPATH=.:proto python benchmarks/moe/verify_cost.py --json out/moe_verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
ACCEPTANCE = (0.5, 0.7, 0.8, 0.9)


def build(layers: int) -> Any:
    import torch

    from specdec_core.kernels.surgery import use_cpu_kernels
    from specdec_core.models.families import args_from_hf_config
    from specdec_core.models.transformer import Transformer

    args = args_from_hf_config({**QWEN3_30B_A3B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16: no fp32 copy of the experts
    try:
        model = Transformer(args).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    use_cpu_kernels(model)
    return model


def measure(model: Any, context: int, widths: range, repeats: int) -> list[dict[str, Any]]:
    """Per width: the median verify seconds and the mean count of distinct experts a sparse layer's rows route to."""
    import torch

    from specdec_core.models.moe import SparseMoE, experts_touched
    from specdec_core.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=context + max(widths) + 1, prefix_caching=False))
    touched: list[int] = []
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.gate.register_forward_hook(
                lambda mod, inputs, logits, moe=module: touched.append(experts_touched(logits, moe.args))
            )
    ids = torch.randint(10, 30000, (context + max(widths),), generator=torch.Generator().manual_seed(1)).tolist()
    slot = runner.allocate()
    runner.extend([slot], [ids[:context]])
    rows = []
    for width in widths:
        seconds, counts = [], []
        for _ in range(repeats):
            touched.clear()
            start = time.perf_counter()
            runner.extend([slot], [ids[context : context + width]], all_logits=True)
            seconds.append(time.perf_counter() - start)
            runner.truncate(slot, context)
            counts.append(statistics.mean(touched))
        rows.append({"width": width, "ms": statistics.median(seconds) * 1e3, "experts_per_layer": counts[-1]})
        print(f"w={width:2d}: {rows[-1]['ms']:7.1f} ms, {counts[-1]:5.1f} experts a sparse layer", flush=True)
    return rows


def choices(rows: list[dict[str, Any]], draft_ratio: float, flat: bool) -> dict[float, int]:
    """`auto`'s k at each acceptance rate with these verify costs (or, `flat`, every width at the plain step's)."""
    from specdec_core.adaptive import AcceptanceEstimate, AdaptivePolicy, CostModel

    policy = AdaptivePolicy(max_k=len(rows) - 1)
    costs = CostModel()
    for _ in range(policy.explore_samples):
        for row in rows:
            costs.observe_verify(1, row["width"], (rows[0]["ms"] if flat else row["ms"]) / 1e3)
    for k in range(1, len(rows)):
        costs.observe_draft(1, k, k * draft_ratio * rows[0]["ms"] / 1e3)
    return {a: policy.choose(AcceptanceEstimate.starting_at(a), costs, 1) for a in ACCEPTANCE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="of Qwen3-30B-A3B's 48 (each ~1.2 GB of experts)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-width", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--draft-ratio", type=float, default=0.15, help="a draft step's cost / the decode step's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(build(args.layers), args.context, range(1, args.max_width + 1), args.repeats)
    measured, flat = choices(rows, args.draft_ratio, flat=False), choices(rows, args.draft_ratio, flat=True)
    for a in ACCEPTANCE:
        print(f"acceptance {a}: auto chooses k = {measured[a]} (measured costs), {flat[a]} (were verify flat)")
    if args.json:
        report = {"shape": QWEN3_30B_A3B, "layers": args.layers, "context": args.context}
        report |= {"draft_ratio": args.draft_ratio, "torch_threads": torch.get_num_threads()}
        report |= {"widths": rows, "auto_k": measured, "auto_k_if_flat": flat}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
