"""Pre-drafting served: plain, sequential and overlapped speculation through the OpenAI API, the draft and the
target pinned to cores of their own (standing in for devices of their own).

CONFIG is deployed once per mode, its workers pinned by `--target-cores` / `--draft-cores` (`cpu_affinity`):
- `draft.overlap: off`: sequential rounds, and plain decoding (requests with `num_speculative_tokens: 0`) on the
  same deployment, so plain runs on the target's cores alone;
- `draft.overlap: on`: every round pre-drafts;
- `draft.overlap: auto`: rounds pre-draft where they measure faster;
- `shared`: the config's own placement, both workers on every core, sequential rounds (`draft.overlap: off`): what
  a machine whose draft has no device of its own runs best, for comparison.
Deployments alternate mode by mode for `--rotations` rotations, and each mode's figures are summed over them: a small
machine's speed drifts within minutes, and taking turns puts the drift on every mode. Each mode sends the same
prompts as the same token ids (`/v1/completions`, greedy, `ignore_eos`, exactly `--max-new-tokens` tokens), at each
concurrency of `--concurrency`; with `--sessions`, the multi-turn conversations one request at a time, each turn with
the whole conversation so far, timed over the turns after the first. Every run has a cache salt of its own. Outputs
must equal plain decoding's token for token; the report says where they do.

    PYTHONPATH=.:proto python benchmarks/overlap/served.py deployments/configs/demo_cpu.yaml \\
        --target-cores 0 --draft-cores 1 --prompts benchmarks/prompts/code.jsonl \\
        --sessions benchmarks/sessions/coding.jsonl --num-sessions 3 --concurrency 1,4,8 --max-new-tokens 128 \\
        --json docs/bench/overlap_served.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deployments.launch import serving
from deployments.serve_config import ServeConfig, load_config
from specdec_core.chat import ChatMessage, encode_chat
from specdec_core.models.loader import load_tokenizer
from specdec_tools.bench.peer_client import Completion, Endpoint, complete, model_id, run_sessions, run_set
from specdec_tools.requests import read_prompt_texts, read_sessions

# Each deployment: draft.overlap with the workers pinned apart, or shared cores; plain decoding runs on "off".
MODES = ("off", "on", "auto", "shared")
SHARED = "shared"
PLAIN_FIELDS = {"num_speculative_tokens": 0, "speculation_method": "none"}
ROLES = {"off": "sequential", SHARED: "shared cores, sequential"}
READY_TIMEOUT_S = 900.0


def pinned(config: ServeConfig, overlap: str, target_cores: list[int], draft_cores: list[int]) -> ServeConfig:
    """`config` with its workers pinned apart and pre-drafting set to `overlap`; for `shared`, its own placement
    and sequential rounds."""
    if overlap == SHARED:
        return config.model_copy(update={"draft": config.draft.model_copy(update={"overlap": "off"})})
    target = config.target.model_copy(update={"cpu_affinity": target_cores})
    draft = config.draft.model_copy(update={"cpu_affinity": draft_cores, "overlap": overlap})
    return config.model_copy(update={"target": target, "draft": draft})


class Workloads:
    """The prompts and conversations as token ids, and how one endpoint runs each at a concurrency."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.tokenizer = load_tokenizer(model).tokenizer
        self.max_tokens = args.max_new_tokens
        self.prompts = [self._encode([("user", text)]) for text in read_prompt_texts(args.prompts)]
        self.sessions: list[tuple[str, tuple[str, ...]]] = []
        if args.sessions is not None:
            self.sessions = [(s.system, s.turns) for s in read_sessions(args.sessions)[: args.num_sessions]]
        self.concurrency = args.concurrency

    def _encode(self, conversation: Sequence[tuple[str, str]]) -> list[int]:
        return encode_chat(self.tokenizer, [ChatMessage(role, content) for role, content in conversation])

    def _retokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def runs(self) -> list[tuple[str, int]]:
        """(workload, concurrency) pairs: the prompts at each concurrency, the sessions at 1."""
        return [("prompts", c) for c in self.concurrency] + ([("sessions", 1)] if self.sessions else [])

    def run(self, endpoint: Endpoint, workload: str, c: int) -> tuple[float, tuple[Completion, ...]]:
        if workload == "sessions":
            return run_sessions(endpoint, self.sessions, self.max_tokens, self._encode, self._retokenize)
        return run_set(endpoint, self.prompts, self.max_tokens, c, self._retokenize)


