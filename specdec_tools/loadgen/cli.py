"""`specdec bench serve --address HOST:PORT --prompts FILE.jsonl ...`: load a running server's public gRPC API and
report latency percentiles, throughput and goodput per load point, speculation on (and, with --compare-off, off).

Each load point is a concurrency (that many streams kept in flight) or a request rate (open-loop arrivals). With
--compare-off every point runs twice against the same server, the second time with num_speculative_tokens = 0 in
each request; which mode goes first alternates from point to point, so that drift in the machine's speed falls on
both alike. With --blocks N each mode's requests (or duration) are split into N blocks run in the order A B B A
A B ..., so that a machine whose speed drifts within a point (a shared host) still compares the modes fairly.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdec_core.errors import InvalidArgument
from specdec_tools.loadgen.client import LOADS, Concurrency, Load, RequestRate, Sampling
from specdec_tools.loadgen.command import (
    add_server_command,
    non_negative_float,
    non_negative_int,
    positive,
    run_to_report,
)
from specdec_tools.loadgen.metrics import SLO_KEYS, RequestRecord, summarize
from specdec_tools.loadgen.transport import connect
from specdec_tools.requests import Prompt, Speculation, parse_speculation, read_prompts

OFF = 0  # num_speculative_tokens of the speculation-off mode


@dataclass(frozen=True)
class LoadConfig:
    address: str
    prompts_path: Path
    prompts: tuple[Prompt, ...]
    max_new_tokens: int
    loads: tuple[Load, ...]
    sampling: Sampling
    speculation: Speculation  # what speculative requests ask; None: the server's setting
    compare_off: bool = False
    burstiness: float = 1.0
    warmup: int = 2
    duration_s: float | None = None
    num_requests: int | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)
    timeout_s: float = 600.0
    auth_token: str | None = None
    progress: bool = True
    blocks: int = 1  # each point's share of every mode, split and interleaved (A B B A ...)
    protocol: str = "grpc"  # or "openai": the HTTP API's streamed chat completions

    def requests_per_point(self, load: Load) -> int | None:
        """None: as many as fit in the duration. By default every prompt once, and enough for each block to hold
        the load point's concurrency."""
        if self.duration_s is not None:
            return None
        if self.num_requests is not None:
            return self.num_requests
        return max(len(self.prompts), load.min_requests * self.blocks)

    def modes(self) -> dict[str, Speculation]:
        return {"speculative": self.speculation, "off": OFF} if self.compare_off else {"speculative": self.speculation}


# -- flags ---------------------------------------------------------------------------------------------------------


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive integers separated by commas, got {text!r}")
    return values


def _positive_rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive numbers (or inf) separated by commas, got {text!r}")
    return values


def _speculation(text: str) -> Speculation:
    try:
        value = parse_speculation(text)
    except InvalidArgument:
        value = 0
    if value == 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer or auto, got {text!r} (for speculation off, use --compare-off)"
        )
    return value


def _slo(text: str) -> tuple[str, float]:
    key, _, value = text.partition(":")
    if key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(f"keys must be one of {', '.join(SLO_KEYS)} (as KEY:MS), got {text!r}")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not ms > 0 or math.isinf(ms):
        raise argparse.ArgumentTypeError(f"{key} needs a positive number of milliseconds (as {key}:MS), got {text!r}")
    return key, ms


