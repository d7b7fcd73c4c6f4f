"""`specdec demo [CONFIG.yaml]` (what `make demo` runs): serve the demo pair locally and stream one completion over
gRPC, speculation on and off, then print both speeds and whether the tokens are identical."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec_core.config import AUTO
from specdec_tools.requests import generate_request

PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."


def stream(
    stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest, echo: bool
) -> tuple[float, pb.GenerateStreamResponse, list[int]]:
    """(seconds, the last chunk, every token id) of one streamed completion."""
    start = time.perf_counter()
    last, ids = None, []
    for chunk in stub.GenerateStream(request, timeout=3600):
        if echo:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
        ids += chunk.token_ids
    if echo:
        print()
    return time.perf_counter() - start, last, ids


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "demo", help="serve a model pair locally and stream one completion, speculation on and off", description=__doc__
    )
    parser.add_argument("config", nargs="?", default="deployments/configs/demo_cpu.yaml")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from deployments.launch import serving
    from deployments.serve_config import load_config

    config = load_config(args.config)
    print(
        f"demo: deploying {config.target.model} + {config.draft.model or config.draft.method} (this loads both models)",
        flush=True,
    )
    with serving(config, quiet=True), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        stream(stub, generate_request("hi", max_tokens=4), echo=False)  # warm-up
        print(f"\n>>> {args.prompt}\n")
        on = generate_request(args.prompt, max_tokens=args.max_tokens, speculation=AUTO)
        on_s, on_last, on_ids = stream(stub, on, echo=True)
        print("\n(the same request with speculation off...)", flush=True)
        off = generate_request(args.prompt, max_tokens=args.max_tokens, speculation=0)
        off_s, off_last, off_ids = stream(stub, off, echo=False)
    on_n, off_n = on_last.usage.completion_tokens, off_last.usage.completion_tokens
    spec = on_last.speculation
    rate = spec.accepted / spec.proposed if spec.proposed else 0.0
    print(
        f"\nspeculation on : {on_n} tokens in {on_s:.1f} s = {on_n / on_s:.2f} tokens/s "
        f"({spec.rounds} rounds, {spec.accepted}/{spec.proposed} drafts accepted = {rate:.0%})"
    )
    print(f"speculation off: {off_n} tokens in {off_s:.1f} s = {off_n / off_s:.2f} tokens/s")
    print(f"speedup: {(on_n / on_s) / (off_n / off_s):.2f}x; identical tokens (greedy): {on_ids == off_ids}")
    return 0
