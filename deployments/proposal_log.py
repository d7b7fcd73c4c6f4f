"""The proposal log: one JSON line per round of sampled requests, tying each proposal to what the target kept.

It is the data for distilling a better draft and for watching acceptance drift. Opt-in (`proposal_log` in the
config), sampled per request, and written off the round's path: the engine thread only puts a record on a
queue; a `logging.handlers.QueueListener` thread writes it to rotating files. No prompt text is ever written;
token ids of the proposals only (and, opted in, of the context before each round).

Record: {"ts": unix seconds, "request_id", "round": index, "position": output tokens before the round, "k",
"proposed": [token ids], "accepted": count, "bonus": bool, "method": the drafting method that proposed them
(draft_model, suffix, ngram: under hybrid drafting it changes from round to round), "target": model, "draft": the
served draft (model or method), "draft_variant": the request's variant where the server A/B-tests drafts}, and with
`include_probs` also "q": [the draft's probability of each proposed token] and "p": [the target's], rounded to 6
significant digits. Both are taken under the request's processed distribution (temperature, top-k, top-p; q as the
draft sampled it, its support cut included); greedy requests report the plain softmax (temperature 1); an n-gram
draft's q is 1. Only sampled requests ask the workers for them (`start` says whether to). With
`include_context_tokens` N > 0 also "context": the last N token ids committed before the round (the prompt's, then
the output's), what `specdec distill --proposal-log` needs to teach the draft where it was rejected. Token ids are
the text: such a log holds windows of prompts and outputs, which is why it is off unless asked for.

`specdec proposals stats FILE...` (specdec_tools.proposals) summarises acceptance by draft position and the
mismatch rate over time, and, when records carry q and p, their means over accepted and rejected proposals.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdec_core.outputs import RequestOutput


@dataclass
class _Sampled:
    """A sampled request's share of the log: its id, rounds logged, and (opted in) its last committed tokens."""

    request_id: str
    rounds: int = 0
    context: deque = field(default_factory=lambda: deque(maxlen=0))
    draft_variant: str | None = None  # where the server A/B-tests drafts


class ProposalLog:
    def __init__(
        self,
        directory: str | Path,
        sample_rate: float,
        target: str,
        draft: str,
        max_bytes: int = 64 * 1024 * 1024,
        backup_count: int = 5,
        include_probs: bool = False,
        include_context_tokens: int = 0,
    ) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.sample_rate = sample_rate
        self.include_probs = include_probs
        self.include_context_tokens = include_context_tokens
        self._models = {"target": target, "draft": draft}
        handler = logging.handlers.RotatingFileHandler(
            path / "proposals.jsonl", maxBytes=max_bytes, backupCount=backup_count, encoding="utf-8"
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._listener = logging.handlers.QueueListener(self._queue, handler)
        self._listener.start()
        self._closed = False
        self._logger = logging.Logger(f"specdec.proposals.{id(self)}")  # not in the logging tree: no propagation
        self._logger.addHandler(logging.handlers.QueueHandler(self._queue))
        self._sampled: dict[str, _Sampled] = {}  # session -> its state
        # `observe` runs on the engine thread, `start` and `discard` on the router's event loop: a request discarded
        # while its round is observed must stay discarded.
        self._lock = threading.Lock()

    def set_draft(self, draft: str) -> None:
        """Name `draft` in the records written from now on (a hot swap of the draft model)."""
        self._models = {**self._models, "draft": draft}  # one assignment: a record has the old pair or the new

    def start(
        self, seq_id: str, request_id: str, prompt_ids: Sequence[int] = (), draft_variant: str | None = None
    ) -> bool:
        """Sample a new request. True when its rounds must carry probabilities (sampled, and include_probs). The
        caller must `discard` it when it ends, however it ends. `prompt_ids`: the start of its context (only its
        last include_context_tokens are kept, and only then). `draft_variant`: the draft variant it drafts with,
        recorded where given."""
        if random.random() >= self.sample_rate:
            return False
        n = self.include_context_tokens
        with self._lock:
            self._sampled[seq_id] = _Sampled(
                request_id, context=deque(prompt_ids[-n:] if n else (), maxlen=n), draft_variant=draft_variant
            )
        return self.include_probs

    def discard(self, seq_id: str) -> None:
        """The request has ended (finished, refused, past its deadline, cancelled): forget it. Idempotent."""
        with self._lock:
            self._sampled.pop(seq_id, None)

    @property
    def num_pending(self) -> int:
        """Sampled requests not yet ended."""
        return len(self._sampled)

    def observe(self, seq_id: str, output: RequestOutput) -> None:
        """Called on the engine thread for each output: queue a record for a sampled request's round."""
        info = output.round
        logged = info is not None and info.k > 0
        with self._lock:
            entry = self._sampled.get(seq_id)
            if entry is None:
                return
            index, context = entry.rounds, list(entry.context) if logged and self.include_context_tokens else None
            entry.context.extend(output.new_token_ids)  # a deque of maxlen N: it keeps the last N
            if output.finished:
                del self._sampled[seq_id]
            elif logged:
                entry.rounds += 1
        if logged:
            record = {
                "ts": round(time.time(), 3),
                "request_id": entry.request_id,
                "round": index,
                "position": output.num_output_tokens - len(output.new_token_ids),
                "k": info.k,
                "proposed": list(info.proposed_token_ids),
                "accepted": info.num_accepted,
                "bonus": info.bonus,
                "method": info.method,
                **self._models,
                **({} if entry.draft_variant is None else {"draft_variant": entry.draft_variant}),
                **_probs("q", info.draft_probs),
                **_probs("p", info.target_probs),
                **({} if context is None else {"context": context}),
            }
            self._logger.info(json.dumps(record, separators=(",", ":")))

    def close(self) -> None:
        """Write what is queued and stop. Idempotent (a router closes its log when closed, and when collected)."""
        if not self._closed:
            self._closed = True
            self._listener.stop()


def _probs(key: str, values: tuple[float, ...] | None) -> dict[str, list[float]]:
    return {} if values is None else {key: [float(f"{v:.6g}") for v in values]}
