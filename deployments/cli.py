"""`specdec serve CONFIG.yaml` and `specdec generate`: the serving commands of the `specdec` CLI."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]


def register(sub: Any) -> None:
    serve_p = sub.add_parser("serve", help="serve the models of CONFIG.yaml on Ray Serve (gRPC)")
    serve_p.add_argument("config", help="YAML config: target, draft, grpc_port, ... (see deployments/configs/)")
    serve_p.set_defaults(func=serve_main)

    gen = sub.add_parser("generate", help="send one prompt to a running server and print the completion")
    gen.add_argument("prompt", help="the prompt text (the chat template is applied unless --raw)")
    gen.add_argument("--address", default="localhost:9000", help="HOST:PORT of the gRPC endpoint")
    gen.add_argument("--stream", action="store_true", help="print the text as it is committed")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--num-speculative-tokens", default=None, help="N (0 = off) or auto; default: the server's")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    gen.add_argument("--auth-token", default=os.environ.get("SPECDEC_AUTH_TOKEN"),
                     help="sent as `authorization: Bearer TOKEN` (default: $SPECDEC_AUTH_TOKEN)")
    gen.set_defaults(func=generate_main)

    proposals = sub.add_parser("proposals", help="the proposal log (config: proposal_log)")
    actions = proposals.add_subparsers(dest="proposals_command", required=True)
    stats = actions.add_parser("stats", help="acceptance by draft position and the mismatch rate over time")
    stats.add_argument("files", nargs="+", help="proposals.jsonl files (rotated ones too)")
    stats.add_argument("--bucket-seconds", type=float, default=60.0, help="time bucket for the mismatch rate")
    stats.add_argument("--json", action="store_true", help="print the summary as JSON")
    stats.set_defaults(func=proposals_stats_main)

    from deployments import soak  # `specdec soak`: its own module (deployments/soak.py)

    soak.register(sub)


# -- serve -------------------------------------------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> int:
    from deployments.config import load_config

    config = load_config(args.config)
    stop = threading.Event()
    with serving(config):
        # After ray.init, which installs handlers of its own: stop by leaving the loop, so the cleanup runs.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"specdec: serving {config.target.model} (draft: {config.draft.method}) on gRPC port {config.grpc_port}",
              flush=True)
        while not stop.is_set():
            stop.wait(1.0)
        print("specdec: shutting down", flush=True)
    return 0


@contextlib.contextmanager
def serving(config: Any, quiet: bool = False) -> Iterator[None]:
    """Deploy `config` on Ray Serve for the duration of the block: on the cluster at $RAY_ADDRESS, or on a local
    one started (and stopped, with every process it started) here. `quiet`: keep the cluster's logs out of this
    process's output."""
    import logging

    import ray
    from ray import serve

    from deployments import registry
    from deployments.app import build_app, grpc_options, limit_public_messages

    address = os.environ.get("RAY_ADDRESS")
    started_ray = not address
    limit_public_messages()
    if started_ray:
        # Draft and target take turns within a round, so on one machine they may share its cores: give the local
        # cluster enough logical CPUs for every deployment's request.
        needed = _cpus_needed(config)
        ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False,
                 log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    else:
        ray.init(address=address, log_to_driver=not quiet)
    if quiet:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": "0.0.0.0", "port": config.http_port}, grpc_options=grpc_options(config))
        serve.run(build_app(config), name=config.app_name, route_prefix=f"/{config.app_name}")
        yield
    finally:
        try:
            serve.delete(config.app_name)
            if started_ray:
                serve.shutdown()
            registry.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


def _cpus_needed(config: Any) -> float:
    target = config.target
    total = target.num_cpus * target.tensor_parallel_size * target.num_replicas
    total += config.router.num_cpus * config.router.num_replicas
    if config.draft.method == "draft_model":
        total += config.draft.num_cpus * config.draft.num_replicas
    return total + 1  # Serve's controller and proxy


# -- proposals ---------------------------------------------------------------------------------------------------


def proposals_stats_main(args: argparse.Namespace) -> int:
    import json

    from deployments.proposals import format_summary, read_records, summarize

    summary = summarize(read_records(args.files), args.bucket_seconds)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


# -- generate ----------------------------------------------------------------------------------------------------


def build_request(args: argparse.Namespace) -> Any:
    from specdec.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(prompt=args.prompt, raw_prompt=args.raw)
    s = request.sampling
    s.temperature = args.temperature
    s.top_k = args.top_k
    s.stop.extend(args.stop)
    if args.top_p is not None:
        s.top_p = args.top_p
    if args.seed is not None:
        s.seed = args.seed
    if args.max_tokens is not None:
        s.max_tokens = args.max_tokens
    k = args.num_speculative_tokens
    if k == "auto":
        request.speculation.adaptive = True
    elif k is not None:
        request.speculation.num_speculative_tokens = int(k)
    return request


def generate_main(args: argparse.Namespace) -> int:
    import grpc

    from specdec.v1 import generation_pb2 as pb
    from specdec.v1 import generation_pb2_grpc as pb_grpc

    request = build_request(args)
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    start = time.perf_counter()
    with grpc.insecure_channel(args.address, options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        try:
            if args.stream:
                last = None
                tokens = 0
                for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    tokens += len(chunk.token_ids)
                    last = chunk
                print()
                final = last
            else:
                final = stub.Generate(request, timeout=args.timeout, metadata=metadata)
                print(final.text)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - start
    spec = final.speculation
    rate = spec.accepted / spec.proposed if spec.proposed else 0.0
    print(
        f"[{pb.FinishReason.Name(final.finish_reason)} | {final.usage.completion_tokens} tokens in {elapsed:.2f} s "
        f"({final.usage.completion_tokens / elapsed:.2f} tokens/s) | rounds {spec.rounds}, proposed {spec.proposed}, "
        f"accepted {spec.accepted} ({rate:.0%})]",
        file=sys.stderr,
    )
    return 0
