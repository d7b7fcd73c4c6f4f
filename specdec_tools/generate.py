"""`specdec generate [PROMPT]`: send one request to a running server over gRPC and print the completion.

A conversation: `--message ROLE:TEXT` (repeatable) or `--messages FILE.json`; a PROMPT given as well becomes the
last user turn. The server applies the model's chat template to it."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from specdec_core.environment import auth_token
from specdec_core.errors import InvalidArgument
from specdec_tools.requests import GRPC_OPTIONS, generate_request, parse_speculation, read_messages


def register(sub: Any) -> None:
    gen = sub.add_parser("generate", help="send one prompt to a running server and print the completion")
    gen.add_argument("prompt", nargs="?", help="the prompt text (the chat template is applied unless --raw)")
    gen.add_argument(
        "--message",
        action="append",
        default=[],
        type=_message,
        metavar="ROLE:TEXT",
        help="a turn of a conversation, e.g. system:'You are terse.' (repeatable, in order)",
    )
    gen.add_argument(
        "--messages", type=Path, default=None, help='a conversation as JSON: [{"role": "user", "content": "..."}, ...]'
    )
    gen.add_argument("--address", default="localhost:9000", help="HOST:PORT of the gRPC endpoint")
    gen.add_argument("--stream", action="store_true", help="print the text as it is committed")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--num-speculative-tokens", default=None, help="N (0 = off) or auto; default: the server's")
    gen.add_argument(
        "--speculation-method",
        default="",
        help="auto, none, or a method the server runs (draft_model, suffix, ngram); default: auto",
    )
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    gen.add_argument(
        "--auth-token",
        default=auth_token(),
        help="sent as `authorization: Bearer TOKEN` (default: $SPECDEC_AUTH_TOKEN)",
    )
    gen.set_defaults(func=main)


def _message(text: str) -> tuple[str, str]:
    role, sep, content = text.partition(":")
    if not sep or not role:
        raise argparse.ArgumentTypeError(f"expected ROLE:TEXT, e.g. user:hello, got {text!r}")
    return role.strip(), content


def build_request(args: argparse.Namespace) -> Any:
    messages = (read_messages(args.messages) if args.messages else []) + list(args.message)
    prompt = args.prompt
    if messages and prompt is not None:
        messages.append(("user", prompt))
        prompt = None
    if not messages and prompt is None:
        raise InvalidArgument("prompt", "give a PROMPT, --message or --messages")
    return generate_request(
        prompt,
        messages=messages,
        raw=args.raw,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        speculation=parse_speculation(args.num_speculative_tokens),
        speculation_method=args.speculation_method,
    )


def main(args: argparse.Namespace) -> int:
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
                final = None
                for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    final = chunk
                print()
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
