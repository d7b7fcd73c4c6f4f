"""`specdec bench peer`: llama.cpp's llama-server and `specdec serve` side by side, on the same prompts as the same
token ids, through one client.

Measured one after the other, at each concurrency c of `--concurrency`, greedy, every request exactly
`--max-new-tokens` long (ignore_eos on both sides):
- llama-server without a draft, and with its draft model (`--spec-type draft-simple`) once per `--draft-n-max`;
- with `--edit-prompts`: llama-server without a draft and with each n-gram type its binary lists, on the edit
  prompts, against ours off and with the config's model-free method (ngram, suffix, or hybrid's suffix part) where
  it has one, else with the config's own drafting;
- with `--sessions`: multi-turn conversations (benchmarks/sessions/), one request at a time, each turn sent with the
  whole conversation so far (the server's own answers, which end at eos), end to end over the turns after the first:
  llama-server without a draft and with each draft n-max and n-gram type (its prompt cache on, as by default), the
  best kept, against ours off and on (prefix caching as CONFIG says);
- CONFIG deployed in this process (`deployments.launch.serving`), each request with speculation off (k = 0, method
  none: no drafter sees it) and with the config's setting.

Fair by construction: both servers get the same body at their OpenAI-compatible `/v1/completions` over HTTP (the
chat-formatted prompt as token ids, `temperature: 0`, `max_tokens`, `ignore_eos`, no stream), differing only by the
fields that make each return its token ids and, ours, choose the speculation. c client threads share the prompts,
each sent once; tokens/s = the responses' `usage.completion_tokens` over the wall time of the whole set. A
llama-server runs with `-np c`, so each setting and concurrency gets a server of its own; each of our runs has a
`cache_salt` of its own, so none finds another's prompts cached. Each server, and each of our runs, is warmed up with
one short request outside the timing. llama-server (peer_llama.py) and CONFIG take turns, never run together.

The report (`--json`) keeps every run: its command line (llama-server) or request fields (ours), figures, and each
prompt's generated ids and text; whether our speculative outputs equal our plain ones token for token (they must),
and on how many prompts each llama-server setting equals its own plain output at the same concurrency.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec_core.errors import InvalidArgument
from specdec_tools.bench import peer_llama as llama
from specdec_tools.bench.peer_client import (
    Completion,
    Conversation,
    Endpoint,
    complete,
    model_id,
    run_sessions,
    run_set,
)
from specdec_tools.bench.peer_report import (
    EDIT,
    LLAMA,
    ON,
    PLAIN,
    PROMPTS,
    SESSIONS,
    SPECDEC,
    SPECULATIVE,
    Run,
    build_report,
    format_table,
)
from specdec_tools.loadgen.command import positive

log = logging.getLogger(__name__)

OFF_FIELDS = {"num_speculative_tokens": 0, "speculation_method": "none"}
WARMUP_TEXT, WARMUP_TOKENS = "Say hello.", 8
READY_TIMEOUT_S = 300.0


def positive_ints(text: str) -> tuple[int, ...]:
    """`1,4` -> (1, 4): comma-separated positive integers, in order, each once."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return tuple(dict.fromkeys(values))


def register(modes: Any) -> None:
    parser = modes.add_parser(
        "peer",
        help="llama-server (no draft, its draft model, its n-gram types) against `specdec serve` of CONFIG, "
        "side by side over one HTTP client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--llama-server", required=True, type=Path, metavar="PATH", help="the llama-server binary")
    parser.add_argument(
        "--target-gguf", required=True, type=Path, metavar="FILE", help="the target model, as CONFIG's, in GGUF"
    )
    parser.add_argument(
        "--draft-gguf", required=True, type=Path, metavar="FILE", help="the draft model, as CONFIG's, in GGUF"
    )
    parser.add_argument(
        "--config", required=True, type=Path, metavar="CONFIG.yaml", help="the serving config to deploy (our side)"
    )
    parser.add_argument(
        "--prompts", required=True, type=Path, metavar="FILE", help='JSONL, one {"prompt": "..."} per line'
    )
    parser.add_argument(
        "--edit-prompts",
        type=Path,
        metavar="FILE",
        help="JSONL of prompts that repeat their input: the n-gram comparison",
    )
    parser.add_argument(
        "--sessions",
        type=Path,
        metavar="FILE",
        help="JSONL of multi-turn conversations (benchmarks/sessions/): end to end over turns >= 2, one at a time",
    )
    parser.add_argument(
        "--num-sessions", type=positive(int), metavar="N", help="only the first N conversations of --sessions"
    )
    parser.add_argument(
        "--max-new-tokens", type=positive(int), default=128, metavar="N", help="every request's exact length"
    )
    parser.add_argument(
        "--concurrency", type=positive_ints, default="1,4", metavar="C,...", help="client threads, comma-separated"
    )
    parser.add_argument(
        "--draft-n-max",
        type=positive_ints,
        default="3,5,8,12",
        metavar="N,...",
        help="llama-server's --spec-draft-n-max sweep",
    )
    parser.add_argument(
        "--threads",
        type=positive(int),
        default=os.cpu_count() or 1,
        metavar="N",
        help="llama-server's -t (default: all CPUs)",
    )
    parser.add_argument("--json", required=True, type=Path, metavar="OUT.json", help="where to write the report")
    parser.set_defaults(func=_main)


