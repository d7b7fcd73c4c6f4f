"""`make demo`: serve the demo pair locally and stream one completion over gRPC, speculation on and off.

    python -m deployments.demo [CONFIG.yaml] [--prompt TEXT] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc

PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."


def stream(stub: pb_grpc.GenerationServiceStub, request: pb.GenerateRequest, echo: bool) -> tuple[float, pb.GenerateStreamResponse, list[int]]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="deployments/configs/demo_cpu.yaml")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    from deployments.cli import serving
    from deployments.config import load_config

    config = load_config(args.config)
    print(f"demo: deploying {config.target.model} + {config.draft.model or config.draft.method} (this loads both models)",
          flush=True)
    with serving(config, quiet=True), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        base = pb.GenerateRequest(prompt=args.prompt, sampling=pb.SamplingParams(max_tokens=args.max_tokens))
        stream(stub, pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=4)), echo=False)  # warm-up
        print(f"\n>>> {args.prompt}\n")
        on = pb.GenerateRequest()
        on.CopyFrom(base)
        on.speculation.adaptive = True
        on_s, on_last, on_ids = stream(stub, on, echo=True)
        off = pb.GenerateRequest()
        off.CopyFrom(base)
        off.speculation.num_speculative_tokens = 0
        print("\n(the same request with speculation off...)", flush=True)
        off_s, off_last, off_ids = stream(stub, off, echo=False)
    on_n, off_n = on_last.usage.completion_tokens, off_last.usage.completion_tokens
    spec = on_last.speculation
    rate = spec.accepted / spec.proposed if spec.proposed else 0.0
    print(f"\nspeculation on : {on_n} tokens in {on_s:.1f} s = {on_n / on_s:.2f} tokens/s "
          f"({spec.rounds} rounds, {spec.accepted}/{spec.proposed} drafts accepted = {rate:.0%})")
    print(f"speculation off: {off_n} tokens in {off_s:.1f} s = {off_n / off_s:.2f} tokens/s")
    print(f"speedup: {(on_n / on_s) / (off_n / off_s):.2f}x; identical tokens (greedy): {on_ids == off_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
