"""The figures of `specdec bench methods`, from its timed requests: per method and turn group, ratios to plain
decoding measured in the same run, and hybrid against the better of its parts. Pure: no models, no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from specdec_tools.bench.figures import add_speedups, ratio

OFF = "off"  # plain decoding: the baseline every ratio is over

# Prompts: one group. Sessions: a session's first turn (nothing of it is cached yet) apart from the later ones.
ALL, TURN_1, LATER_TURNS = "all", "turn_1", "turns_2_plus"

# hybrid drafts with both of these; it is worth running only where it keeps up with the better of the two alone.
HYBRID, HYBRID_PARTS, HYBRID_CRITERION = "hybrid", ("suffix", "draft_model"), 0.95


NO_DRAFT = "none"  # rounds verified without a proposal: plain decoding steps


@dataclass(frozen=True)
class MethodRounds:
    """A request's rounds that verified one drafting method's proposals (`NO_DRAFT`: none asked for)."""

    rounds: int = 0
    tokens: int = 0  # committed by those rounds
    proposed: int = 0
    accepted: int = 0
    seconds: float = 0.0  # their wall time, drafting and verifying

    def __add__(self, other: MethodRounds) -> MethodRounds:
        return MethodRounds(
            self.rounds + other.rounds,
            self.tokens + other.tokens,
            self.proposed + other.proposed,
            self.accepted + other.accepted,
            self.seconds + other.seconds,
        )


@dataclass(frozen=True)
class RequestRun:
    """One request, generated alone (batch size 1)."""

    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    cached_tokens: int  # of the prompt, read from the target's prefix cache
    seconds: float  # from adding the request to its last token: prefill included
    decode_seconds: float  # after its first token
    rounds: int
    proposed: int
    accepted: int
    by_method: Mapping[str, MethodRounds]  # its rounds by the method whose proposal each verified
    # Per round: (drafts proposed, accepted, its proposal was pre-drafted, it pre-drafted the next): what a replay
    # (`benchmarks/overlap/replay.py`) prices at other costs.
    outcomes: tuple[tuple[int, int, bool, bool], ...] = ()

    @property
    def decode_tokens(self) -> int:
        """The tokens after the first: what the rounds committed."""
        return max(len(self.token_ids) - 1, 0)


@dataclass(frozen=True)
class Record:
    """A request as one method ran it: `item` and `turn` name the same request in every method."""

    method: str
    item: str  # "prompt-N", or a session's id
    turn: int  # from 1; always 1 for prompts
    group: str  # ALL, TURN_1 or LATER_TURNS
    run: RequestRun

    @property
    def key(self) -> tuple[str, int]:
        return self.item, self.turn


def group_figures(records: Sequence[Record], baseline: Mapping[tuple[str, int], tuple[int, ...]]) -> dict[str, Any]:
    """One method's totals over one group of requests; `identical` counts those whose token ids equal the
    baseline's (plain decoding's) for the same request."""
    runs = [r.run for r in records]
    tokens, decode_tokens = sum(len(r.token_ids) for r in runs), sum(r.decode_tokens for r in runs)
    seconds, decode_seconds = sum(r.seconds for r in runs), sum(r.decode_seconds for r in runs)
    rounds, proposed, accepted = (sum(getattr(r, f) for r in runs) for f in ("rounds", "proposed", "accepted"))
    return {
        "requests": len(runs),
        "prompt_tokens": sum(r.prompt_tokens for r in runs),
        "cached_tokens": sum(r.cached_tokens for r in runs),
        "output_tokens": tokens,
        "seconds": seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_s": ratio(tokens, seconds) or 0.0,
        "decode_tokens_per_s": ratio(decode_tokens, decode_seconds) or 0.0,
        "rounds": rounds,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": ratio(accepted, proposed) or 0.0,
        "tokens_per_round": ratio(decode_tokens, rounds) or 0.0,
        "identical": sum(r.run.token_ids == baseline.get(r.key) for r in records),
        "rounds_by_method": rounds_by_method(runs),
    }


def rounds_by_method(runs: Sequence[RequestRun]) -> dict[str, dict[str, Any]]:
    """Where a method's time went, by the drafting method each round verified (hybrid mixes them): rounds, tokens
    committed, seconds, and the milliseconds each committed token took."""
    totals: dict[str, MethodRounds] = {}
    for run in runs:
        for name, part in run.by_method.items():
            totals[name] = totals.get(name, MethodRounds()) + part
    return {
        name: {
            **asdict(part),
            "tokens_per_round": ratio(part.tokens, part.rounds) or 0.0,
            "ms_per_token": 1000.0 * (ratio(part.seconds, part.tokens) or 0.0),
        }
        for name, part in sorted(totals.items())
    }


def results(records: Sequence[Record], methods: Sequence[str], groups: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{method: {group: figures}}, each with its speedups over plain decoding in the same group."""
    baseline = {r.key: r.run.token_ids for r in records if r.method == OFF}
    out = {
        m: {g: group_figures([r for r in records if r.method == m and r.group == g], baseline) for g in groups}
        for m in methods
    }
    add_speedups(out, OFF)
    return out