@dataclass(frozen=True)
class PeerBenchConfig:
    llama: llama.LlamaSetup
    config: Path
    prompts: Path
    edit_prompts: Path | None
    max_new_tokens: int
    concurrency: tuple[int, ...]
    draft_n_max: tuple[int, ...]
    sessions: Path | None = None
    num_sessions: int | None = None


def _main(args: argparse.Namespace) -> int:
    from specdec_tools.reports import write_report

    files = {"--llama-server": args.llama_server, "--target-gguf": args.target_gguf, "--draft-gguf": args.draft_gguf}
    for flag, path in files.items():
        if not path.is_file():
            raise InvalidArgument(flag, f"{str(path)!r} is not a file")
    bench = PeerBenchConfig(
        llama=llama.LlamaSetup(args.llama_server, args.target_gguf, args.draft_gguf, args.threads),
        config=args.config,
        prompts=args.prompts,
        edit_prompts=args.edit_prompts,
        max_new_tokens=args.max_new_tokens,
        concurrency=args.concurrency,
        draft_n_max=args.draft_n_max,
        sessions=args.sessions,
        num_sessions=args.num_sessions,
    )
    report = run_peer_bench(bench)
    write_report(report, args.json)
    print(format_table(report))
    return 0


# -- runs ------------------------------------------------------------------------------------------------------------


def model_free_method(draft: Any) -> str | None:
    """A config's drafting method without a model (`draft`: its DraftConfig): its own (ngram, suffix), a hybrid's
    free part, else None."""
    method = draft.drafting
    if method is None:
        return None
    return method.free_part if method.runs_draft_model else method.name


def run_peer_bench(bench: PeerBenchConfig) -> dict[str, Any]:
    from deployments.serve_config import load_config
    from specdec_core.chat import ChatMessage, encode_chat
    from specdec_core.models.loader import load_tokenizer
    from specdec_tools.requests import read_prompt_texts, read_sessions

    config = load_config(bench.config)
    tokenizer = load_tokenizer(config.target.model).tokenizer

    def encode(texts: Sequence[str]) -> list[list[int]]:
        return [encode_chat(tokenizer, [ChatMessage("user", text)]) for text in texts]

    def retokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def encode_conversation(conversation: Conversation) -> list[int]:
        return encode_chat(tokenizer, [ChatMessage(role, content) for role, content in conversation])

    workloads = {PROMPTS: encode(read_prompt_texts(bench.prompts))}
    if bench.edit_prompts is not None:
        workloads[EDIT] = encode(read_prompt_texts(bench.edit_prompts, "--edit-prompts"))
    sessions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if bench.sessions is not None:
        sessions = tuple((s.system, s.turns) for s in read_sessions(bench.sessions)[: bench.num_sessions])
        workloads[SESSIONS] = [
            encode_conversation([("system", system), ("user", turns[0])]) for system, turns in sessions
        ]
    work = _Work(bench, workloads, encode([WARMUP_TEXT])[0], retokenize, sessions, encode_conversation)
    notes: list[str] = []
    version = llama.binary_output(bench.llama.binary, "--version")
    ngram = llama.ngram_types(llama.binary_output(bench.llama.binary, "--help"))
    if EDIT in workloads and not ngram:
        notes.append("llama-server: its --help lists no n-gram --spec-type; its n-gram runs were skipped")
    runs = llama_runs(work, llama_plan(workloads, bench.draft_n_max, ngram))
    runs += specdec_runs(work, config, notes)
    return build_report(bench, config.model_dump(mode="json"), version, workloads, runs, notes)


@dataclass(frozen=True)
class _Work:
    bench: PeerBenchConfig
    workloads: Mapping[str, list[list[int]]]
    warmup: list[int]
    retokenize: Callable[[str], list[int]]
    sessions: Sequence[tuple[str, Sequence[str]]] = ()
    encode_conversation: Callable[[Conversation], list[int]] | None = None

    def concurrency(self, workload: str) -> tuple[int, ...]:
        """A conversation's turns go one after another: the sessions run at c = 1 alone."""
        return (1,) if workload == SESSIONS else self.bench.concurrency

    def measure(self, endpoint: Endpoint, workload: str, concurrency: int) -> tuple[float, tuple[Completion, ...]]:
        complete(endpoint, self.warmup, WARMUP_TOKENS)
        if workload == SESSIONS:
            assert self.encode_conversation is not None  # set with the sessions
            tokens = self.bench.max_new_tokens
            return run_sessions(endpoint, self.sessions, tokens, self.encode_conversation, self.retokenize)
        prompts = self.workloads[workload]
        return run_set(endpoint, prompts, self.bench.max_new_tokens, concurrency, self.retokenize)


