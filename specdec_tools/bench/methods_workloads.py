"""The two workloads of `specdec bench methods` (`methods_run.py`), and the one way a request is run and timed.

- prompts: every prompt once per method, the order of the methods rotated from prompt to prompt so that drift in
  the machine's speed falls on all alike. A method's requests share one `cache_salt`, so a method with a
  cross-request structure (suffix's global trie) learns across prompts as a server would.
- sessions: every session once per method (the order rotated from session to session), its turns one after the
  other, each the chat-template encoding of the system prompt, the earlier user turns and the answers this method
  gave, then the new turn. One `cache_salt` per method and session; prefix caching on in every engine, as the
  service has it. Turn 1 and turns >= 2 are reported apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from specdec_core.chat import ChatMessage, encode_chat
from specdec_core.config import SamplingParams
from specdec_core.engine import SpecEngine
from specdec_core.errors import InvalidArgument
from specdec_core.request import Request
from specdec_tools.bench.methods_report import ALL, LATER_TURNS, NO_DRAFT, TURN_1, MethodRounds, Record, RequestRun
from specdec_tools.requests import Session

# -- one request ---------------------------------------------------------------------------------------------------


def run_request(
    engine: SpecEngine, request_id: str, prompt: list[int], params: SamplingParams, k: int | str, salt: str
) -> RequestRun:
    """Generate one request alone on `engine`, timed from adding it to its last token."""
    tokens: list[int] = []
    text: list[str] = []
    by_method: dict[str, MethodRounds] = {}
    outcomes: list[tuple[int, int, bool, bool]] = []
    first = last = None
    start = time.perf_counter()
    engine.add_request(Request(request_id, tuple(prompt), params, num_speculative_tokens=k, cache_salt=salt))
    while engine.has_work:
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"request {request_id} failed: {out.error}") from out.error
            tokens += out.new_token_ids
            text.append(out.new_text)
            if (info := out.round) is not None:
                name = info.method or NO_DRAFT
                by_method[name] = by_method.get(name, MethodRounds()) + MethodRounds(
                    1, len(out.new_token_ids), len(info.proposed_token_ids), info.num_accepted, info.seconds
                )
                outcomes.append((len(info.proposed_token_ids), info.num_accepted, info.predrafted, info.branched))
            if first is None:
                first = time.perf_counter()
            last = out
    end = time.perf_counter()
    return RequestRun(
        tuple(tokens),
        "".join(text),
        last.num_prompt_tokens,
        last.num_cached_tokens,
        end - start,
        end - (first or end),
        last.stats.rounds,
        last.stats.proposed,
        last.stats.accepted,
        by_method,
        tuple(outcomes),
    )


@dataclass(frozen=True)
class Runner:
    """What every request of the run shares: the engines (by method), k, the sampling settings and the progress."""

    engines: dict[str, SpecEngine]
    k: int | str
    temperature: float
    seed: int  # request i of the run is sampled with seed + i, by every method
    max_new_tokens: int
    progress: Callable[[], None]

    def params(self, index: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed + index, max_tokens=self.max_new_tokens)

    def run(self, method: str, request_id: str, prompt: list[int], index: int, salt: str) -> RequestRun:
        run = run_request(self.engines[method], f"{method}-{request_id}", prompt, self.params(index), self.k, salt)
        self.progress()
        return run


def rotated(methods: Sequence[str], i: int) -> list[str]:
    """The methods starting from the i-th: each takes every position in turn."""
    i %= len(methods)
    return [*methods[i:], *methods[:i]]


# -- the workloads -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptsWorkload:
    path: Path
    prompts: tuple[tuple[int, ...], ...]  # token ids
    name: ClassVar[str] = "prompts"
    groups: ClassVar[tuple[str, ...]] = (ALL,)
    prefix_caching: ClassVar[bool] = False  # every prompt computed whole, as `bench offline` does

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def warm_up_prompt(self) -> list[int]:
        return list(self.prompts[0])

    def needs(self, max_new_tokens: int) -> dict[str, int]:
        """The tokens each prompt takes, output included."""
        return {f"prompt-{i}": len(p) + max_new_tokens for i, p in enumerate(self.prompts)}

    def run(self, runner: Runner, methods: Sequence[str]) -> list[Record]:
        records = []
        for i, prompt in enumerate(self.prompts):
            for method in rotated(methods, i):
                run = runner.run(method, f"prompt-{i}", list(prompt), i, f"methods-{method}")
                records.append(Record(method, f"prompt-{i}", 1, ALL, run))
        return records

    def describe(self) -> dict[str, Any]:
        return {"workload": self.name, "workload_file": str(self.path), "num_prompts": len(self.prompts)}


@dataclass(frozen=True)
class SessionsWorkload:
    path: Path
    sessions: tuple[Session, ...]
    tokenizer: Any
    name: ClassVar[str] = "sessions"
    groups: ClassVar[tuple[str, ...]] = (TURN_1, LATER_TURNS)
    prefix_caching: ClassVar[bool] = True  # turn n reads turn n - 1 from the cache, as the service does

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def warm_up_prompt(self) -> list[int]:
        first = self.sessions[0]
        return encode_chat(self.tokenizer, [ChatMessage("system", first.system), ChatMessage("user", first.turns[0])])

    def needs(self, max_new_tokens: int) -> dict[str, int]:
        """About the most tokens each session's last turn takes, its output included: every turn with an empty
        answer, plus a full answer per turn (an answer re-encoded from its text may take a token more or less)."""
        return {s.id: self.skeleton_tokens(s) + len(s.turns) * max_new_tokens for s in self.sessions}

    def skeleton_tokens(self, session: Session) -> int:
        messages = [ChatMessage("system", session.system)]
        for text in session.turns:
            messages += [ChatMessage("user", text), ChatMessage("assistant", "")]
        return len(encode_chat(self.tokenizer, messages[:-1]))  # the last turn's prompt, its answer yet to come

    def run(self, runner: Runner, methods: Sequence[str]) -> list[Record]:
        records, first_index = [], 0
        for number, session in enumerate(self.sessions):
            for method in rotated(methods, number):
                records += self.replay(runner, method, session, first_index)
            first_index += len(session.turns)
        return records

    def replay(self, runner: Runner, method: str, session: Session, first_index: int) -> list[Record]:
        """One session by one method: each turn after the conversation so far, with this method's answers."""
        history = [ChatMessage("system", session.system)]
        records = []
        for turn, text in enumerate(session.turns, start=1):
            history.append(ChatMessage("user", text))
            prompt = encode_chat(self.tokenizer, history)
            run = runner.run(
                method, f"{session.id}-{turn}", prompt, first_index + turn - 1, f"methods-{method}-session-{session.id}"
            )
            history.append(ChatMessage("assistant", run.text))
            records.append(Record(method, session.id, turn, TURN_1 if turn == 1 else LATER_TURNS, run))
        return records

    def describe(self) -> dict[str, Any]:
        return {
            "workload": self.name,
            "workload_file": str(self.path),
            "num_sessions": len(self.sessions),
            "num_turns": self.num_requests,
        }


Workload = PromptsWorkload | SessionsWorkload


def check_fits(workload: Workload, limit: int, max_new_tokens: int) -> None:
    """Refuse, before any work, a prompt or session that would not fit: else it fails minutes into the run."""
    for name, need in workload.needs(max_new_tokens).items():
        if need > limit:
            raise InvalidArgument(
                "--max-seq-len",
                f"{name} needs up to {need} tokens with {max_new_tokens} new "
                f"tokens a request; the engines hold {limit} (--max-seq-len, at "
                "most the model's positions)",
            )
