"""`specdec bench stack CONFIG.yaml`: speculation on vs off through the whole stack, side by side.

Serves CONFIG (local Ray, or $RAY_ADDRESS), then streams each prompt over gRPC through Serve's proxy, the router
and the workers, once with speculation off (k = 0) and once with the config's setting, alternating which goes
first. The workers' counters give the time they spent computing and the bytes they exchanged, so the rest of a
round's time is the router's and the RPCs' overhead. `--compare-offline` then runs `specdec bench offline` on the
same models and prompts in this process, to compare the served speedup with the in-process one.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import ray

from specdec.v1 import generation_pb2 as pb
from specdec.v1 import generation_pb2_grpc as pb_grpc
from specdec.v1 import worker_pb2 as wpb
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_tools.requests import generate_request


def register_stack(modes: Any) -> None:
    parser = modes.add_parser(
        "stack",
        help="serve CONFIG itself and compare speculation on vs off through it, one "
        "prompt at a time (gRPC, Ray Serve, worker counters)",
    )
    parser.add_argument("config", type=Path, help="the serving config to deploy")
    parser.add_argument("--prompts", required=True, type=Path, help='JSONL, one {"prompt": "..."} per line')
    parser.add_argument("--max-new-tokens", required=True, type=int)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    parser.add_argument(
        "--compare-offline",
        action="store_true",
        help="then run `specdec bench offline` on the same models and prompts, in this process",
    )
    parser.add_argument(
        "--compare-in-process",
        action="store_true",
        help="also decode each prompt plainly with the target loaded in this process, alternating with the served "
        "requests (the served path's cost, measured in the same minutes)",
    )
    parser.add_argument("--json", required=True, type=Path, help="where to write the report")
    parser.set_defaults(func=_main)


@dataclass
class Mode:
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    worker_seconds: float = 0.0
    wire_bytes: int = 0
    token_ids: list[list[int]] = field(default_factory=list)

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _main(args: argparse.Namespace) -> int:
    from specdec_tools.reports import write_report

    report = run_serve_bench(
        args.config,
        args.prompts,
        args.max_new_tokens,
        args.temperature,
        args.seed,
        args.compare_offline,
        args.compare_in_process,
    )
    write_report(report, args.json)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (list, dict))}, indent=2))
    return 0


def run_serve_bench(
    config_path: Path,
    prompts_path: Path,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    compare_offline: bool,
    compare_in_process: bool = False,
) -> dict[str, Any]:
    from deployments.launch import serving
    from deployments.serve_config import load_config
    from specdec_tools.requests import read_prompt_texts

    config = load_config(config_path)
    texts = read_prompt_texts(prompts_path)
    off, on, local = Mode(), Mode(), Mode()
    in_process = _InProcess(config, max_new_tokens) if compare_in_process else None
    with serving(config, quiet=True), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        workers = _worker_stubs(config)
        for mode_k in (0, None):  # warm-up: first-call costs stay out of the figures
            _stream(stub, _request(texts[0], 8, temperature, seed, mode_k))
        if in_process is not None:
            in_process.decode(texts[0], temperature, seed, Mode())
        for i, text in enumerate(texts):
            runs: list[tuple[int | None, Mode]] = [(0, off), (None, on)]
            if in_process is not None:
                runs.append((-1, local))  # -1: in this process
            for k, mode in runs[i % len(runs) :] + runs[: i % len(runs)]:  # rotated: drift falls on all alike
                if k == -1 and in_process is not None:
                    in_process.decode(text, temperature, seed + i, mode)
                    continue
                before = _counters(workers)
                _timed(stub, _request(text, max_new_tokens, temperature, seed + i, k), mode)
                busy, wire = (after - b for after, b in zip(_counters(workers), before))
                mode.worker_seconds += busy
                mode.wire_bytes += wire
    report = _report(config, texts, max_new_tokens, temperature, off, on)
    if in_process is not None:
        report.update(_in_process_report(off, local))
    if compare_offline:
        report.update(_offline(config, prompts_path, max_new_tokens, temperature, seed, report["stack_speedup"]))
    return report


def _request(text: str, max_tokens: int, temperature: float, seed: int, k: int | None) -> pb.GenerateRequest:
    return generate_request(text, temperature=temperature, max_tokens=max_tokens, seed=seed, speculation=k)


def _stream(stub: Any, request: pb.GenerateRequest) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(request, timeout=3600))


def _timed(stub: Any, request: pb.GenerateRequest, mode: Mode) -> None:
    start = time.perf_counter()
    chunks = _stream(stub, request)
    mode.seconds += time.perf_counter() - start
    ids = [t for c in chunks for t in c.token_ids]
    mode.token_ids.append(ids)
    mode.tokens += len(ids)
    stats = chunks[-1].speculation
    mode.rounds += stats.rounds
    mode.proposed += stats.proposed
    mode.accepted += stats.accepted


def _worker_stubs(config: Any) -> list[Any]:
    from deployments import worker_registry as registry
    from deployments.auth import dial
    from deployments.tls import Role

    reg = registry.registry()
    credentials = registry.credentials(config.app_name, Role.CLIENT)  # as a router gets them: GetStats wants them
    stubs = []
    kinds = [("target", wpb_grpc.TargetServiceStub)]
    if config.draft.runs_draft_model:
        kinds.append(("draft", wpb_grpc.DraftServiceStub))
    for kind, stub_type in kinds:
        for address in ray.get(reg.addresses.remote(config.app_name, kind)):
            stubs.append(stub_type(dial(address, credentials)))
    return stubs


def _counters(workers: list[Any]) -> tuple[float, int]:
    """(seconds computing, bytes exchanged) summed over the workers."""
    stats = [w.GetStats(wpb.GetStatsRequest(), timeout=30) for w in workers]
    return sum(s.busy_seconds for s in stats), sum(s.bytes_received + s.bytes_sent for s in stats)


def _report(
    config: Any, texts: list[str], max_new_tokens: int, temperature: float, off: Mode, on: Mode
) -> dict[str, Any]:
    speedup = on.tokens_per_s() / off.tokens_per_s() if off.tokens_per_s() else 0.0
    steps = on.rounds + len(texts)  # the rounds, and each request's prefill

    def overhead_ms(mode: Mode, n: int) -> float:
        return 1000 * (mode.seconds - mode.worker_seconds) / n if n else 0.0

    return {
        "config": config.model_dump(mode="json"),
        "num_prompts": len(texts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "stack_target_only_tokens_per_s": off.tokens_per_s(),
        "stack_speculative_tokens_per_s": on.tokens_per_s(),
        "stack_speedup": speedup,
        "acceptance_rate": on.accepted / on.proposed if on.proposed else 0.0,
        "mean_tokens_per_round": (on.tokens - len(texts)) / on.rounds if on.rounds else 0.0,
        "rounds": on.rounds,
        "overhead_ms_per_round": overhead_ms(on, steps),
        "overhead_ms_per_step_target_only": overhead_ms(off, off.rounds + len(texts)),
        "wire_bytes_per_round": on.wire_bytes / steps if steps else 0.0,
        "identical_to_target": on.token_ids == off.token_ids,
        "prompts": [
            {"target_only_token_ids": a, "speculative_token_ids": b} for a, b in zip(off.token_ids, on.token_ids)
        ],
    }


class _InProcess:
    """The config's target loaded in this process, decoding plainly as the router's engine would (the same prompt
    encoding, the same slots and context), while the served stack sits idle."""

    def __init__(self, config: Any, max_new_tokens: int) -> None:
        from specdec_core.build import build_engine, prepare_model
        from specdec_core.drafters import registry
        from specdec_core.drafters.base import DraftSpec
        from specdec_core.runner import RunnerConfig

        t = config.target
        self.loaded = prepare_model(t.model, dtype=t.dtype, device=t.device)
        runner = RunnerConfig(num_slots=t.max_sequences, max_seq_len=config.router.max_seq_len)
        self.engine = build_engine(self.loaded, None, DraftSpec(method=registry.NONE), runner_config=runner)
        self.max_new_tokens = max_new_tokens
        self.count = 0

    def decode(self, text: str, temperature: float, seed: int, mode: Mode) -> None:
        from specdec_core.chat import encode_prompt
        from specdec_core.config import SamplingParams
        from specdec_core.request import Request

        self.count += 1
        prompt = encode_prompt(self.loaded.tokenizer, text)
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=self.max_new_tokens)
        start = time.perf_counter()
        self.engine.add_request(Request(f"in-process-{self.count}", tuple(prompt), params, 0))
        ids: list[int] = []
        while self.engine.has_work:
            for out in self.engine.step():
                ids += out.new_token_ids
        mode.seconds += time.perf_counter() - start
        mode.tokens += len(ids)
        mode.token_ids.append(ids)


def _in_process_report(served: Mode, local: Mode) -> dict[str, Any]:
    return {
        "in_process_target_only_tokens_per_s": local.tokens_per_s(),
        "served_vs_in_process_target_only": served.tokens_per_s() / local.tokens_per_s() if local.tokens else 0.0,
        "served_identical_to_in_process": served.token_ids == local.token_ids,
    }


def _offline(
    config: Any, prompts: Path, max_new_tokens: int, temperature: float, seed: int, stack_speedup: float
) -> dict[str, Any]:
    from specdec_tools.bench.offline import OfflineBenchConfig, run_offline_bench

    draft = config.draft
    offline = run_offline_bench(
        OfflineBenchConfig(
            target=config.target.model,
            method=draft.method,
            draft=draft.model if draft.runs_draft_model else None,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            dtype=config.target.dtype,
            device=config.target.device,
            num_speculative_tokens=draft.num_speculative_tokens,
            draft_quantization=draft.quantization,
            draft_vocabulary=draft.vocabulary,
        )
    )
    return {
        "offline_target_only_tokens_per_s": offline["target_only_tokens_per_s"],
        "offline_speculative_tokens_per_s": offline["speculative_tokens_per_s"],
        "offline_speedup": offline["speedup"],
        "stack_speedup_vs_offline": stack_speedup / offline["speedup"] if offline["speedup"] else 0.0,
    }


# -- tensor parallelism ------------------------------------------------------------------------------------------


def register_tp(modes: Any) -> None:
    parser = modes.add_parser("tp", help="a forward of the target split over N ranks vs unsplit (Ray actors, gloo)")
    parser.add_argument("--model", required=True, help="path or `specdec models` name")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--across-nodes",
        action="store_true",
        help="then the same ranks each on a Ray node of its own (nodes started on this machine), "
        "side by side with the one-node run",
    )
    parser.add_argument("--json", required=True, type=Path)
    parser.set_defaults(func=_tp_main)


def _tp_main(args: argparse.Namespace) -> int:
    import os

    from specdec_tools.reports import write_report

    world, cpus = args.tensor_parallel_size, os.cpu_count() or 1
    threads = max(1, cpus // world)
    work = (args.model, args.dtype, args.context, args.repeats)
    ray.init(address="local", num_cpus=max(cpus, world), include_dashboard=False, log_to_driver=False)
    try:
        unsplit = ray.get(_time_forwards.remote(*work[:2], 0, 1, "", cpus, *work[2:]))
        one_node = _time_ranks(work, world, threads, placement=None)
    finally:
        ray.shutdown()
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "tensor_parallel_size": world,
        "cpus": cpus,
        "unsplit_threads": cpus,
        "threads_per_rank": threads,
        "unsplit": unsplit,
        "rank0": one_node[0],
    }
    for t in unsplit["step_ms"]:
        report[f"tp_over_unsplit_time_T{t}"] = one_node[0]["step_ms"][t] / unsplit["step_ms"][t]
    if args.across_nodes:
        across = _time_ranks_across_nodes(work, world, threads)
        report["across_nodes"] = {"rank0": across[0], "nodes": len({r["node_id"] for r in across})}
        for t in unsplit["step_ms"]:
            report[f"across_nodes_over_one_node_time_T{t}"] = across[0]["step_ms"][t] / one_node[0]["step_ms"][t]
    write_report(report, args.json)
    print(json.dumps(report, indent=2))
    return 0


def _time_ranks(work: tuple, world: int, threads: int, placement: str | None) -> list[dict[str, Any]]:
    """Every rank's timings; `placement`: a custom resource prefix, rank r asking for `{placement}{r}` (None: any
    node)."""
    model, dtype, context, repeats = work
    init = f"tcp://127.0.0.1:{_port()}"
    calls = [
        _time_forwards.options(resources={} if placement is None else {f"{placement}{r}": 1}).remote(
            model, dtype, r, world, init, threads, context, repeats
        )
        for r in range(world)
    ]
    return ray.get(calls)


def _time_ranks_across_nodes(work: tuple, world: int, threads: int) -> list[dict[str, Any]]:
    """The ranks on `world` Ray nodes of their own: a local cluster (`ray.cluster_utils.Cluster`), one node per rank
    with a resource only that rank asks for, so Ray cannot put two on one node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for r in range(world):
            cluster.add_node(num_cpus=max(1, threads), resources={f"specdec_tp_rank{r}": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            ranks = _time_ranks(work, world, threads, placement="specdec_tp_rank")
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
    if len({r["node_id"] for r in ranks}) != world:
        raise RuntimeError(f"the {world} ranks did not land on {world} nodes: {[r['node_id'] for r in ranks]}")
    return ranks


def _port() -> int:
    from deployments.ports import free_port as _free_port

    return _free_port()


def _remote_time_forwards(
    model: str, dtype: str, rank: int, world: int, init: str, threads: int, context: int, repeats: int
) -> dict[str, Any]:
    """Per forward size T (1 = decode, 4 = verify of k = 3): best wall ms, and ms in all-reduces."""
    import torch

    from specdec_core.parallel import RowParallelLinear
    from specdec_core.runner import ModelRunner, RunnerConfig

    torch.set_num_threads(threads)
    config = RunnerConfig(num_slots=1, max_seq_len=context + 16, max_extend=8)
    if world == 1:
        from specdec_core.build import prepare_model

        runner = ModelRunner(prepare_model(model, dtype=dtype).model, config)
    else:
        from deployments.tensor_parallel import build_sharded_target

        runner = build_sharded_target(model, dtype, "cpu", rank, world, init, config, 600).runner
    slot = runner.allocate()
    runner.extend([slot], [list(range(1000, 1000 + context))])
    step_ms, collective_ms = {}, {}
    for T in (1, 4):
        best, coll = float("inf"), 0.0
        for _ in range(repeats):
            RowParallelLinear.collective_seconds = 0.0
            start = time.perf_counter()
            runner.extend([slot], [list(range(500, 500 + T))], all_logits=T > 1)
            elapsed = time.perf_counter() - start
            runner.truncate(slot, context)
            if elapsed < best:
                best, coll = elapsed, RowParallelLinear.collective_seconds
        step_ms[T], collective_ms[T] = 1000 * best, 1000 * coll
    return {"step_ms": step_ms, "collective_ms": collective_ms, "node_id": ray.get_runtime_context().get_node_id()}


_time_forwards = ray.remote(num_cpus=1)(_remote_time_forwards)


# -- tracing overhead ----------------------------------------------------------------------------------------------


def register_tracing(modes: Any) -> None:
    parser = modes.add_parser(
        "tracing", help="served throughput with every span recorded and exported vs none, side by side"
    )
    parser.add_argument("config", type=Path, help="the serving config to deploy")
    parser.add_argument("--prompts", required=True, type=Path, help='JSONL, one {"prompt": "..."} per line')
    parser.add_argument("--max-new-tokens", required=True, type=int)
    parser.add_argument("--json", required=True, type=Path)
    parser.set_defaults(func=_tracing_main)


def _tracing_main(args: argparse.Namespace) -> int:
    from specdec_tools.reports import write_report

    report = run_tracing_bench(args.config, args.prompts, args.max_new_tokens)
    write_report(report, args.json)
    print(json.dumps(report, indent=2))
    return 0


class _SpanCounter:
    """An OTLP TraceService receiver that counts what arrives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.spans = 0
        counter = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                counter.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        from concurrent import futures

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def run_tracing_bench(config_path: Path, prompts_path: Path, max_new_tokens: int) -> dict[str, Any]:
    """Every request traced (a sampled client traceparent, the parent-based sampler follows it) or none (an unsampled
    one), alternating on one deployment that exports to a local OTLP receiver."""
    import os
    import secrets

    from deployments.launch import serving
    from deployments.serve_config import load_config
    from specdec_tools.requests import read_prompt_texts

    config = load_config(config_path)
    texts = read_prompt_texts(prompts_path)
    receiver = _SpanCounter()
    # Written, not read: the deployments take OpenTelemetry's standard variables from this process's environment
    # (`app._actor_options` hands them on), so this is how the benchmark points them at its span counter.
    os.environ.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        }
    )
    traced, untraced = Mode(), Mode()
    with serving(config, quiet=True), grpc.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        _stream(stub, _request(texts[0], 8, 0.0, 0, None))
        for i, text in enumerate(texts):
            runs = [("01", traced), ("00", untraced)]
            for flags, mode in runs if i % 2 == 0 else runs[::-1]:
                parent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"
                start = time.perf_counter()
                chunks = list(
                    stub.GenerateStream(
                        _request(text, max_new_tokens, 0.0, 0, None), timeout=3600, metadata=[("traceparent", parent)]
                    )
                )
                mode.seconds += time.perf_counter() - start
                mode.tokens += sum(len(c.token_ids) for c in chunks)
                mode.rounds += chunks[-1].speculation.rounds
        time.sleep(6)  # the batch processors' export interval (5 s) before the deployments go away
    receiver.server.stop(0)
    return {
        "config": str(config_path),
        "num_prompts": len(texts),
        "max_new_tokens": max_new_tokens,
        "traced_tokens_per_s": traced.tokens_per_s(),
        "untraced_tokens_per_s": untraced.tokens_per_s(),
        "tracing_cost": 1 - traced.tokens_per_s() / untraced.tokens_per_s() if untraced.tokens_per_s() else 0.0,
        "traced_rounds": traced.rounds,
        "spans_received": receiver.spans,
    }