def llama_plan(
    workloads: Mapping[str, Any], n_maxes: Sequence[int], ngram: Sequence[str]
) -> list[tuple[str, str, llama.LlamaSpeculation]]:
    """(workload, role, setting) of every llama-server run but for the concurrency."""
    plan = [(PROMPTS, PLAIN, llama.LlamaSpeculation())]
    plan += [(PROMPTS, SPECULATIVE, s) for s in llama.draft_sweep(n_maxes)]
    if EDIT in workloads:
        plan.append((EDIT, PLAIN, llama.LlamaSpeculation()))
        plan += [(EDIT, SPECULATIVE, llama.LlamaSpeculation(t)) for t in ngram]
    if SESSIONS in workloads:  # its best of either kind, its prompt cache on (its default)
        plan.append((SESSIONS, PLAIN, llama.LlamaSpeculation()))
        plan += [(SESSIONS, SPECULATIVE, s) for s in llama.draft_sweep(n_maxes)]
        plan += [(SESSIONS, SPECULATIVE, llama.LlamaSpeculation(t)) for t in ngram]
    return plan


def llama_runs(work: _Work, plan: Sequence[tuple[str, str, llama.LlamaSpeculation]]) -> list[Run]:
    """Each planned setting at each concurrency on a server of its own; a server that fails is a run with its
    error, and the others go on."""
    from deployments.ports import free_port

    runs = []
    for workload, role, speculation in plan:
        for c in work.concurrency(workload):
            port = free_port()
            command = tuple(llama.server_command(work.bench.llama, speculation, port, c))
            run = Run(LLAMA, workload, role, speculation.name, c, command=command)
            try:
                with llama.llama_server(command, port) as url:
                    endpoint = Endpoint(url, model_id(url, {}), extras=llama.BODY_EXTRAS)
                    seconds, completions = work.measure(endpoint, workload, c)
                run = Run(LLAMA, workload, role, speculation.name, c, seconds, completions, command)
            except (RuntimeError, OSError, ValueError, KeyError) as exc:  # one setting fails, not the run
                log.error("llama-server %s, c=%d: %s", speculation.name, c, exc)
                run = Run(LLAMA, workload, role, speculation.name, c, command=command, error=str(exc))
            _log_run(run)
            runs.append(run)
    return runs


def specdec_runs(work: _Work, config: Any, notes: list[str]) -> list[Run]:
    """CONFIG deployed once; per workload and concurrency, off and on, their order alternating by concurrency."""
    from deployments.auth import load_public_token
    from deployments.launch import serving

    modes: dict[str, tuple[str, dict[str, Any]]] = {PROMPTS: (ON, {})}
    free = model_free_method(config.draft)
    if EDIT in work.workloads:
        # Edits: the config's model-free method where it has one (llama-server's side is its n-gram types), else
        # the config's own drafting.
        modes[EDIT] = (free, {"speculation_method": free}) if free is not None else (ON, {})
    if SESSIONS in work.workloads:
        modes[SESSIONS] = (ON, {})
    token = load_public_token(config.auth_token_file) if config.auth == "bearer" else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = f"http://127.0.0.1:{config.http_port}"
    runs = []
    with serving(config, quiet=True):
        _wait_ready(base)
        model = model_id(base, headers)
        for workload, (setting, fields) in modes.items():
            for i, c in enumerate(work.concurrency(workload)):
                pair = [(PLAIN, "off", OFF_FIELDS), (SPECULATIVE, setting, fields)]
                for role, name, request_fields in pair if i % 2 == 0 else pair[::-1]:
                    salt = f"peer-{workload}-{name}-c{c}".replace(" ", "-")
                    extras = {"return_token_ids": True, "cache_salt": salt, **request_fields}
                    seconds, completions = work.measure(Endpoint(base, model, headers, extras), workload, c)
                    run = Run(SPECDEC, workload, role, name, c, seconds, completions, request_fields=request_fields)
                    _log_run(run)
                    runs.append(run)
    return runs


def _wait_ready(base_url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not llama.healthy(base_url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health did not answer 200 within {READY_TIMEOUT_S:.0f} s")
        time.sleep(1)


def _log_run(run: Run) -> None:
    log.info("%s %s, %s, c=%d: %.2f tok/s", run.system, run.setting, run.workload, run.concurrency, run.tokens_per_s)
