"""`specdec bench peer`: llama.cpp's llama-server and `specdec serve` side by side, on the same prompts as the same
token ids, through one client.

At each concurrency c of `--concurrency`, greedy, every request exactly `--max-new-tokens` long (ignore_eos on both
sides), on the workloads given:
- prompts: llama-server with its draft model (`--spec-type draft-simple`) once per `--draft-n-max`;
- with `--edit-prompts` (prompts that repeat their input): llama-server with each n-gram type its binary lists;
- with `--sessions`: multi-turn conversations (benchmarks/sessions/), one request at a time, each turn sent with the
  whole conversation so far (the server's own answers, which end at eos), end to end over the turns after the first:
  llama-server with each draft n-max and each n-gram type (its prompt cache on, as by default).

Two phases. The sweep runs each of llama-server's speculative settings alone, to find its best per workload and
concurrency. Then CONFIG is deployed in this process (`deployments.launch.serving`) and each pair is measured taking
turns: llama-server without a draft against ours with speculation off (k = 0, method none: no drafter sees it), and
llama-server's best setting against ours with the config's own drafting. The two servers of a pair are both up and
alternate chunk by chunk (c prompts, or one conversation), the server going first swapping at every chunk, so that
the machine's drift, which moves a small machine's speed by a tenth or more within minutes, falls on both alike. The
table and its ratios are the paired runs'.

Fair by construction: both servers get the same body at their OpenAI-compatible `/v1/completions` over HTTP (the
chat-formatted prompt as token ids, `temperature: 0`, `max_tokens`, `ignore_eos`, no stream), differing only by the
fields that make each return its token ids and, ours, choose the speculation. A chunk's c prompts go in at once from
c client threads; tokens/s = the responses' `usage.completion_tokens` over the summed wall times of the chunks. A
llama-server runs with `-np c`, so each setting and concurrency gets a server of its own; each of our runs has a
`cache_salt` of its own, so none finds another's prompts cached. Each server, and each of our runs, is warmed up with
one short request outside the timing.

The report (`--json`) keeps every run: its command line (llama-server) or request fields (ours), figures, and each
prompt's generated ids and text; whether our speculative outputs equal our plain ones token for token (they must),
and on how many prompts each llama-server setting equals its own plain output at the same concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from specdec_core.errors import InvalidArgument
from specdec_tools.bench import peer_llama as llama
from specdec_tools.bench.options import comma_ints
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
    best_run,
    build_report,
    format_table,
)
from specdec_tools.loadgen.command import positive

log = logging.getLogger(__name__)
T = TypeVar("T")

OFF_FIELDS = {"num_speculative_tokens": 0, "speculation_method": "none"}
WARMUP_TEXT, WARMUP_TOKENS = "Say hello.", 8
READY_TIMEOUT_S = 300.0


positive_ints = comma_ints(1, "positive integers")


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
        "--draft-gguf",
        required=True,
        type=Path,
        action="append",
        metavar="FILE",
        help="the draft model, as CONFIG's, in GGUF; repeat the flag to sweep several (say Q8_0 and Q4_0)",
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

    files = [("--llama-server", args.llama_server), ("--target-gguf", args.target_gguf)]
    files += [("--draft-gguf", path) for path in args.draft_gguf]
    for flag, path in files:
        if not path.is_file():
            raise InvalidArgument(flag, f"{str(path)!r} is not a file")
    bench = PeerBenchConfig(
        llama=llama.LlamaSetup(args.llama_server, args.target_gguf, tuple(args.draft_gguf), args.threads),
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
    plan = llama_plan(workloads, bench.draft_n_max, ngram, bench.llama.draft_ggufs)
    runs = llama_runs(work, plan)
    runs += paired_runs(work, config, runs, {s.name: s for _, s in plan}, notes)
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

    def warm_up(self, endpoint: Endpoint) -> None:
        complete(endpoint, self.warmup, WARMUP_TOKENS)

    def chunks(self, workload: str, concurrency: int) -> list[Chunk]:
        """The workload as the pieces two servers take turns on: `concurrency` prompts sent at once, or one whole
        conversation."""
        tokens, retokenize = self.bench.max_new_tokens, self.retokenize
        if workload == SESSIONS:
            encode = self.encode_conversation
            assert encode is not None  # set with the sessions
            return [partial(_session_chunk, [one], tokens, encode, retokenize) for one in self.sessions]
        prompts = self.workloads[workload]
        return [
            partial(_prompt_chunk, prompts[i : i + concurrency], tokens, concurrency, retokenize)
            for i in range(0, len(prompts), concurrency)
        ]

    def measure(self, endpoint: Endpoint, workload: str, concurrency: int) -> tuple[float, tuple[Completion, ...]]:
        """The whole workload on one server, chunk after chunk."""
        self.warm_up(endpoint)
        return _sum(chunk(endpoint) for chunk in self.chunks(workload, concurrency))


Measured = tuple[float, tuple[Completion, ...]]  # seconds, completions
Chunk = Callable[[Endpoint], Measured]


def _prompt_chunk(prompts: Any, tokens: int, concurrency: int, retokenize: Any, endpoint: Endpoint) -> Measured:
    return run_set(endpoint, prompts, tokens, concurrency, retokenize)


def _session_chunk(sessions: Any, tokens: int, encode: Any, retokenize: Any, endpoint: Endpoint) -> Measured:
    return run_sessions(endpoint, sessions, tokens, encode, retokenize)


def _sum(measured: Iterable[Measured]) -> Measured:
    seconds, completions = 0.0, list[Completion]()
    for s, done in measured:
        seconds += s
        completions += done
    return seconds, tuple(completions)


def llama_plan(
    workloads: Mapping[str, Any], n_maxes: Sequence[int], ngram: Sequence[str], drafts: Sequence[Path]
) -> list[tuple[str, llama.LlamaSpeculation]]:
    """(workload, setting) of every llama-server sweep run but for the concurrency: its speculative settings (its
    plain runs are measured paired with ours)."""
    plan = [(PROMPTS, s) for s in llama.draft_sweep(n_maxes, drafts)]
    if EDIT in workloads:
        plan += [(EDIT, llama.LlamaSpeculation(t)) for t in ngram]
    if SESSIONS in workloads:  # its best of either kind, its prompt cache on (its default)
        plan += [(SESSIONS, s) for s in llama.draft_sweep(n_maxes, drafts)]
        plan += [(SESSIONS, llama.LlamaSpeculation(t)) for t in ngram]
    return plan


def llama_runs(work: _Work, plan: Sequence[tuple[str, llama.LlamaSpeculation]]) -> list[Run]:
    """The sweep: each planned setting at each concurrency on a server of its own, alone; a server that fails is a
    run with its error, and the others go on."""
    runs = []
    for workload, speculation in plan:
        for c in work.concurrency(workload):
            try:
                with _llama(work, speculation, c) as (command, endpoint):
                    seconds, completions = _theirs(command, work.measure, endpoint, workload, c)
                run = Run(LLAMA, workload, SPECULATIVE, speculation.name, c, seconds, completions, command)
            except _LlamaFailed as failed:  # one setting fails, not the run
                run = Run(LLAMA, workload, SPECULATIVE, speculation.name, c, command=failed.command, error=failed.why)
            _log_run(run)
            runs.append(run)
    return runs


class _LlamaFailed(Exception):
    """llama-server did not start, or failed a request: that setting's run fails, the benchmark goes on."""

    def __init__(self, command: tuple[str, ...], why: str) -> None:
        super().__init__(why)
        self.command, self.why = command, why


