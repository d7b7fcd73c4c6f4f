"""`specdec proposals stats FILE...`: acceptance by draft position and the mismatch rate over time, read from the
proposal log that the router writes (`deployments.proposal_log`, config `proposal_log`); with q and p in the records,
their means over accepted and rejected proposals."""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    proposals = sub.add_parser("proposals", help="the proposal log (config: proposal_log)")
    actions = proposals.add_subparsers(dest="proposals_command", required=True)
    stats = actions.add_parser("stats", help="acceptance by draft position and the mismatch rate over time")
    stats.add_argument("files", nargs="+", help="proposals.jsonl files (rotated ones too)")
    stats.add_argument("--bucket-seconds", type=float, default=60.0, help="time bucket for the mismatch rate")
    stats.add_argument("--json", action="store_true", help="print the summary as JSON")
    stats.set_defaults(func=stats_main)


def stats_main(args: argparse.Namespace) -> int:
    summary = summarize(read_records(args.files), args.bucket_seconds)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def read_records(paths: Iterable[str | Path]) -> Iterable[dict[str, Any]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def summarize(records: Iterable[dict[str, Any]], bucket_s: float = 60.0) -> dict[str, Any]:
    """Acceptance by draft position (the i-th proposed token is accepted iff accepted > i), overall, and the
    mismatch rate (1 - acceptance) per time bucket; with q and p in the records, `mean_probs`: their means over
    accepted and rejected proposals."""
    by_position: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # position -> [accepted, proposed]
    by_time: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    probs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # accepted|rejected -> [sum q, sum p, n]
    rounds = proposed = accepted = 0
    requests = set()
    for r in records:
        n, a = len(r["proposed"]), min(r["accepted"], len(r["proposed"]))
        rounds += 1
        proposed += n
        accepted += a
        requests.add(r["request_id"])
        if "q" in r and "p" in r:
            _add_probs(probs, r["q"], r["p"], a)
        for i in range(n):
            by_position[i][1] += 1
            by_position[i][0] += int(i < a)
        bucket = int(r["ts"] // bucket_s)
        by_time[bucket][0] += a
        by_time[bucket][1] += n
    return {
        "requests": len(requests),
        "rounds": rounds,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "acceptance_by_position": {i: a / p for i, (a, p) in sorted(by_position.items())},
        "mismatch_rate_over_time": [
            {"start": b * bucket_s, "mismatch_rate": 1 - a / p, "proposed": p}
            for b, (a, p) in sorted(by_time.items())
            if p
        ],
        **({"mean_probs": _means(probs)} if probs else {}),
    }


def _add_probs(sums: dict[str, list[float]], q: list[float], p: list[float], accepted: int) -> None:
    """The first `accepted` proposals were accepted; the next one, if any, was rejected. Those after it were
    never judged, so they count for neither."""
    for i in range(min(accepted + 1, len(q), len(p))):
        entry = sums["accepted" if i < accepted else "rejected"]
        entry[0] += q[i]
        entry[1] += p[i]
        entry[2] += 1


def _means(sums: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {kind: {"q": q / n, "p": p / n, "n": n} for kind, (q, p, n) in sorted(sums.items())}


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"requests {summary['requests']}, rounds {summary['rounds']}, proposed {summary['proposed']}, "
        f"accepted {summary['accepted']} ({summary['acceptance_rate']:.1%})",
        "acceptance by draft position:",
        *(f"  {i + 1:>3}: {rate:.1%}" for i, rate in summary["acceptance_by_position"].items()),
        "mismatch rate over time:",
        *(
            f"  {time.strftime('%Y-%m-%d %H:%M', time.gmtime(row['start']))}  {row['mismatch_rate']:.1%}  "
            f"({row['proposed']} proposed)"
            for row in summary["mismatch_rate_over_time"]
        ),
    ]
    if "mean_probs" in summary:
        lines.append("mean draft q / target p of the proposals:")
        lines += [f"  {kind:>8}: {m['q']:.3f} / {m['p']:.3f}  ({m['n']})" for kind, m in summary["mean_probs"].items()]
    return "\n".join(lines)
