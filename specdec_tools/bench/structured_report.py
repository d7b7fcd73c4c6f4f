"""The figures of `specdec bench structured`, from its timed requests. Pure: no models, no torch.

Words: *output tokens* are all a request's tokens (its eos included); *decode tokens* those after the first, which
the rounds committed. A *forced* token is one the grammar allowed alone at its position, which the engine verified
(or committed) as a proposal needing no draft call, in a round whose method is "forced"; such a round also commits
the token sampled after the forced run (from the masked p), except where the run ended the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specdec_tools.bench.figures import add_speedups, ratio
from specdec_tools.bench.structured_timing import DRAFTED_ROUND, FORCED_ROUND, ROUND_KINDS, StructuredRun

CONSTRAINED_PLAIN, CONSTRAINED_SPEC, UNCONSTRAINED_SPEC = "constrained_plain", "constrained_spec", "unconstrained_spec"
MODES = (CONSTRAINED_PLAIN, CONSTRAINED_SPEC, UNCONSTRAINED_SPEC)
ALL = "all"  # every request; the workload's kinds ("schema", "tool") are groups of their own
SPEEDUP_CRITERION = 1.3  # constrained speculative over constrained plain decoding, tokens/s
COMPLETE = ("eos", "stop")  # finish reasons of an output that ended of itself: only those are checked


@dataclass(frozen=True)
class Record:
    """A request as one mode ran it; `item` names the same request in every mode."""

    mode: str
    item: str
    kind: str  # the workload line's: "schema" or "tool"
    run: StructuredRun
    problem: str | None  # why its output is invalid; None: valid, or not checked (cut by length)

    @property
    def complete(self) -> bool:
        return self.run.finish_reason in COMPLETE

    @property
    def valid(self) -> bool | None:
        """None where the output did not end of itself: unfinished, not invalid."""
        return self.problem is None if self.complete else None


def _sum(records: Sequence[Record], field: str) -> Any:
    return sum(getattr(r.run, field) for r in records)


def _rounds(records: Sequence[Record], kind: str | None = None) -> list:
    return [x for r in records for x in r.run.rounds if kind is None or x.kind == kind]


def round_figures(rounds: Sequence) -> dict[str, Any]:
    seconds, tokens = sum(x.seconds for x in rounds), sum(x.tokens for x in rounds)
    return {
        "rounds": len(rounds),
        "tokens": tokens,
        "seconds": seconds,
        "seconds_per_round": ratio(seconds, len(rounds)),
        "tokens_per_round": ratio(tokens, len(rounds)),
    }


def group_figures(records: Sequence[Record], baseline: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """One mode's totals over a group of requests; `identical` counts those whose token ids equal `baseline`'s
    (constrained plain decoding's) for the same item."""
    output_tokens = sum(len(r.run.token_ids) for r in records)
    decode_tokens = output_tokens - len(records)  # each request's first token came from its prefill
    seconds, decode_seconds = _sum(records, "seconds"), _sum(records, "decode_seconds")
    rounds, forced = _rounds(records), _rounds(records, FORCED_ROUND)
    round_seconds, round_grammar = sum(x.seconds for x in rounds), sum(x.grammar_seconds for x in rounds)
    forced_tokens, forced_round_tokens = sum(x.accepted for x in forced), sum(x.tokens for x in forced)
    complete = [r for r in records if r.complete]
    valid = sum(r.valid is True for r in records)
    proposed, accepted = _sum(records, "proposed"), _sum(records, "accepted")
    return {
        "requests": len(records),
        "prompt_tokens": _sum(records, "prompt_tokens"),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_s": ratio(output_tokens, seconds) or 0.0,
        "decode_tokens_per_s": ratio(decode_tokens, decode_seconds) or 0.0,
        "rounds": len(rounds),
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": ratio(accepted, proposed) or 0.0,
        "tokens_per_round": ratio(decode_tokens, len(rounds)) or 0.0,
        "round_seconds": round_seconds,
        "seconds_per_round": ratio(round_seconds, len(rounds)),
        "grammar_seconds": _sum(records, "grammar_seconds"),
        "round_grammar_seconds": round_grammar,
        "grammar_seconds_per_round": ratio(round_grammar, len(rounds)),
        "grammar_share_of_round_seconds": ratio(round_grammar, round_seconds),
        "by_round_kind": {kind: round_figures(_rounds(records, kind)) for kind in ROUND_KINDS},
        "forced_rounds": len(forced),
        "forced_tokens": forced_tokens,
        "forced_round_tokens": forced_round_tokens,
        "forced_share": ratio(forced_tokens, output_tokens) or 0.0,
        "forced_round_share": ratio(forced_round_tokens, output_tokens) or 0.0,
        "complete": len(complete),
        "cut_by_length": sum(r.run.finish_reason == "length" for r in records),
        "valid": valid,
        "validity_rate": ratio(valid, len(complete)),
        "identical": sum(r.run.token_ids == baseline.get(r.item) for r in records),
    }


def results(records: Sequence[Record], groups: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{mode: {group: figures}}, each with its speedups over constrained plain decoding in the same group."""
    baseline = {r.item: r.run.token_ids for r in records if r.mode == CONSTRAINED_PLAIN}
    out = {
        m: {g: group_figures([r for r in records if r.mode == m and g in (ALL, r.kind)], baseline) for g in groups}
        for m in MODES
    }
    add_speedups(out, CONSTRAINED_PLAIN)
    return out


def _versus(constrained: float | None, unconstrained: float | None) -> dict[str, Any]:
    return {
        "constrained": constrained,
        "unconstrained": unconstrained,
        "ratio": None if constrained is None or unconstrained is None else ratio(constrained, unconstrained),
    }


def headline(figures: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The answers over all requests: the speedup of constrained speculation, its identity with constrained plain
    decoding, and what the grammar costs a speculative round."""
    spec, plain, free = (figures[m][ALL] for m in (CONSTRAINED_SPEC, CONSTRAINED_PLAIN, UNCONSTRAINED_SPEC))
    drafted = [f["by_round_kind"][DRAFTED_ROUND]["seconds_per_round"] for f in (spec, free)]
    return {
        "speedup": {
            "tokens_per_s": spec["speedup"],
            "decode_tokens_per_s": spec["decode_speedup"],
            "criterion": SPEEDUP_CRITERION,
            "meets_criterion": spec["speedup"] is not None and spec["speedup"] >= SPEEDUP_CRITERION,
        },
        "identical": {
            "requests": spec["requests"],
            "identical": spec["identical"],
            "all": spec["identical"] == spec["requests"] == plain["requests"],
        },
        "grammar_cost": {
            "seconds_per_round": _versus(spec["seconds_per_round"], free["seconds_per_round"]),
            "seconds_per_drafted_round": _versus(*drafted),
            "grammar_seconds_per_round": spec["grammar_seconds_per_round"],
            "grammar_share_of_round_seconds": spec["grammar_share_of_round_seconds"],
        },
        "forced_share": spec["forced_share"],
        "validity_rate": spec["validity_rate"],
    }


def request_rows(records: Sequence[Record]) -> list[dict[str, Any]]:
    baseline = {r.item: r.run.token_ids for r in records if r.mode == CONSTRAINED_PLAIN}
    rows = []
    for r in records:
        forced = [x for x in r.run.rounds if x.kind == FORCED_ROUND]
        rows.append(
            {
                "mode": r.mode,
                "item": r.item,
                "kind": r.kind,
                "prompt_tokens": r.run.prompt_tokens,
                "output_tokens": len(r.run.token_ids),
                "finish_reason": r.run.finish_reason,
                "seconds": r.run.seconds,
                "decode_seconds": r.run.decode_seconds,
                "grammar_seconds": r.run.grammar_seconds,
                "rounds": len(r.run.rounds),
                "proposed": r.run.proposed,
                "accepted": r.run.accepted,
                "forced_rounds": len(forced),
                "forced_tokens": sum(x.accepted for x in forced),
                "valid": r.valid,
                "problem": r.problem,
                "identical": r.run.token_ids == baseline.get(r.item),
                "token_ids": list(r.run.token_ids),
                "text": r.run.text,
            }
        )
    return rows


def _num(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def format_table(report: Mapping[str, Any]) -> str:
    lines = [
        f"{'mode':<19} {'group':<7} {'req':>4} {'out tok':>7} {'tok/s':>7} {'dec tok/s':>9} {'speedup':>7} "
        f"{'rounds':>6} {'ms/rnd':>7} {'gram ms/rnd':>11} {'forced':>6} {'valid':>7} {'identical':>9}"
    ]
    for mode, groups in report["results"].items():
        for group, f in groups.items():
            lines.append(
                f"{mode:<19} {group:<7} {f['requests']:>4} {f['output_tokens']:>7} "
                f"{f['tokens_per_s']:>7.2f} {f['decode_tokens_per_s']:>9.2f} "
                f"{_num(f['speedup'], '.2f') + 'x':>7} {f['rounds']:>6} "
                f"{_num(f['seconds_per_round'], '.1f', 1e3):>7} "
                f"{_num(f['grammar_seconds_per_round'], '.3f', 1e3):>11} {f['forced_share']:>6.2f} "
                f"{str(f['valid']) + '/' + str(f['complete']):>7} "
                f"{str(f['identical']) + '/' + str(f['requests']):>9}"
            )
    speedup, same, cost = report["speedup"], report["identical"], report["grammar_cost"]
    per_round, drafted = cost["seconds_per_round"], cost["seconds_per_drafted_round"]
    lines += [
        f"{CONSTRAINED_SPEC} / {CONSTRAINED_PLAIN}: {_num(speedup['tokens_per_s'], '.2f')}x tokens/s (decode "
        f"{_num(speedup['decode_tokens_per_s'], '.2f')}x); criterion >= {speedup['criterion']:.2f}x: "
        f"{'met' if speedup['meets_criterion'] else 'NOT met'}",
        f"identical token ids ({CONSTRAINED_SPEC} vs {CONSTRAINED_PLAIN}): {same['identical']}/{same['requests']}",
        f"ms per round, constrained / unconstrained speculation: {_num(per_round['constrained'], '.1f', 1e3)} / "
        f"{_num(per_round['unconstrained'], '.1f', 1e3)} ({_num(per_round['ratio'], '.2f')}x); drafted rounds only: "
        f"{_num(drafted['constrained'], '.1f', 1e3)} / {_num(drafted['unconstrained'], '.1f', 1e3)} "
        f"({_num(drafted['ratio'], '.2f')}x); in the grammar's code: "
        f"{_num(cost['grammar_seconds_per_round'], '.3f', 1e3)} ms a round "
        f"({_num(cost['grammar_share_of_round_seconds'], '.1%')} of round time)",
    ]
    return "\n".join(lines)