def register(modes: Any) -> None:
    parser = add_server_command(
        modes,
        "serve",
        "load generator for a running server's gRPC API: latency percentiles, throughput, goodput",
        __doc__,
    )
    parser.add_argument(
        "--prompts",
        required=True,
        type=Path,
        help='JSONL, one {"prompt": "...", "max_tokens": N (optional)} per line, cycled as needed',
    )
    parser.add_argument(
        "--max-new-tokens",
        required=True,
        type=positive(int),
        help="output tokens per request, where a prompt line gives no max_tokens",
    )
    parser.add_argument(
        "--concurrency", type=_positive_ints, default=[], help="load points: streams kept in flight, e.g. 1,4,8"
    )
    parser.add_argument(
        "--request-rate",
        type=_positive_rates,
        default=[],
        help="load points: requests per second (open loop), e.g. 0.5,1,inf",
    )
    parser.add_argument(
        "--burstiness",
        type=positive(float),
        default=1.0,
        help="gamma shape of the inter-arrival times with --request-rate: 1 = Poisson, <1 burstier",
    )
    parser.add_argument(
        "--compare-off",
        action="store_true",
        help="run every point again with speculation off (num_speculative_tokens 0 per request)",
    )
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--duration", type=positive(float), help="seconds of sending per load point and mode")
    length.add_argument(
        "--num-requests",
        type=positive(int),
        help="requests per load point and mode (default: the number of prompts, at least the concurrency)",
    )
    parser.add_argument(
        "--blocks",
        type=positive(int),
        default=1,
        help="split each point's requests (or duration) per mode into this many blocks, run "
        "interleaved A B B A ... so that drift in the machine's speed cancels in the ratio",
    )
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="warm-up requests per mode, not measured")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="request i is sampled with seed + i")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly max_tokens per request, past the end-of-sequence token",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=_speculation,
        default=None,
        help="K or auto: what speculative requests ask (default: the server's setting)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=[],
        metavar="KEY:MS",
        help="SLOs in milliseconds, keys ttft, tpot, e2el: goodput counts requests meeting all",
    )
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")
    parser.add_argument("--plot", type=Path, default=None, help="the PNG (default: the --json path with .png)")
    parser.set_defaults(func=main)


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    loads = [Concurrency(c) for c in args.concurrency] + [
        RequestRate(r, args.burstiness, args.seed) for r in args.request_rate
    ]
    if not loads:
        raise InvalidArgument("--concurrency", "give --concurrency or --request-rate (or both)")
    if args.duration is not None and any(math.isinf(r) for r in args.request_rate):
        raise InvalidArgument("--request-rate", "inf sends every request at once: use --num-requests, not --duration")
    if args.num_requests is not None and args.blocks > args.num_requests:
        raise InvalidArgument(
            "--blocks", f"{args.blocks} blocks of {args.num_requests} requests: at most one block per request"
        )
    _check_blocks_hold_concurrency(args.num_requests, args.blocks, args.concurrency)
    return LoadConfig(
        address=args.address,
        prompts_path=args.prompts,
        prompts=read_prompts(args.prompts, args.max_new_tokens),
        max_new_tokens=args.max_new_tokens,
        loads=tuple(loads),
        sampling=Sampling(args.temperature, args.seed, args.ignore_eos),
        speculation=args.num_speculative_tokens,
        compare_off=args.compare_off,
        burstiness=args.burstiness,
        warmup=args.warmup,
        duration_s=args.duration,
        num_requests=args.num_requests,
        slos_ms=dict(args.goodput),
        timeout_s=args.timeout,
        auth_token=args.auth_token,
        blocks=args.blocks,
        protocol=args.protocol,
    )


def _check_blocks_hold_concurrency(num_requests: int | None, blocks: int, concurrency: list[int]) -> None:
    """A block smaller than a concurrency point never has that many streams in flight: the point would report a
    lighter load than it names."""
    if num_requests is None or not concurrency:
        return
    smallest = num_requests // blocks
    if smallest < max(concurrency):
        raise InvalidArgument(
            "--num-requests",
            f"{num_requests} requests in {blocks} block(s) leave {smallest} a "
            f"block, fewer than --concurrency {max(concurrency)}: give at least "
            f"{max(concurrency) * blocks} requests, or fewer blocks",
        )


def main(args: argparse.Namespace) -> int:
    from specdec_tools.loadgen.plot import plot_report

    report = run_to_report(run(config_from_args(args)), args.json)
    if report is None:
        return 1
    plot_path = args.plot or args.json.with_suffix(".png")
    plot_report(report, plot_path)
    print(format_summary(report))
    print(f"report: {args.json}; plot: {plot_path}")
    return 0


# -- the run -------------------------------------------------------------------------------------------------------


async def run(config: LoadConfig) -> dict[str, Any]:
    """Every load point in each mode against the server at config.address; the report as a dict."""
    async with connect(config.protocol, config.address, config.auth_token, config.timeout_s) as (server, send):

        def sender(speculation: Speculation) -> Any:
            async def send_index(index: int) -> RequestRecord:
                prompt = config.prompts[index % len(config.prompts)]
                return await send(prompt, index, config.sampling, speculation)

            return send_index

        points = await run_points(config, sender)
    return {**report_header(config, server), "points": points}


async def run_points(config: LoadConfig, sender: Any) -> list[dict[str, Any]]:
    """Warm-up requests in each mode (first-call costs stay out of the figures), then every load point."""
    senders = {mode: sender(k) for mode, k in config.modes().items()}
    for send in senders.values():
        for index in range(config.warmup):
            await send(index)
    return [
        await run_load(config, load, senders, speculative_first=number % 2 == 0)
        for number, load in enumerate(config.loads)
    ]


