"""The training loop: AdamW with clipping, a warmup-then-cosine learning rate, resumable from its checkpoint.

Everything a step depends on is a function of the step index or saved in the checkpoint: the batch order (epochs
of a permutation seeded by `seed` and the epoch, so the data cursor is the step itself), the learning rate, the
trainable weights, AdamW's moments and torch's RNG state. A run cut short and run again from its last checkpoint
therefore ends with exactly the weights of an uninterrupted run (on the same machine and thread count).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdec_core.distill.data import Example, readable
from specdec_core.distill.forward import logits_at
from specdec_core.distill.loss import topk_kl
from specdec_core.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 8  # sequences per step
    learning_rate: float = 1e-3  # peak, after warmup
    min_learning_rate_ratio: float = 0.1  # the cosine ends at this fraction of the peak
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    checkpoint_every: int = 25  # steps; the last step is always checkpointed
    seed: int = 0


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of batch `step`: position step * batch_size onwards in a stream of epochs, each a fresh
    permutation seeded by (seed, epoch)."""
    out = []
    for j in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(j, num_examples)
        order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(order[i]))
    return out


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup to the peak, then a cosine down to min_learning_rate_ratio of it at the last step."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - config.warmup_steps) / span)))
    low = config.min_learning_rate_ratio
    return config.learning_rate * (low + (1 - low) * cosine)


def batch_loss(module: nn.Module, batch: Sequence[Example], draft_rows: int, shared_vocab: int) -> torch.Tensor:
    """The weighted KL over every taught position of `batch`. The draft reads ids below `draft_rows` (its
    embedding) and proposes among the `shared_vocab` ids both models have, as `DraftModelDrafter` does."""
    rows = [readable(e.token_ids, draft_rows) for e in batch]
    logits = logits_at(module, rows, [e.positions for e in batch])[:, :shared_vocab]  # [N, V shared]
    device = logits.device
    top_ids, top_logprobs, weights = (
        torch.cat([getattr(e, name) for e in batch]).to(device) for name in ("top_ids", "top_logprobs", "weights")
    )
    return topk_kl(logits, top_ids, top_logprobs, weights)


@dataclass(frozen=True)
class TrainResult:
    losses: tuple[float, ...]  # per step run in this call (a resumed run: from the checkpoint's step on)
    resumed_from: int  # the step the run started at (0: from scratch)


def train(
    module: nn.Module,
    examples: Sequence[Example],
    config: TrainConfig,
    *,
    draft_rows: int,
    shared_vocab: int,
    checkpoint: Path | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Train `module`'s trainable parameters (mutated in place) on `examples` for `config.steps` steps. With
    `checkpoint`, continue from it when it exists, and write it every `checkpoint_every` steps and at the end;
    a checkpoint of another run (other config, data or parameters) is refused. `on_step(step, loss)` after each."""
    if not examples:
        raise InvalidArgument("examples", "nothing to train on")
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=config.learning_rate, weight_decay=config.weight_decay)
    fingerprint = _fingerprint(config, examples, params)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        start = _restore(checkpoint, fingerprint, params, optimizer)
        log.info("resuming from %s at step %d of %d", checkpoint, start, config.steps)
    losses = []
    module.train()
    for step in range(start, config.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        batch = [examples[i] for i in batch_indices(len(examples), config.batch_size, step, config.seed)]
        loss = batch_loss(module, batch, draft_rows, shared_vocab)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), config.max_grad_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if checkpoint is not None and (done % config.checkpoint_every == 0 or done == config.steps):
            _save(checkpoint, fingerprint, done, params, optimizer)
        if on_step is not None:
            on_step(done, losses[-1])
    module.eval()
    return TrainResult(tuple(losses), start)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint at `path` resumes from (0 if there is none); maps the file rather than reading it."""
    return int(torch.load(path, weights_only=True, mmap=True)["step"]) if path.exists() else 0


def _fingerprint(config: TrainConfig, examples: Sequence[Example], params: Mapping[str, torch.Tensor]) -> str:
    """What a checkpoint must have been trained on to be resumed: the config, the data and the trainable
    parameters' names and shapes. Not the step count: a rerun with more steps goes on from the checkpoint (on
    the new schedule, so not bit for bit what a run begun with that count would give)."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.token_ids, e.positions]).encode())
        digest.update(e.top_ids.numpy().tobytes())
    described = {
        **asdict(config),
        "steps": None,
        "examples": len(examples),
        "data": digest.hexdigest(),
        "params": [[n, list(p.shape)] for n, p in params.items()],
    }
    return json.dumps(described, sort_keys=True)


def _save(
    path: Path, fingerprint: str, step: int, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Written whole or not at all (a temporary file renamed): an interruption mid-write leaves the last one."""
    state = {
        "fingerprint": fingerprint,
        "step": step,
        "params": {n: p.detach().clone() for n, p in params.items()},
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _restore(path: Path, fingerprint: str, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    state = torch.load(path, weights_only=True)
    if state["fingerprint"] != fingerprint:
        raise InvalidArgument(
            "checkpoint",
            f"{path} is a checkpoint of another run (settings, data or model "
            "differ): remove it, or write to another directory",
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])