def measure_mode(config: ServeConfig, work: Workloads, mode: str, rotation: int) -> list[dict[str, Any]]:
    """Deploy `config` and run every workload with its speculation (and, for the sequential deployment, plain)."""
    base = f"http://127.0.0.1:{config.http_port}"
    roles = [("plain", PLAIN_FIELDS)] if mode == "off" else []
    roles.append((ROLES.get(mode, f"overlap {mode}"), {}))
    results = []
    with serving(config, quiet=True):
        model = _wait_ready(base)
        for role, fields in roles:
            for workload, c in work.runs():
                salt = f"{role}-{workload}-c{c}-r{rotation}".replace(" ", "-")
                endpoint = Endpoint(base, model, {}, {"return_token_ids": True, "cache_salt": salt, **fields})
                complete(endpoint, work.prompts[0][:32], 8)  # warm-up, outside the timing
                seconds, completions = work.run(endpoint, workload, c)
                results.append(_result(role, workload, c, seconds, completions))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "token_ids"}), flush=True)
    return results


def _wait_ready(base: str) -> str:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            return model_id(base, {})
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def _result(role: str, workload: str, c: int, seconds: float, completions: Sequence[Completion]) -> dict[str, Any]:
    tokens = sum(x.completion_tokens for x in completions)
    return {
        "role": role,
        "workload": workload,
        "concurrency": c,
        "seconds": seconds,
        "tokens": tokens,
        "drafted": sum(x.drafted for x in completions),
        "accepted": sum(x.accepted for x in completions),
        "token_ids": [list(x.token_ids) for x in completions],
    }


def summarise(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and concurrency: each role's tokens/s over every rotation, the overlapped modes' ratios to
    sequential, and whether each role's outputs equal plain decoding's."""
    table = []
    keys = sorted({(r["workload"], r["concurrency"]) for r in results})
    for workload, c in keys:
        rows = [r for r in results if (r["workload"], r["concurrency"]) == (workload, c)]
        roles = list(dict.fromkeys(r["role"] for r in rows))
        rate = {role: _rate([r for r in rows if r["role"] == role]) for role in roles}
        plain = [r["token_ids"] for r in rows if r["role"] == "plain"]
        identical = {role: all(r["token_ids"] == plain[0] for r in rows if r["role"] == role) for role in roles}
        sequential = rate.get("sequential")
        table.append(
            {
                "workload": workload,
                "concurrency": c,
                "tokens_per_s": rate,
                "vs_sequential": {
                    role: rate[role] / sequential for role in roles if sequential and role != "sequential"
                },
                "identical_to_plain": identical if plain else None,
            }
        )
    return table


def _rate(rows: Sequence[dict[str, Any]]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def _cores(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--target-cores", type=_cores, required=True, help="e.g. 0 or 0,1")
    parser.add_argument("--draft-cores", type=_cores, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--sessions", type=Path)
    parser.add_argument("--num-sessions", type=int, default=3)
    parser.add_argument("--concurrency", type=_cores, default=[1, 4, 8], help="e.g. 1,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="of off,on,auto")
    parser.add_argument("--rotations", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, measure: Callable[..., list[dict[str, Any]]] = measure_mode) -> int:
    """`measure`: how one mode is deployed and run (`measure_mode`)."""
    args = parse_args(argv)
    if "off" not in args.modes or set(args.modes) - set(MODES):
        raise SystemExit(f"--modes: of {','.join(MODES)}, with off (sequential and plain) among them")
    config = load_config(args.config)
    work = Workloads(args, config.target.model)
    results = []
    for rotation in range(args.rotations):
        for mode in args.modes:
            results += measure(pinned(config, mode, args.target_cores, args.draft_cores), work, mode, rotation)
    report = {
        "config": str(args.config),
        "target_cores": args.target_cores,
        "draft_cores": args.draft_cores,
        "max_new_tokens": args.max_new_tokens,
        "modes": args.modes,
        "rotations": args.rotations,
        "table": summarise(results),
        "runs": results,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    for row in report["table"]:
        print(json.dumps({k: row[k] for k in ("workload", "concurrency", "tokens_per_s", "vs_sequential")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
