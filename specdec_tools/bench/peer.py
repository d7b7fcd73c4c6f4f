"""`specdec bench peer`: llama.cpp's llama-server and `specdec serve` side by side, on the same prompts as the same
token ids, through one client.

Measured one after the other, at each concurrency c of `--concurrency`, greedy, every request exactly
`--max-new-tokens` long (ignore_eos on both sides):
- llama-server without a draft, and with its draft model (`--spec-type draft-simple`) once per `--draft-n-max`;
- with `--edit-prompts`: llama-server without a draft and with each n-gram type its binary lists, on the edit
  prompts, against ours off and with the config's model-free method (ngram, suffix, or hybrid's suffix part) where
  it has one, else with the config's own drafting;
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
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_core.errors import InvalidArgument
from specdec_tools.bench import peer_llama as llama
from specdec_tools.loadgen.command import positive

log = logging.getLogger(__name__)

LLAMA, SPECDEC = "llama-server", "specdec serve"
PROMPTS, EDIT = "prompts", "edit prompts"
PLAIN, SPECULATIVE = "plain", "speculative"
ON = "on"  # our speculative setting on the prompts: the config's
OFF_FIELDS = {"num_speculative_tokens": 0, "speculation_method": "none"}
WARMUP_TEXT, WARMUP_TOKENS = "Say hello.", 8
REQUEST_TIMEOUT_S = 3600.0
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
    )
    report = run_peer_bench(bench)
    write_report(report, args.json)
    print(format_table(report))
    return 0


# -- the client ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    text: str
    completion_tokens: int  # as the server's usage counts them
    drafted: int  # draft tokens proposed (ours: `speculation.proposed`; llama-server: `timings.draft_n`)
    accepted: int
    ids_from: str  # "server", or "text" where the server returned no ids and the text was re-tokenized


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server as the client drives it. `extras`: the fields only this server's requests carry
    (those that return the token ids; ours, the speculation setting and cache salt)."""

    base_url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)