LLAMA_ERRORS = (RuntimeError, OSError, ValueError, KeyError)


@contextlib.contextmanager
def _llama(work: _Work, speculation: llama.LlamaSpeculation, c: int) -> Iterator[tuple[tuple[str, ...], Endpoint]]:
    """A llama-server of `speculation` with c slots, as the client reaches it; a failed start as _LlamaFailed."""
    from deployments.ports import free_port

    port = free_port()
    command = tuple(llama.server_command(work.bench.llama, speculation, port, c))
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(llama.llama_server(command, port))
            endpoint = Endpoint(url, model_id(url, {}), extras=llama.BODY_EXTRAS)
        except LLAMA_ERRORS as exc:
            log.error("llama-server %s, c=%d: %s", speculation.name, c, exc)
            raise _LlamaFailed(command, str(exc)) from exc
        yield command, endpoint


def _theirs(command: tuple[str, ...], call: Callable[..., T], *args: Any) -> T:
    """`call(*args)` against llama-server; its failures as _LlamaFailed."""
    try:
        return call(*args)
    except LLAMA_ERRORS as exc:
        log.error("llama-server %s: %s", " ".join(command), exc)
        raise _LlamaFailed(command, str(exc)) from exc


def paired_runs(
    work: _Work, config: Any, sweep: Sequence[Run], settings: Mapping[str, llama.LlamaSpeculation], notes: list[str]
) -> list[Run]:
    """CONFIG deployed once; per workload and concurrency, ours off taking turns with llama-server without a draft,
    and ours on with llama-server's best setting of the sweep."""
    from deployments.auth import load_public_token
    from deployments.launch import serving

    token = load_public_token(config.auth_token_file) if config.auth == "bearer" else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = f"http://127.0.0.1:{config.http_port}"
    runs: list[Run] = []
    with serving(config, quiet=True):
        _wait_ready(base)
        model = model_id(base, headers)
        for workload in work.workloads:
            for c in work.concurrency(workload):
                best = best_run(sweep, workload, LLAMA, SPECULATIVE, c)
                if best is None:
                    notes.append(f"llama-server: no speculative setting ran on {workload} at c={c}; ours on alone")
                theirs = {PLAIN: llama.LlamaSpeculation(), SPECULATIVE: settings[best.setting] if best else None}
                for role, (name, fields) in {PLAIN: ("off", OFF_FIELDS), SPECULATIVE: (ON, {})}.items():
                    salt = f"peer-{workload}-{name}-c{c}".replace(" ", "-")
                    extras = {"return_token_ids": True, "cache_salt": salt, **fields}
                    ours = Endpoint(base, model, headers, extras)
                    runs += _pair(work, workload, role, c, (name, fields, ours), theirs[role])
    return runs