def hybrid_comparison(figures: Mapping[str, Mapping[str, Any]], group: str, suffix: str = "") -> dict[str, Any] | None:
    """Hybrid's decode speed in `group` against the faster of its parts that ran; None without hybrid or parts.
    `suffix`: the engines' name suffix of a draft-confidence threshold ("@0.7": hybrid@0.7 against suffix and
    draft_model@0.7)."""
    hybrid = HYBRID + suffix
    parts = [p for p in (HYBRID_PARTS[0], HYBRID_PARTS[1] + suffix) if p in figures]
    if hybrid not in figures or not parts:
        return None
    best = max(parts, key=lambda p: figures[p][group]["decode_tokens_per_s"])
    rate, best_rate = figures[hybrid][group]["decode_tokens_per_s"], figures[best][group]["decode_tokens_per_s"]
    share = ratio(rate, best_rate)
    return {
        "group": group,
        "best_part": best,
        "best_part_decode_tokens_per_s": best_rate,
        "decode_tokens_per_s": rate,
        "ratio_to_best_part": share,
        "criterion": HYBRID_CRITERION,
        "meets_criterion": share is not None and share >= HYBRID_CRITERION,
    }


def request_rows(records: Sequence[Record]) -> list[dict[str, Any]]:
    baseline = {r.key: r.run.token_ids for r in records if r.method == OFF}
    return [
        {
            "method": r.method,
            "item": r.item,
            "turn": r.turn,
            "group": r.group,
            "prompt_tokens": r.run.prompt_tokens,
            "cached_tokens": r.run.cached_tokens,
            "output_tokens": len(r.run.token_ids),
            "seconds": r.run.seconds,
            "decode_seconds": r.run.decode_seconds,
            "rounds": r.run.rounds,
            "proposed": r.run.proposed,
            "accepted": r.run.accepted,
            "identical": r.run.token_ids == baseline.get(r.key),
            "by_method": {name: asdict(part) for name, part in sorted(r.run.by_method.items())},
            "round_outcomes": [list(outcome) for outcome in r.run.outcomes],
            "token_ids": list(r.run.token_ids),
            "text": r.run.text,
        }
        for r in records
    ]


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_table(report: Mapping[str, Any]) -> str:
    lines = [
        f"{'method':<16} {'group':<13} {'req':>4} {'out tok':>7} {'tok/s':>7} {'dec tok/s':>9} {'speedup':>7} "
        f"{'dec spd':>7} {'acc/prop':>11} {'tok/rnd':>7} {'identical':>9}"
    ]
    for method, groups in report["results"].items():
        for group, f in groups.items():
            accepted = f"{f['accepted']}/{f['proposed']}" if f["proposed"] else "-"
            lines.append(
                f"{method:<16} {group:<13} {f['requests']:>4} {f['output_tokens']:>7} "
                f"{f['tokens_per_s']:>7.2f} {f['decode_tokens_per_s']:>9.2f} {_times(f['speedup']):>7} "
                f"{_times(f['decode_speedup']):>7} {accepted:>11} {f['tokens_per_round']:>7.2f} "
                f"{str(f['identical']) + '/' + str(f['requests']):>9}"
            )
    for method, groups in report["results"].items():
        parts = groups[report["headline_group"]]["rounds_by_method"]
        if len(parts) > 1:  # a method whose rounds mix proposals (hybrid), or proposals and plain steps
            lines.append(
                f"{method} rounds in {report['headline_group']}: "
                + ", ".join(
                    f"{name} {p['rounds']} ({p['tokens_per_round']:.1f} tok/rnd, {p['ms_per_token']:.0f} ms/tok)"
                    for name, p in parts.items()
                )
            )
    comparisons = {"": report.get("hybrid"), **report.get("hybrid_by_threshold", {})}
    for suffix, hybrid in comparisons.items():
        if hybrid is not None:
            lines.append(
                f"hybrid{suffix} / {hybrid['best_part']} (the faster part), decode tok/s in "
                f"{hybrid['group']}: {_times(hybrid['ratio_to_best_part'])} (criterion >= "
                f"{hybrid['criterion']:.2f}x: {'met' if hybrid['meets_criterion'] else 'NOT met'})"
            )
    return "\n".join(lines)
