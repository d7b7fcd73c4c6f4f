"""A speculative round at batch 1 through the engine, and a plain step, split into the forwards' time and the rest:
the host's overhead per round (drafting's bookkeeping, rejection, committing, launching), which a GPU does not hide.

The forwards are not timed inside the round, where synchronising after each would add to what is measured: the
runners note each forward's bucket (`LoggingRunner`), and the round's forwards are priced at the costs measured for
those buckets on their own (`costs.py`). Host overhead = the round's wall time less its forwards' prices, a median
over the rounds. A round with a forward no bucket took (eager: the prefill, a draft's first read) has no price and
is left out, counted.

The models have random weights and no tokenizer: the engine gets one that decodes every id to no text, so
detokenizing is left out of the host's share.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec_core.config import SamplingParams
from specdec_core.cuda_graphs import Bucket, bucket_for
from specdec_core.engine import SpecEngine
from specdec_core.models.transformer import Transformer
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_tools.bench.gpu.device import sync
from specdec_tools.bench.gpu.engines import K, engine_over

WARM_UP_STEPS = 4  # engine steps left untimed: the prefill, the draft's start, the first rounds


@dataclass(frozen=True)
class Forward:
    """One forward a runner was asked for: its role ("target" or "draft"), rows, new tokens per row, and the bucket
    it ran through (None: eagerly)."""

    role: str
    batch: int
    width: int
    bucket: Bucket | None


class LoggingRunner(ModelRunner):
    """A `ModelRunner` that notes every forward it runs (`Forward`) in `log`, a list its caller may share between
    runners and clear. Mutates `log`."""

    def __init__(self, model: Transformer, config: RunnerConfig, role: str, log: list[Forward]) -> None:
        super().__init__(model, config)
        self.role, self.log = role, log

    def extend(
        self,
        slots: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        all_logits: bool = False,
        extra_vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        before = self.graph_counters().replays
        logits = super().extend(slots, token_lists, all_logits, extra_vocab)
        self._note(len(slots), max(len(t) for t in token_lists), before)
        return logits

    def extend_next(
        self, slots: Sequence[int], tokens: torch.Tensor, extra_vocab: torch.Tensor | None = None
    ) -> torch.Tensor:
        before = self.graph_counters().replays
        logits = super().extend_next(slots, tokens, extra_vocab)
        self._note(len(slots), 1, before)
        return logits

    def _note(self, batch: int, width: int, replays_before: int) -> None:
        bucketed = self.graphs is not None and self.graph_counters().replays > replays_before
        bucket = bucket_for(batch, width, self.graphs.config) if bucketed and self.graphs else None
        self.log.append(Forward(self.role, batch, width, bucket))


@dataclass(frozen=True)
class Timed:
    """One engine step that ran a round (or a plain step) at batch 1: its wall time, its forwards' prices per role,
    the tokens it committed."""

    ms: float
    forward_ms: dict[str, float]
    tokens: int

    @property
    def host_ms(self) -> float:
        return self.ms - sum(self.forward_ms.values())


@dataclass(frozen=True)
class Window:
    """The rounds timed in one request's run, each priced in full, and the steps left out (no round in them, or a
    forward without a price: no bucket took it). Figures are medians over the rounds."""

    rounds: tuple[Timed, ...]
    skipped: int

    def _median(self, values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    @property
    def round_ms(self) -> float:
        return self._median([r.ms for r in self.rounds])

    @property
    def forwards_per_round_ms(self) -> float:
        return self._median([sum(r.forward_ms.values()) for r in self.rounds])

    @property
    def host_per_round_ms(self) -> float:
        """The median of each round's wall time less its forwards' prices."""
        return self._median([r.host_ms for r in self.rounds])

    def role_ms(self, role: str) -> float:
        return self._median([r.forward_ms.get(role, 0.0) for r in self.rounds])

    @property
    def tokens_per_round(self) -> float:
        return sum(r.tokens for r in self.rounds) / max(1, len(self.rounds))

    def json(self) -> dict[str, float | int]:
        return {
            "rounds_timed": len(self.rounds),
            "steps_skipped": self.skipped,
            "tokens_per_round": self.tokens_per_round,
            "round_ms": self.round_ms,
            "forwards_per_round_ms": self.forwards_per_round_ms,
            "draft_forwards_per_round_ms": self.role_ms("draft"),
            "target_forwards_per_round_ms": self.role_ms("target"),
            "host_per_round_ms": self.host_per_round_ms,
        }


class NoText:
    """The tokenizer of a model that has none: every id decodes to no text (stopping needs no text here)."""

    eos_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def timed_window(
    engine: SpecEngine,
    request: Request,
    log: list[Forward],
    price: Callable[[Forward], float | None],
    device: torch.device,
) -> Window:
    """Run `request` alone to its end; after `WARM_UP_STEPS` steps, time each step (synchronised before and after:
    a round ends reading its outcome on the host anyway) and price the forwards the runners noted in it."""
    engine.add_request(request)
    for _ in range(WARM_UP_STEPS):
        engine.step()
    rounds, skipped = [], 0
    while engine.has_work:
        log.clear()
        sync(device)
        t0 = time.perf_counter()
        outputs = engine.step()
        sync(device)
        ms = 1000 * (time.perf_counter() - t0)
        prices = [(f.role, price(f)) for f in log]
        if not any(out.round is not None for out in outputs) or any(p is None for _, p in prices):
            skipped += 1
            continue
        forward_ms = {role: sum(p for r, p in prices if r == role and p is not None) for role in ("draft", "target")}
        rounds.append(Timed(ms, forward_ms, sum(len(out.new_token_ids) for out in outputs)))
    return Window(tuple(rounds), skipped)


def round_windows(
    target: LoggingRunner,
    draft: LoggingRunner,
    prompt: list[int],
    new_tokens: int,
    price: Callable[[Forward], float | None],
    device: torch.device,
) -> dict[str, Window]:
    """At batch 1 through the engine, over runners already made (and, on CUDA, captured): speculative rounds
    drafting K tokens with the draft model, then plain decoding, each timed as a window. The runners share a log."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    spec = engine_over(target, draft, "draft_model", NoText(), frozenset())
    plain = engine_over(target, None, "none", NoText(), frozenset())
    return {
        "speculative": timed_window(spec, Request("spec", tuple(prompt), params, K), target.log, price, device),
        "plain": timed_window(plain, Request("plain", tuple(prompt), params, 0), target.log, price, device),
    }