def completion_body(endpoint: Endpoint, prompt_ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """The one request body both servers get, but for `endpoint.extras`."""
    return {
        "model": endpoint.model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        **endpoint.extras,
    }


def _http(url: str, headers: Mapping[str, str], body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code} {exc.read().decode(errors='replace')[:500]}") from None


def model_id(base_url: str, headers: Mapping[str, str]) -> str:
    """The served model's id (GET /v1/models): what each server wants as `model`."""
    return str(_http(f"{base_url}/v1/models", headers)["data"][0]["id"])


def parse_completion(response: Mapping[str, Any], retokenize: Callable[[str], list[int]]) -> Completion:
    """A completions answer: ids as ours (`token_ids`) or llama-server (`__verbose.tokens`) return them, else
    `retokenize` of the text; speculation counts as ours (`speculation`) or llama-server (`timings`) give them."""
    choice = response["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        ids = llama.token_ids(dict(response))
    ids_from = "server" if ids is not None else "text"
    if ids is None:
        ids = retokenize(choice["text"])
    ours, theirs = response.get("speculation") or {}, response.get("timings") or {}
    return Completion(
        token_ids=tuple(ids),
        text=choice["text"],
        completion_tokens=int(response["usage"]["completion_tokens"]),
        drafted=int(ours.get("proposed", theirs.get("draft_n", 0))),
        accepted=int(ours.get("accepted", theirs.get("draft_n_accepted", 0))),
        ids_from=ids_from,
    )


def complete(endpoint: Endpoint, prompt_ids: Sequence[int], max_tokens: int) -> dict[str, Any]:
    return _http(
        f"{endpoint.base_url}/v1/completions", endpoint.headers, completion_body(endpoint, prompt_ids, max_tokens)
    )


def run_set(
    endpoint: Endpoint,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    concurrency: int,
    retokenize: Callable[[str], list[int]],
) -> tuple[float, tuple[Completion, ...]]:
    """Every prompt once, `concurrency` at a time (client threads): the wall time of the whole set, and the
    completions in prompt order."""

    def one(prompt_ids: Sequence[int]) -> Completion:
        return parse_completion(complete(endpoint, prompt_ids, max_tokens), retokenize)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        start = time.perf_counter()
        completions = tuple(pool.map(one, prompts))
        seconds = time.perf_counter() - start
    return seconds, completions


# -- runs ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One setting of one server over one workload at one concurrency."""

    system: str  # LLAMA or SPECDEC
    workload: str  # PROMPTS or EDIT
    role: str  # PLAIN or SPECULATIVE
    setting: str  # llama-server's ("draft-simple n-max 5", "ngram-mod"); ours "off", "on" or the method
    concurrency: int
    seconds: float = 0.0
    completions: tuple[Completion, ...] = ()
    command: tuple[str, ...] = ()  # llama-server's command line
    request_fields: Mapping[str, Any] = field(default_factory=dict)  # ours: what the requests add to the body
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


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
    from specdec_tools.requests import read_prompt_texts

    config = load_config(bench.config)
    tokenizer = load_tokenizer(config.target.model).tokenizer

    def encode(texts: Sequence[str]) -> list[list[int]]:
        return [encode_chat(tokenizer, [ChatMessage("user", text)]) for text in texts]

    def retokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    workloads = {PROMPTS: encode(read_prompt_texts(bench.prompts))}
    if bench.edit_prompts is not None:
        workloads[EDIT] = encode(read_prompt_texts(bench.edit_prompts, "--edit-prompts"))
    work = _Work(bench, workloads, encode([WARMUP_TEXT])[0], retokenize)
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

    def measure(self, endpoint: Endpoint, workload: str, concurrency: int) -> tuple[float, tuple[Completion, ...]]:
        complete(endpoint, self.warmup, WARMUP_TOKENS)
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
    return plan


def llama_runs(work: _Work, plan: Sequence[tuple[str, str, llama.LlamaSpeculation]]) -> list[Run]:
    """Each planned setting at each concurrency on a server of its own; a server that fails is a run with its
    error, and the others go on."""
    from deployments.ports import free_port

    runs = []
    for workload, role, speculation in plan:
        for c in work.bench.concurrency:
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
    token = load_public_token(config.auth_token_file) if config.auth == "bearer" else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = f"http://127.0.0.1:{config.http_port}"
    runs = []
    with serving(config, quiet=True):
        _wait_ready(base)
        model = model_id(base, headers)
        for workload, (setting, fields) in modes.items():
            for i, c in enumerate(work.bench.concurrency):
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


# -- the report ------------------------------------------------------------------------------------------------------

LABELS = {
    (PROMPTS, LLAMA, PLAIN): "llama-server, no draft",
    (PROMPTS, LLAMA, SPECULATIVE): "llama-server, draft-simple (best n-max)",
    (PROMPTS, SPECDEC, PLAIN): "specdec serve, off",
    (PROMPTS, SPECDEC, SPECULATIVE): "specdec serve, on",
    (EDIT, LLAMA, PLAIN): "llama-server, no draft",
    (EDIT, LLAMA, SPECULATIVE): "llama-server, n-gram (best type)",
    (EDIT, SPECDEC, PLAIN): "specdec serve, off",
    (EDIT, SPECDEC, SPECULATIVE): "specdec serve, model-free method",
}
RATIOS = {
    SPECULATIVE: "specdec on / llama-server best speculative",
    PLAIN: "specdec off / llama-server no draft",
}


def best_run(runs: Sequence[Run], workload: str, system: str, role: str, concurrency: int) -> Run | None:
    """The fastest of the runs that match (those that failed left out); None if none."""
    matching = [
        r
        for r in runs
        if (r.workload, r.system, r.role, r.concurrency) == (workload, system, role, concurrency) and not r.error
    ]
    return max(matching, key=lambda r: r.tokens_per_s, default=None)


def plain_of(runs: Sequence[Run], run: Run) -> Run | None:
    """The plain run `run` is compared with: its server's, on its workload, at its concurrency."""
    return best_run(runs, run.workload, run.system, PLAIN, run.concurrency)


def identical_count(run: Run, plain: Run) -> int:
    """On how many prompts `run` generated exactly the ids `plain` did."""
    return sum(a.token_ids == b.token_ids for a, b in zip(run.completions, plain.completions, strict=True))


def table(runs: Sequence[Run], workloads: Sequence[str], concurrency: Sequence[int]) -> list[dict[str, Any]]:
    """A row per (workload, configuration): each concurrency's tokens/s and the setting that gave it (the best of a
    sweep); None where no run succeeded."""
    rows = []
    for (workload, system, role), label in LABELS.items():
        if workload not in workloads:
            continue
        cells: dict[str, Any] = {}
        for c in concurrency:
            run = best_run(runs, workload, system, role, c)
            cells[str(c)] = None if run is None else {"tokens_per_s": run.tokens_per_s, "setting": run.setting}
        rows.append({"workload": workload, "configuration": label, "cells": cells})
    return rows


def ratios(runs: Sequence[Run], workloads: Sequence[str], concurrency: Sequence[int]) -> list[dict[str, Any]]:
    """Ours over llama-server's best, speculative and plain, per workload and concurrency (None: a side missing)."""
    rows = []
    for workload in workloads:
        for role, label in RATIOS.items():
            values: dict[str, float | None] = {}
            for c in concurrency:
                ours, theirs = (best_run(runs, workload, s, role, c) for s in (SPECDEC, LLAMA))
                values[str(c)] = _ratio(ours, theirs)
            rows.append({"workload": workload, "ratio": label, "values": values})
    return rows


def _ratio(ours: Run | None, theirs: Run | None) -> float | None:
    if ours is None or theirs is None or theirs.tokens_per_s <= 0:
        return None
    return ours.tokens_per_s / theirs.tokens_per_s


def equality(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Each speculative run's prompts that equal its server's plain output, token for token."""
    rows = []
    for run in runs:
        plain = plain_of(runs, run)
        if run.role != SPECULATIVE or run.error or plain is None:
            continue
        rows.append(
            {
                "system": run.system,
                "workload": run.workload,
                "setting": run.setting,
                "concurrency": run.concurrency,
                "identical": identical_count(run, plain),
                "prompts": len(run.completions),
            }
        )
    return rows


def _all_identical(rows: Sequence[Mapping[str, Any]]) -> bool | None:
    """Every prompt of every row identical; None where there is no row (nothing was compared)."""
    return all(r["identical"] == r["prompts"] for r in rows) if rows else None


def run_record(run: Run) -> dict[str, Any]:
    return {
        "system": run.system,
        "workload": run.workload,
        "role": run.role,
        "setting": run.setting,
        "concurrency": run.concurrency,
        "command": list(run.command) or None,
        "request_fields": dict(run.request_fields) or None,
        "error": run.error or None,
        "seconds": run.seconds,
        "completion_tokens": run.tokens,
        "tokens_per_s": run.tokens_per_s,
        "drafted": sum(c.drafted for c in run.completions),
        "accepted": sum(c.accepted for c in run.completions),
        "token_ids_from": sorted({c.ids_from for c in run.completions}),
        "outputs": [{"token_ids": list(c.token_ids), "text": c.text} for c in run.completions],
    }


def build_report(
    bench: PeerBenchConfig,
    config: dict[str, Any],
    version: str,
    workloads: Mapping[str, list[list[int]]],
    runs: Sequence[Run],
    notes: Sequence[str],
) -> dict[str, Any]:
    names = list(workloads)
    same = equality(runs)
    files = {PROMPTS: bench.prompts, EDIT: bench.edit_prompts}
    return {
        "llama_cpp_version": version,
        "llama_server": str(bench.llama.binary),
        "target_gguf": str(bench.llama.target_gguf),
        "draft_gguf": str(bench.llama.draft_gguf),
        "threads": bench.llama.threads,
        "config_path": str(bench.config),
        "config": config,
        "max_new_tokens": bench.max_new_tokens,
        "concurrency": list(bench.concurrency),
        "draft_n_max": list(bench.draft_n_max),
        "workloads": {w: {"file": str(files[w]), "prompt_token_ids": ids} for w, ids in workloads.items()},
        "table": table(runs, names, bench.concurrency),
        "ratios": ratios(runs, names, bench.concurrency),
        "specdec_identical_to_plain": _all_identical([e for e in same if e["system"] == SPECDEC]),
        "identical_to_plain": same,
        "notes": list(notes),
        "runs": [run_record(r) for r in runs],
    }


def format_table(report: Mapping[str, Any]) -> str:
    """The report's table, its ratios and the equality counts, as printed."""
    columns = [str(c) for c in report["concurrency"]]
    lines = [f"{'configuration':<44}" + "".join(f"{'tok/s c=' + c:>30}" for c in columns)]
    for workload in report["workloads"]:
        lines.append(f"-- {workload} --")
        for row in (r for r in report["table"] if r["workload"] == workload):
            lines.append(f"{row['configuration']:<44}" + "".join(_cell(row["cells"][c]) for c in columns))
        for row in (r for r in report["ratios"] if r["workload"] == workload):
            values = ("-" if row["values"][c] is None else f"{row['values'][c]:.2f}x" for c in columns)
            lines.append(f"{row['ratio']:<44}" + "".join(f"{v:>30}" for v in values))
    lines.append(f"specdec speculative == plain, token for token: {report['specdec_identical_to_plain']}")
    for e in (e for e in report["identical_to_plain"] if e["system"] == LLAMA):
        lines.append(
            f"llama-server {e['setting']} == its plain ({e['workload']}, c={e['concurrency']}): "
            f"{e['identical']}/{e['prompts']} prompts"
        )
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def _cell(cell: Mapping[str, Any] | None) -> str:
    if cell is None:
        return f"{'-':>30}"
    plain = cell["setting"] in (llama.NO_DRAFT, "off", ON)
    text = f"{cell['tokens_per_s']:.2f}" + ("" if plain else f" ({cell['setting']})")
    return f"{text:>30}"
