"""Record how the worker deployments scale under a step load: replicas and sessions over time.

Deploys CONFIG (workers with `autoscaling` set: deployments/configs/autoscale_cpu.yaml) as `specdec serve` does (a
local Ray cluster, or the one at $RAY_ADDRESS), then keeps a closed-loop load of greedy GenerateStream requests
whose number of streams steps through --steps (STREAMS:SECONDS, comma-separated), while sampling every --interval
seconds each worker deployment's replicas (Serve's states: running, starting, stopping), those registered for the
routers, and the sessions each replica holds, a draining one's included (`specdec_tools.scaling`). Prints the
samples where the replicas changed and a summary; --json writes every sample and every request's outcome. Each
request has a cache salt of its own: repeated prompts are computed whole, as distinct users' would be. Exit status
1 if any request failed.

Usage: python benchmarks/autoscaling/autoscale_timeline.py deployments/configs/autoscale_cpu.yaml \\
           [--steps 0:30,16:600,2:600,0:300] [--prompts benchmarks/prompts/code.jsonl] [--max-new-tokens 128] \\
           [--interval 1] [--json autoscale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

from deployments.launch import serving
from deployments.serve_config import load_config
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec_tools.requests import GRPC_OPTIONS, generate_request, read_prompts
from specdec_tools.scaling import ScalingTimeline, StepLoad


def parse_steps(text: str) -> list[tuple[int, float]]:
    steps = []
    for part in text.split(","):
        streams, _, seconds = part.partition(":")
        steps.append((int(streams), float(seconds)))
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", default="0:30,16:600,2:600,0:300", help="STREAMS:SECONDS,... in order")
    parser.add_argument("--prompts", type=Path, default=Path("benchmarks/prompts/code.jsonl"))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = load_config(args.config)
    steps = parse_steps(args.steps)
    prompts = read_prompts(args.prompts, args.max_new_tokens)

    def request(stream: int, index: int):
        prompt = prompts[(stream * 7 + index) % len(prompts)]
        return generate_request(
            prompt.text, max_tokens=prompt.max_tokens, ignore_eos=True, cache_salt=f"{stream}-{index}"
        )

    with serving(config, quiet=True), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}", GRPC_OPTIONS) as channel:
        load = StepLoad(pb_grpc.GenerationServiceStub(channel), request, metadata=[("application", config.app_name)])
        timeline = ScalingTimeline(config.app_name, load=load, interval_s=args.interval).start()
        began, marks = time.monotonic(), []
        try:
            for streams, seconds in steps:
                marks.append((round(time.monotonic() - began, 1), streams))
                print(f"{marks[-1][0]:7.1f}s step: {streams} streams for {seconds:.0f} s", flush=True)
                load.set_streams(streams)
                time.sleep(seconds)
        finally:
            load.stop()
            timeline.stop()
    outcomes = Counter(r.error or "OK" for r in load.results)
    print(timeline.table(changes_only=True))
    for kind in timeline.kinds:
        running = [s.running(kind) for s in timeline.samples]
        drained = sum(1 for s in timeline.samples if any(s.draining(kind).values()))
        print(
            f"{kind}: replicas {min(running, default=0)}..{max(running, default=0)}; "
            f"samples with sessions on a draining replica: {drained}"
        )
    print(f"requests: {dict(outcomes)}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": str(args.config),
                    "steps": steps,
                    "step_starts": marks,
                    "interval_s": args.interval,
                    "samples": timeline.as_json(),
                    "requests": [
                        {"stream": r.stream, "index": r.index, "tokens": len(r.token_ids), "error": r.error}
                        for r in load.results
                    ],
                },
                indent=1,
            )
        )
    return 0 if set(outcomes) <= {"OK"} else 1


if __name__ == "__main__":
    sys.exit(main())
