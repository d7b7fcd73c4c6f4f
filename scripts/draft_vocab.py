"""What cutting the draft's LM head to part of the vocabulary (`draft.vocabulary`, `models/vocab_head.py`) costs in
agreement with the target, and saves in a draft step.

Agreement (`--report`, a `bench methods` sessions or prompts report whose `off` rows hold the target's greedy
outputs): one teacher-forced fp32 pass of the draft over each request's prompt and output; at every output position,
whether the draft's top token is the target's next one, with the whole head, and with the head cut to the first N
ids plus the special tokens, with and without the ids of the context so far (prompt and output up to there).

Timing (`--timing`): one draft step (one token after `--context` tokens) of the quantized draft with the whole head
against the same draft with its head cut to N, two models in one process, alternated every repeat so that the
machine's drift moves both alike: the median of the paired ratios. Both see the same context, whose ids past N the
cut head scores too.

    PYTHONPATH=.:proto python scripts/draft_vocab.py --report docs/bench/methods_sessions_avx2_int4_layers_fp16.json \
        --timing --json docs/bench/draft_vocab_avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
DRAFT = "qwen2.5-coder-0.5b-instruct"
KEEPS = (16384, 32768, 49152)


def agreement(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, contexts: Sequence[Sequence[int]],
              keep: int | None, always: Sequence[int], with_context: bool) -> float:
    """Share of positions where the argmax of hidden @ weight.T over the scored ids is the target's token.
    hidden [P, D], weight [V, D], targets [P]; keep None: every id scored."""
    logits = hidden.float() @ weight.float().T  # [P, V]
    if keep is not None:
        scored = torch.zeros(logits.shape, dtype=torch.bool)  # [P, V]
        scored[:, :keep] = True
        scored[:, list(always)] = True
        if with_context:
            for p, context in enumerate(contexts):
                scored[p, list(context)] = True
        logits = logits.masked_fill(~scored, float("-inf"))
    return (logits.argmax(-1) == targets).float().mean().item()


def teacher_forced(model: Any, requests: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """The draft's final hidden states at each output position (what its head reads), the target's next tokens,
    and the context each position has seen."""
    from specdec_core.kv_cache import KVCache

    captured: dict[str, torch.Tensor] = {}
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: captured.__setitem__("h", args[0]))
    attn = model.layers[0].self_attn
    hidden, targets, contexts = [], [], []
    try:
        for r in requests:
            ids = r.prompt + r.output[:-1]
            L = len(ids)
            cache = KVCache(model.args.num_layers, 1, attn.num_kv_heads, L, model.args.head_dim, torch.float32)
            with torch.inference_mode():
                model(torch.tensor([ids]), torch.arange(L).view(1, -1), cache, torch.tensor([0]), L, (0, 0),
                      torch.arange(len(r.prompt), L).view(1, -1))
            hidden.append(captured["h"][0])
            targets += r.output[1:]
            contexts += [r.prompt + r.output[: i + 1] for i in range(len(r.output) - 1)]
    finally:
        hook.remove()
    return torch.cat(hidden), torch.tensor(targets), contexts


def agreements(report_path: Path, draft: str, keeps: Sequence[int], group: str | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "scripts"))
    import tree_verify_gain as replayed
    from specdec_core.build import special_ids
    from specdec_core.models.loader import load_model, load_tokenizer

    report = json.loads(report_path.read_text())
    tokenizer = load_tokenizer(replayed.TARGET).tokenizer
    build = replayed.sessions_requests if report.get("workload") == "sessions" else replayed.prompts_requests
    requests = [r for r in build(report, tokenizer) if group is None or r.group == group]
    loaded = load_model(draft, dtype="float32")
    model = loaded.model.eval()
    hidden, targets, contexts = teacher_forced(model, requests)
    weight, always = model.lm_head.weight.detach(), sorted(special_ids(loaded))
    rows: dict[str, Any] = {"whole head": agreement(hidden, weight, targets, contexts, None, always, False)}
    for keep in keeps:
        rows[f"{keep} + context"] = agreement(hidden, weight, targets, contexts, keep, always, True)
        rows[f"{keep} alone"] = agreement(hidden, weight, targets, contexts, keep, always, False)
    return {"report": str(report_path), "group": group, "positions": len(targets),
            "target_tokens_past": {str(k): (targets >= k).float().mean().item() for k in keeps}, "agreement": rows}


def timing(draft: str, quantization: str, keep: int, context: int, repeats: int, threads: int) -> dict[str, Any]:
    from specdec_core.build import prepare_model
    from specdec_core.models.vocab_head import context_ids
    from specdec_core.runner import ModelRunner, RunnerConfig

    torch.set_num_threads(threads)
    models = {"whole": prepare_model(draft, quantization=quantization).model.eval(),
              "cut": prepare_model(draft, quantization=quantization, vocabulary=keep).model.eval()}
    V = models["whole"].vocab_size
    ids = torch.randint(10, V, (context + repeats,), generator=torch.Generator().manual_seed(0)).tolist()
    extra = context_ids([ids[:context]], models["cut"].lm_head.keep, V)
    runs = {}
    for name, model in models.items():
        runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=context + 8))
        slot = runner.allocate()
        runner.extend([slot], [ids[: context - 1]])
        runs[name] = (runner, slot, extra if name == "cut" else None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(repeats):
        for name in (runs if rep % 2 else reversed(list(runs))):
            runner, slot, extra_vocab = runs[name]
            start = time.perf_counter()
            runner.extend([slot], [[ids[context - 1 + rep]]], extra_vocab=extra_vocab)
            times[name].append(time.perf_counter() - start)
            runner.truncate(slot, context - 1)
    ratios = [c / w for c, w in zip(times["cut"], times["whole"])]
    return {"draft": draft, "quantization": quantization, "keep": keep, "context": context, "repeats": repeats,
            "threads": threads, "context_ids_scored": int(extra.numel()),
            "whole_ms": 1000 * statistics.median(times["whole"]), "cut_ms": 1000 * statistics.median(times["cut"]),
            "paired_ratio": statistics.median(ratios)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--report", type=Path, help="a bench methods report: the draft's agreement with its off rows")
    p.add_argument("--group", default="turns_2_plus", help="the report's group to measure ('' for all)")
    p.add_argument("--keeps", default=",".join(map(str, KEEPS)), help="the N to measure agreement at")
    p.add_argument("--timing", action="store_true", help="also time a draft step, whole head against cut")
    p.add_argument("--keep", type=int, default=32768, help="the N timed")
    p.add_argument("--quantization", default="int4", choices=["none", "int8", "int4"])
    p.add_argument("--context", type=int, default=700)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    if args.report is None and not args.timing:
        p.error("nothing to measure: give --report, --timing or both")
    out: dict[str, Any] = {}
    if args.report is not None:
        keeps = [int(k) for k in args.keeps.split(",")]
        out["agreement"] = agreements(args.report, args.draft, keeps, args.group or None)
        print(json.dumps(out["agreement"]["agreement"], indent=1))
    if args.timing:
        out["timing"] = timing(args.draft, args.quantization, args.keep, args.context, args.repeats, args.threads)
        print(json.dumps(out["timing"], indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
