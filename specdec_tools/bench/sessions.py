"""`specdec bench sessions --address HOST:PORT --sessions FILE.jsonl ...`: replay multi-turn conversations through
either public API with prefix caching on and off, in the same run, and report the time to first token, decode
speed and end-to-end time of the turns after each session's first (where the conversation so far is a prefix that
an earlier turn left in the cache).

The file holds one session a line: `{"system": "...", "turns": ["user turn 1", "user turn 2", ...]}`, optionally
with an `"id"`. Every session is replayed once in each mode; within a mode its turns go one after the other, each
streamed after the whole conversation so far: the system prompt, then user turns alternating with the answers the
model gave in this mode.

- cached: one `cache_salt` for every turn of the session in this mode, and for nothing else (not the other mode,
  not another session, not another run): turn n may read the prompt of turn n - 1, and its answer, from the cache.
- uncached: a fresh random `cache_salt` on every request: nothing can hit.

The mode that goes first alternates from session to session (cached first on the first), so that drift in the
machine's speed falls on both alike. Turn i of the run (over all sessions) is sampled with seed + i in both modes,
so at temperature 0, and with the same seed at any temperature, the two modes must give the same text turn by turn:
the report counts the turns where they did.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from specdec_core.errors import InvalidArgument
from specdec_tools.loadgen.client import Sampling
from specdec_tools.loadgen.command import (
    add_server_command,
    non_negative_float,
    non_negative_int,
    positive,
    run_to_report,
)
from specdec_tools.loadgen.metrics import RequestRecord, distribution_ms, errors_by_code
from specdec_tools.loadgen.transport import Send, connect
from specdec_tools.requests import Prompt, Session, Speculation, parse_speculation, read_sessions

SKIPPED = "EARLIER_TURN_FAILED"  # the error of a turn not sent: its history would lack an answer


@dataclass(frozen=True)
class Mode:
    name: str
    shares_cache: bool  # one salt for all the turns of a session; else a fresh one per request

    def salt(self, run_id: str, session: int) -> str:
        if self.shares_cache:
            return f"bench-{run_id}-{session}-{self.name}"
        return f"bench-{run_id}-{uuid.uuid4().hex}"


CACHED, UNCACHED = Mode("cached", shares_cache=True), Mode("uncached", shares_cache=False)
MODES = (CACHED, UNCACHED)


@dataclass(frozen=True)
class SessionsConfig:
    address: str
    sessions_path: Path
    sessions: tuple[Session, ...]
    max_new_tokens: int  # per turn
    sampling: Sampling
    speculation: Speculation  # None: the server's setting
    protocol: str = "grpc"
    timeout_s: float = 600.0
    auth_token: str | None = None
    progress: bool = True


@dataclass(frozen=True)
class Turn:
    """One user turn of one session, as both modes got it."""

    session: str
    number: int  # from 1
    first: str  # the mode that replayed the session first
    records: dict[str, RequestRecord]  # by mode name


# -- the run -------------------------------------------------------------------------------------------------------


async def replay(
    send: Send,
    config: SessionsConfig,
    session: Session,
    first_index: int,
    salt: Callable[[], str],
    on_done: Callable[[], None],
) -> list[RequestRecord]:
    """One session in one mode: each user turn after the system prompt and every earlier turn with the answer this
    mode got to it; request indices (seeds) from `first_index`. After a failed turn the rest are not sent."""
    history: list[tuple[str, str]] = [("system", session.system)]
    records: list[RequestRecord] = []
    for offset, text in enumerate(session.turns):
        if records and not records[-1].ok:
            record = RequestRecord(error=SKIPPED)
        else:
            record = await send(
                Prompt(text, config.max_new_tokens),
                first_index + offset,
                config.sampling,
                config.speculation,
                history=tuple(history),
                cache_salt=salt(),
            )
            history += [("user", text), ("assistant", record.text)]
        records.append(record)
        on_done()
    return records


async def run(config: SessionsConfig) -> dict[str, Any]:
    """Every session in both modes against the server at config.address; the report as a dict."""
    run_id = uuid.uuid4().hex[:12]  # no salt of this run can meet an entry an earlier run left in the cache
    turns: list[Turn] = []
    total = len(MODES) * sum(len(s.turns) for s in config.sessions)
    with tqdm(total=total, desc="turns", unit="turn", file=sys.stderr, disable=not config.progress) as bar:
        async with connect(config.protocol, config.address, config.auth_token, config.timeout_s) as (server, send):
            first_index = 0
            for number, session in enumerate(config.sessions):
                order = MODES if number % 2 == 0 else MODES[::-1]
                records = {}
                for mode in order:
                    salt = functools.partial(mode.salt, run_id, number)
                    records[mode.name] = await replay(send, config, session, first_index, salt, lambda: bar.update(1))
                turns += [
                    Turn(session.id, t + 1, order[0].name, {m.name: records[m.name][t] for m in MODES})
                    for t in range(len(session.turns))
                ]
                first_index += len(session.turns)
    return {**report_header(config, server, run_id), **summarize_turns(turns)}


# -- the figures ---------------------------------------------------------------------------------------------------


def decode_tokens_per_s(record: RequestRecord) -> float | None:
    """Output tokens after the first over the time after the first: 1 / TPOT."""
    tpot = record.tpot
    return 1.0 / tpot if tpot else None


def mode_figures(turns: Sequence[tuple[int, RequestRecord]]) -> dict[str, Any]:
    """One mode's figures from (turn number, record) pairs: latencies and decode speed over the completed turns
    numbered 2 and up, token totals over every completed turn."""
    done = [r for _, r in turns if r.ok]
    later = [r for number, r in turns if number >= 2 and r.ok]
    decode = [v for v in map(decode_tokens_per_s, later) if v is not None]
    return {
        "turns": len(turns),
        "completed": len(done),
        "failed": len(turns) - len(done),
        "errors": errors_by_code(r for _, r in turns),
        "later_turns": len(later),
        **distribution_ms((r.ttft for r in later if r.ttft is not None), "ttft"),
        "mean_decode_tokens_per_s": float(np.mean(decode)) if decode else 0.0,
        "median_decode_tokens_per_s": float(np.median(decode)) if decode else 0.0,
        **distribution_ms((r.e2el for r in later), "e2el"),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "cached_tokens": sum(r.cached_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
    }


def turn_figures(record: RequestRecord) -> dict[str, Any]:
    if not record.ok:
        return {"error": record.error}
    ttft, decode = record.ttft, decode_tokens_per_s(record)
    return {
        "ttft_ms": ttft * 1000.0 if ttft is not None else None,
        "decode_tokens_per_s": decode,
        "e2el_ms": record.e2el * 1000.0,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "output_tokens": record.output_tokens,
        "text": record.text,
        "error": None,
    }


def same_text(turn: Turn) -> bool | None:
    """Whether both modes answered the turn with the same text; None where either did not answer."""
    records = list(turn.records.values())
    if not all(r.ok for r in records):
        return None
    return all(r.text == records[0].text for r in records)


def summarize_turns(turns: Iterable[Turn]) -> dict[str, Any]:
    turns = list(turns)
    modes = {m.name: mode_figures([(t.number, t.records[m.name]) for t in turns]) for m in MODES}
    cached, uncached = modes[CACHED.name], modes[UNCACHED.name]
    same = [same_text(t) for t in turns]
    return {
        "modes": modes,
        "ttft_ratio": uncached["median_ttft_ms"] / cached["median_ttft_ms"] if cached["median_ttft_ms"] else 0.0,
        "prefill_tokens_saved": cached["cached_tokens"],
        "prefill_tokens_saved_fraction": cached["cached_tokens"] / cached["prompt_tokens"]
        if cached["prompt_tokens"]
        else 0.0,
        "identical_turns": same.count(True),
        "different_turns": same.count(False),
        "identical": all(s is True for s in same),
        "turns": [
            {
                "session": t.session,
                "turn": t.number,
                "first": t.first,
                **{name: turn_figures(r) for name, r in t.records.items()},
                "identical": s,
            }
            for t, s in zip(turns, same)
        ],
    }


def report_header(config: SessionsConfig, server: dict[str, Any], run_id: str) -> dict[str, Any]:
    return {
        "address": config.address,
        "protocol": config.protocol,
        "sessions": str(config.sessions_path),
        "num_sessions": len(config.sessions),
        "num_turns": sum(len(s.turns) for s in config.sessions),
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.sampling.temperature,
        "seed": config.sampling.seed,
        "ignore_eos": config.sampling.ignore_eos,
        "num_speculative_tokens": "server" if config.speculation is None else config.speculation,
        "timeout_s": config.timeout_s,
        "run_id": run_id,
        "server": server,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_summary(report: dict[str, Any]) -> str:
    lines = [
        f"{'mode':>9} {'turns>=2':>8} {'failed':>6} {'p50 ttft':>9} {'mean ttft':>9} {'p50 dec/s':>9} "
        f"{'p50 e2e':>9} {'prompt tok':>10} {'cached tok':>10}"
    ]
    for name, m in report["modes"].items():
        lines.append(
            f"{name:>9} {m['later_turns']:>8} {m['failed']:>6} {m['median_ttft_ms']:>9.1f} "
            f"{m['mean_ttft_ms']:>9.1f} {m['median_decode_tokens_per_s']:>9.2f} {m['median_e2el_ms']:>9.1f} "
            f"{m['prompt_tokens']:>10} {m['cached_tokens']:>10}"
        )
        if m["errors"]:
            lines.append(f"{'':>9} errors {m['errors']}")
    lines.append(
        f"median TTFT of turns >= 2, uncached / cached: {report['ttft_ratio']:.2f}x; prefill tokens saved: "
        f"{report['prefill_tokens_saved']} ({report['prefill_tokens_saved_fraction']:.0%} of the cached "
        "mode's prompt tokens)"
    )
    lines.append(
        f"texts identical in {report['identical_turns']} of {len(report['turns'])} turns "
        f"({report['different_turns']} different)"
    )
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------------------------


def _speculation(text: str) -> Speculation:
    try:
        return parse_speculation(text)
    except InvalidArgument:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer (0 = off) or auto, got {text!r}") from None


def register(modes: Any) -> None:
    parser = add_server_command(
        modes, "sessions", "multi-turn conversations through a running server, prefix caching on vs off", __doc__
    )
    parser.add_argument(
        "--sessions",
        required=True,
        type=Path,
        help='JSONL, one {"system": "...", "turns": ["...", ...], "id": "..." (optional)} per line',
    )
    parser.add_argument("--max-new-tokens", required=True, type=positive(int), help="output tokens per turn")
    parser.add_argument("--num-sessions", type=positive(int), default=None, help="the first N sessions (default all)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="turn i of the run is sampled with seed + i, in both modes"
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly --max-new-tokens per turn, past the end-of-sequence token",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=_speculation,
        default=None,
        help="K (0 = off) or auto (default: the server's setting)",
    )
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> SessionsConfig:
    sessions = read_sessions(args.sessions)
    if args.num_sessions is not None and args.num_sessions > len(sessions):
        raise InvalidArgument("--num-sessions", f"{args.num_sessions} asked, {args.sessions} holds {len(sessions)}")
    return SessionsConfig(
        address=args.address,
        sessions_path=args.sessions,
        sessions=sessions[: args.num_sessions],
        max_new_tokens=args.max_new_tokens,
        sampling=Sampling(args.temperature, args.seed, args.ignore_eos),
        speculation=args.num_speculative_tokens,
        protocol=args.protocol,
        timeout_s=args.timeout,
        auth_token=args.auth_token,
    )


def main(args: argparse.Namespace) -> int:
    report = run_to_report(run(config_from_args(args)), args.json)
    if report is None:
        return 1
    print(format_summary(report))
    print(f"report: {args.json}")
    return 0