async def run_load(config: LoadConfig, load: Load, senders: dict[str, Any], speculative_first: bool) -> dict[str, Any]:
    """One load point in every mode, block by block (each block in the order opposite to the last one's); with
    both modes, the speedup. A mode's figures pool its blocks: their requests, and the sum of their durations.
    With several blocks, `speedup_by_block` holds each block's own ratio (block i of one mode ran next to block i of
    the other): their spread shows how far the machine's drift moves a ratio."""
    point: dict[str, Any] = {load.key: load.report_value}
    order = list(senders) if speculative_first else list(senders)[::-1]
    records: dict[str, list[RequestRecord]] = {mode: [] for mode in senders}
    seconds = dict.fromkeys(senders, 0.0)
    per_block: dict[str, list[float]] = {mode: [] for mode in senders}  # output tokens/s of each block
    for block in range(config.blocks):
        for mode in order if block % 2 == 0 else order[::-1]:
            label = f"{load.label}, {mode}" + (f" ({block + 1}/{config.blocks})" if config.blocks > 1 else "")
            got, took = await run_block(config, load, senders[mode], label, block)
            records[mode] += got
            seconds[mode] += took
            per_block[mode].append(summarize(got, took, config.slos_ms)["output_tokens_per_s"])
    figures = {mode: summarize(records[mode], seconds[mode], config.slos_ms) for mode in senders}
    point["speculative"] = figures["speculative"]
    if "off" in figures:
        point["off"] = figures["off"]
        point["speedup"] = _ratio(figures["speculative"]["output_tokens_per_s"], figures["off"]["output_tokens_per_s"])
        if config.blocks > 1:
            point["speedup_by_block"] = [_ratio(s, o) for s, o in zip(per_block["speculative"], per_block["off"])]
    return point


def _ratio(speculative: float, off: float) -> float:
    return speculative / off if off else 0.0


def report_header(config: LoadConfig, server: dict[str, Any]) -> dict[str, Any]:
    return {
        "address": config.address,
        "protocol": config.protocol,
        "prompts": str(config.prompts_path),
        "num_prompts": len(config.prompts),
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.sampling.temperature,
        "seed": config.sampling.seed,
        "ignore_eos": config.sampling.ignore_eos,
        "num_speculative_tokens": "server" if config.speculation is None else config.speculation,
        "compare_off": config.compare_off,
        "warmup": config.warmup,
        "duration_per_point_s": config.duration_s,
        "num_requests": config.num_requests,
        "blocks": config.blocks,
        "burstiness": config.burstiness,
        "goodput_slos_ms": config.slos_ms,
        "timeout_s": config.timeout_s,
        "server": server,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


async def run_block(
    config: LoadConfig, load: Load, send: Any, label: str, block: int
) -> tuple[list[RequestRecord], float]:
    """One block of one mode of one load point: its requests' records and its duration. Blocks take consecutive
    request indices (prompts and seeds), so that every mode sees the same requests."""
    total = config.requests_per_point(load)
    first, count = 0, None
    if total is not None:
        sizes = [total // config.blocks + (1 if b < total % config.blocks else 0) for b in range(config.blocks)]
        first, count = sum(sizes[:block]), sizes[block]
    duration_s = config.duration_s / config.blocks if config.duration_s is not None else None
    with tqdm(total=count, desc=label, unit="req", file=sys.stderr, disable=not config.progress) as bar:
        start = time.perf_counter()
        deadline = start + duration_s if duration_s is not None else None
        records = await load.drive(lambda index: send(first + index), count, deadline, lambda: bar.update(1))
        return records, time.perf_counter() - start


def format_summary(report: dict[str, Any]) -> str:
    header = (
        f"{'load':>18} {'mode':>11} {'done':>5} {'err':>4} {'out tok/s':>9} {'p50 ttft':>9} {'p50 tpot':>9} "
        f"{'p99 tpot':>9} {'p50 itl':>8} {'accept':>6} {'tok/rnd':>7}"
    )
    lines = [header]
    for point in report["points"]:
        key = next(kind.key for kind in LOADS if kind.key in point)
        label = f"{key.replace('_', ' ')} {point[key]}"
        for mode in ("speculative", "off"):
            if mode not in point:
                continue
            m = point[mode]
            lines.append(
                f"{label:>18} {mode:>11} {m['completed']:>5} {m['failed']:>4} "
                f"{m['output_tokens_per_s']:>9.2f} {m['median_ttft_ms']:>9.1f} {m['median_tpot_ms']:>9.1f} "
                f"{m['p99_tpot_ms']:>9.1f} {m['median_itl_ms']:>8.1f} {m['acceptance_rate']:>6.2f} "
                f"{m['mean_tokens_per_round']:>7.2f}"
            )
            if m["errors"]:
                lines.append(f"{'':>18} {'errors':>11} {m['errors']}")
        if "speedup" in point:
            spread = point.get("speedup_by_block")
            blocks = f" (blocks {min(spread):.2f}-{max(spread):.2f}x)" if spread else ""
            lines.append(f"{label:>18} {'speedup':>11} {point['speedup']:.2f}x{blocks}")
    return "\n".join(lines)
