"""`specdec distill`: fine-tune a draft towards its target, and measure acceptance before and after.

    specdec distill --target T --draft D --prompts FILE.jsonl --out DIR [--proposal-log FILE...] [--steps N]
                    [--max-new-tokens N] [--lora-rank R]

The prompts are split (seeded) into a training set and held-out prompts never trained on. The target's greedy
completions of the training prompts, and the rounds of proposal logs where the target rejected a proposal (records
with a context), are scored by the target (its top-k next-token distribution at each position), and the draft is
trained towards them (`specdec_core.distill`). DIR becomes a draft directory that `specdec serve` and `specdec bench
offline --draft DIR` load as they are; DIR/report.json holds acceptance on the held-out prompts before and after,
measured by `bench offline`'s own code (greedy, fixed k). Work files live in DIR/work: run the same command again
after an interruption and it goes on from the last checkpoint, regenerating nothing it has.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec_core.distill.data import Example, TrainingSequence, completion_sequence, rejection_sequences
from specdec_core.distill.forward import use_causal_attention
from specdec_core.distill.lora import merged, trainable
from specdec_core.distill.save import write_draft
from specdec_core.distill.train import TrainConfig, TrainResult, checkpoint_step, train
from specdec_core.errors import InvalidArgument
from specdec_core.models.loader import LoadedModel, load_model, resolve_source
from specdec_tools import distill_stages as stages
from specdec_tools.bench.options import add_draft_quantization
from specdec_tools.proposals import read_records
from specdec_tools.reports import write_report
from specdec_tools.requests import read_prompt_texts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    target: str
    draft: str
    prompts: Path
    out: Path
    proposal_logs: tuple[Path, ...] = ()
    steps: int = 200
    max_new_tokens: int = 64
    lora_rank: int = 16  # 0: full fine-tuning (tiny drafts)
    top_k: int = 32  # target ids kept per position
    rejection_weight: float = 4.0  # of a proposal-log position against a completion position's 1
    holdout_fraction: float = 0.2
    batch_size: int = 8
    learning_rate: float = 1e-3
    checkpoint_every: int = 25
    seed: int = 0
    train_dtype: str = "float32"  # training and the target's scores
    dtype: str = "bfloat16"  # generation and the acceptance measurements, as `bench offline --dtype`
    device: str = "cpu"
    eval_k: int = 4  # speculative tokens per round when measuring acceptance
    draft_quantization: str = "auto"  # of the measured drafts, as `bench offline --draft-quantization`

    @property
    def work(self) -> Path:
        return self.out / "work"


def register(sub: Any) -> None:
    p = sub.add_parser("distill", help="fine-tune a draft towards its target; acceptance before and after")
    p.add_argument("--target", required=True, help="target model: path, .gguf file or `specdec models` name")
    p.add_argument("--draft", required=True, help="the draft to start from: path, .gguf file or name")
    p.add_argument("--prompts", required=True, type=Path, help='JSONL, one {"prompt": "..."} per line')
    p.add_argument("--out", required=True, type=Path, help="the draft directory to write (work files in DIR/work)")
    p.add_argument(
        "--proposal-log",
        nargs="+",
        action="extend",
        default=[],
        type=Path,
        metavar="FILE",
        help="proposal logs whose records carry a context (proposal_log.include_context_tokens): the "
        "positions where the draft was rejected are trained on, weighted up",
    )
    p.add_argument("--steps", type=int, default=DistillConfig.steps, help="training steps")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DistillConfig.max_new_tokens,
        help="length of the target's completions, and of the held-out measurements",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=DistillConfig.lora_rank,
        help="LoRA rank (peft; merged into the weights on save); 0: full fine-tuning, for tiny drafts",
    )
    p.add_argument("--top-k", type=int, default=DistillConfig.top_k, help="target ids kept per position")
    p.add_argument(
        "--rejection-weight",
        type=float,
        default=DistillConfig.rejection_weight,
        help="weight of a proposal-log rejection position (a completion position weighs 1)",
    )
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=DistillConfig.holdout_fraction,
        help="prompts held out of training, to measure acceptance on",
    )
    p.add_argument("--batch-size", type=int, default=DistillConfig.batch_size, help="sequences per step")
    p.add_argument("--learning-rate", type=float, default=DistillConfig.learning_rate, help="peak, after warmup")
    p.add_argument("--checkpoint-every", type=int, default=DistillConfig.checkpoint_every, help="steps")
    p.add_argument("--seed", type=int, default=DistillConfig.seed, help="held-out split and batch order")
    p.add_argument("--train-dtype", default=DistillConfig.train_dtype, help="training and the target's scores")
    p.add_argument("--dtype", default=DistillConfig.dtype, help="generation and acceptance measurements")
    p.add_argument("--device", default=DistillConfig.device, help="cpu or cuda")
    p.add_argument(
        "--eval-k",
        type=int,
        default=DistillConfig.eval_k,
        help="speculative tokens per round when measuring acceptance",
    )
    add_draft_quantization(
        p, help="of the measured drafts, as in `bench offline`", default=DistillConfig.draft_quantization
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = DistillConfig(
        target=args.target,
        draft=args.draft,
        prompts=args.prompts,
        out=args.out,
        proposal_logs=tuple(args.proposal_log),
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        lora_rank=args.lora_rank,
        top_k=args.top_k,
        rejection_weight=args.rejection_weight,
        holdout_fraction=args.holdout_fraction,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        train_dtype=args.train_dtype,
        dtype=args.dtype,
        device=args.device,
        eval_k=args.eval_k,
        draft_quantization=args.draft_quantization,
    )
    report = run_distill(config)
    print(format_report(report))
    return 0


def run_distill(config: DistillConfig) -> dict[str, Any]:
    """The whole run; returns the report it writes to DIR/report.json."""
    _check(config)
    train_texts, held_texts = _claim_work_dir(config)
    sequences = _sequences(config, train_texts)
    held_out = config.work / "heldout.jsonl"
    measure = dict(
        max_new_tokens=config.max_new_tokens,
        k=config.eval_k,
        dtype=config.dtype,
        device=config.device,
        draft_quantization=config.draft_quantization,
    )
    before = stages.acceptance(config.target, config.draft, held_out, cache=config.work / "before.json", **measure)
    draft = load_model(config.draft, dtype=config.train_dtype, device=config.device)
    examples, shared_vocab = stages.scored(
        config.target,
        sequences,
        top_k=config.top_k,
        draft_rows=draft.model.vocab_size,
        dtype=config.train_dtype,
        device=config.device,
        cache=config.work / "scores.pt",
    )
    result = _train_and_write(config, draft, examples, shared_vocab)
    after_cache = config.work / "after.json"
    after_cache.unlink(missing_ok=True)  # the draft was (re)written just now: measure it again
    after = stages.acceptance(config.target, str(config.out), held_out, cache=after_cache, **measure)
    report = {
        "target": config.target,
        "draft": config.draft,
        "out": str(config.out),
        "train_prompts": len(train_texts),
        "held_out_prompts": len(held_texts),
        "training_sequences": len(examples),
        "training_positions": sum(len(e.positions) for e in examples),
        "resumed_from_step": result.resumed_from,
        "loss_first": result.losses[0] if result.losses else None,
        "loss_last": result.losses[-1] if result.losses else None,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(config).items()
            if k not in ("target", "draft", "out", "proposal_logs")
        },
        "before": before,
        "after": after,
        "acceptance_ratio": after["acceptance_rate"] / before["acceptance_rate"] if before["acceptance_rate"] else None,
    }
    write_report(report, config.out / "report.json")
    return report


def _train_and_write(
    config: DistillConfig, draft: LoadedModel, examples: list[Example], shared_vocab: int
) -> TrainResult:
    """Train the draft (resuming from DIR/work/checkpoint.pt if there) and write it, merged, to DIR."""
    module = trainable(use_causal_attention(draft.model), config.lora_rank, seed=config.seed)
    train_config = TrainConfig(
        steps=config.steps,
        batch_size=config.batch_size,
        learning_rate=config.learning_rate,
        checkpoint_every=config.checkpoint_every,
        seed=config.seed,
    )
    checkpoint = config.work / "checkpoint.pt"
    # The bar starts where the checkpoint does, so its rate and ETA count only the steps this run makes.
    with tqdm(
        total=config.steps, initial=min(checkpoint_step(checkpoint), config.steps), desc="training", unit="step"
    ) as bar:

        def on_step(step: int, loss: float) -> None:
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.4f}")

        result = train(
            module,
            examples,
            train_config,
            draft_rows=draft.model.vocab_size,
            shared_vocab=shared_vocab,
            checkpoint=checkpoint,
            on_step=on_step,
        )
    write_draft(merged(module), draft, config.out)
    return result


def format_report(report: dict[str, Any]) -> str:
    before, after = report["before"], report["after"]
    ratio = report["acceptance_ratio"]
    return "\n".join(
        [
            f"draft written to {report['out']} (report: {report['out']}/report.json)",
            f"held-out prompts: {report['held_out_prompts']}, k = {report['settings']['eval_k']}, greedy",
            f"acceptance:  before {before['acceptance_rate']:.3f}  after {after['acceptance_rate']:.3f}"
            + (f"  ({ratio:.2f}x)" if ratio is not None else ""),
            f"tokens per round:  before {before['mean_tokens_per_round']:.2f}"
            f"  after {after['mean_tokens_per_round']:.2f}",
            f"speedup over target-only:  before {before['speedup']:.2f}x  after {after['speedup']:.2f}x",
        ]
    )


def _check(config: DistillConfig) -> None:
    if config.steps <= 0:
        raise InvalidArgument("--steps", f"must be > 0, got {config.steps}")
    if config.max_new_tokens <= 0:
        raise InvalidArgument("--max-new-tokens", f"must be > 0, got {config.max_new_tokens}")
    if config.lora_rank < 0:
        raise InvalidArgument("--lora-rank", f"must be >= 0 (0: full fine-tuning), got {config.lora_rank}")
    if not 0 < config.holdout_fraction < 1:
        raise InvalidArgument("--holdout-fraction", f"must be in (0, 1), got {config.holdout_fraction}")
    for flag, value in (
        ("--top-k", config.top_k),
        ("--batch-size", config.batch_size),
        ("--checkpoint-every", config.checkpoint_every),
        ("--eval-k", config.eval_k),
    ):
        if value <= 0:
            raise InvalidArgument(flag, f"must be > 0, got {value}")
    for path in config.proposal_logs:
        if not path.is_file():
            raise InvalidArgument("--proposal-log", f"{str(path)!r} is not a file")
    if config.out.exists() and not (config.out / "work" / "run.json").exists() and any(config.out.iterdir()):
        raise InvalidArgument("--out", f"{config.out} exists and holds no distillation run: choose a new directory")
    resolve_source(config.target), resolve_source(config.draft)  # both found before any work


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _claim_work_dir(config: DistillConfig) -> tuple[list[str], list[str]]:
    """Split the prompts and write the split to DIR/work, with the settings that decide the data; a DIR holding a
    run with other settings is refused (its caches would not match). Training settings are the checkpoint's
    business (`train`): they may change between runs only to add steps."""
    settings = {
        "target": config.target,
        "draft": config.draft,
        "prompts": _digest(config.prompts),
        "proposal_logs": [_digest(p) for p in config.proposal_logs],
        "holdout_fraction": config.holdout_fraction,
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "top_k": config.top_k,
        "rejection_weight": config.rejection_weight,
        "dtype": config.dtype,
        "train_dtype": config.train_dtype,
        "eval_k": config.eval_k,
        "draft_quantization": config.draft_quantization,
    }
    run_file = config.work / "run.json"
    if run_file.exists():
        held = json.loads(run_file.read_text())
        changed = sorted(k for k in settings if held.get(k) != settings[k])
        if changed:
            raise InvalidArgument(
                "--out",
                f"{config.out} holds a run with other settings ({', '.join(changed)}): "
                "rerun it as it was, or choose a new directory",
            )
    config.work.mkdir(parents=True, exist_ok=True)
    write_report(settings, run_file)
    train_texts, held_texts = stages.split_prompts(
        read_prompt_texts(config.prompts), config.holdout_fraction, config.seed
    )
    for name, texts in (("train.jsonl", train_texts), ("heldout.jsonl", held_texts)):
        (config.work / name).write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts), encoding="utf-8")
    return train_texts, held_texts


def _sequences(config: DistillConfig, train_texts: list[str]) -> list[TrainingSequence]:
    """The target's completions of the training prompts, then the proposal logs' rejections."""
    done = stages.completions(
        config.target,
        train_texts,
        max_new_tokens=config.max_new_tokens,
        dtype=config.dtype,
        device=config.device,
        cache=config.work / "completions.jsonl",
    )
    sequences = [completion_sequence(c.prompt_ids, c.completion_ids) for c in done]
    rejections = rejection_sequences(read_records(config.proposal_logs), config.rejection_weight)
    if config.proposal_logs:
        log.info("%d rejected positions from the proposal logs", len(rejections))
    return sequences + rejections