def _pair(
    work: _Work,
    workload: str,
    role: str,
    c: int,
    ours: tuple[str, Mapping[str, Any], Endpoint],
    theirs: llama.LlamaSpeculation | None,
) -> list[Run]:
    """Our run and llama-server's of one role, taking turns chunk by chunk (ours alone where llama-server has no
    setting or fails to start)."""
    name, fields, endpoint = ours

    def our_run(measured: Measured, paired: bool) -> Run:
        return Run(SPECDEC, workload, role, name, c, *measured, request_fields=fields, paired=paired)

    if theirs is None:
        return [_logged(our_run(work.measure(endpoint, workload, c), False))]
    try:
        with _llama(work, theirs, c) as (command, their_endpoint):
            work.warm_up(endpoint)
            _theirs(command, work.warm_up, their_endpoint)
            mine, other = take_turns(
                work.chunks(workload, c),
                lambda chunk: chunk(endpoint),
                lambda chunk: _theirs(command, chunk, their_endpoint),
            )
    except _LlamaFailed as failed:
        run = Run(LLAMA, workload, role, theirs.name, c, command=failed.command, error=failed.why, paired=True)
        # A salt of its own: none of this run's prompts is cached from the pairing that failed.
        alone = dataclasses.replace(endpoint, extras={**endpoint.extras, "cache_salt": f"{name}-alone-{workload}"})
        return [_logged(run), _logged(our_run(work.measure(alone, workload, c), False))]
    run = Run(LLAMA, workload, role, theirs.name, c, *other, command, paired=True)
    return [_logged(run), _logged(our_run(mine, True))]


def take_turns(
    chunks: Sequence[Chunk], first: Callable[[Chunk], Measured], second: Callable[[Chunk], Measured]
) -> tuple[Measured, Measured]:
    """Each chunk on both sides, `first` going first on even chunks and `second` on odd ones; each side's summed
    seconds and its completions in chunk order."""
    done: tuple[list[Measured], list[Measured]] = ([], [])
    for i, chunk in enumerate(chunks):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            done[side].append((first, second)[side](chunk))
    return _sum(done[0]), _sum(done[1])


def _wait_ready(base_url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not llama.healthy(base_url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url}/health did not answer 200 within {READY_TIMEOUT_S:.0f} s")
        time.sleep(1)


def _log_run(run: Run) -> None:
    log.info("%s %s, %s, c=%d: %.2f tok/s", run.system, run.setting, run.workload, run.concurrency, run.tokens_per_s)


def _logged(run: Run) -> Run:
    _log_run(run)
    return run
