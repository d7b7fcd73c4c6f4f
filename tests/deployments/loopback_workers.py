"""Workers on loopback for the router's clients of them (`deployments.remote_target`, `deployments.remote_drafter`,
`deployments.replica_pool`): real gRPC servers of the worker servicers, an engine over them, no Ray."""

from __future__ import annotations

from deployments.remote_drafter import RemoteDrafter
from deployments.remote_target import RemoteTarget
from deployments.replica_pool import ReplicaPool
from deployments.workers import DraftServicer, TargetServicer, start_server
from specdec.v1 import worker_pb2_grpc as wpb_grpc
from specdec_core.config import SamplingParams
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.engine import EngineConfig, SpecEngine
from specdec_core.grammar.compiler import GrammarCompiler
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.target import LocalTarget

RUNNER = RunnerConfig(num_slots=4, max_seq_len=256)
GREEDY = SamplingParams(max_tokens=60, ignore_eos=True)
PROMPT = list(range(5, 25))


def serve_locally(servicer):
    server, port = start_server(servicer, "127.0.0.1")
    return server, f"127.0.0.1:{port}"


def target_servicer(pair, name="target"):
    return TargetServicer(LocalTarget(ModelRunner(pair[0].model, RUNNER)), name)


def draft_servicer(pair, cls=DraftServicer, name="draft", grammars=True):
    target = pair[0]
    compiler = GrammarCompiler(target.tokenizer, target.model.vocab_size, sorted(target.eos_token_ids))
    return cls(
        DraftModelDrafter(ModelRunner(pair[1].model, RUNNER), target.model.vocab_size),
        name,
        grammars=compiler if grammars else None,
    )


def remote_engine(pair, target_addresses, draft_addresses, draft_timeout_s=30.0, config=EngineConfig()):
    target, _ = pair
    tpool = ReplicaPool("target", target_addresses, wpb_grpc.TargetServiceStub, timeout_s=30)
    dpool = ReplicaPool("draft", draft_addresses, wpb_grpc.DraftServiceStub, timeout_s=30)
    drafter = RemoteDrafter(dpool, timeout_s=draft_timeout_s, retry_s=0.0)
    return SpecEngine(RemoteTarget(tpool), drafter, target.tokenizer, target.eos_token_ids, config), dpool


def run_steps(engine, until=None):
    """Step to the end; `until(outputs_so_far)` is called after each step. Returns (tokens, rounds, last)."""
    tokens, rounds, last = [], [], None
    while engine.has_work:
        for out in engine.step():
            tokens += out.new_token_ids
            rounds.append(out.round)
            last = out
        if until is not None:
            until(rounds)
    return tokens, [r for r in rounds if r is not None], last


STRUCTURED_PROMPTS = ["def add(a, b):", "The quick brown fox", "class Counter:", "x = 1\ny = 2\n"]


def structured_run(target, engine, params, k):
    """The structured prompts through `engine` under `params`: {id: (tokens, text, last output)}, and every round."""
    requests = [(str(i), target.tokenizer(p)["input_ids"], params, k) for i, p in enumerate(STRUCTURED_PROMPTS)]
    for request_id, prompt, p, kk in requests:
        engine.add_request(Request(request_id, tuple(prompt), p, num_speculative_tokens=kk))
    results, rounds = {r[0]: ([], "", None) for r in requests}, {r[0]: [] for r in requests}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = results[out.seq_id]
            results[out.seq_id] = (tokens + list(out.new_token_ids), text + out.new_text, out)
            rounds[out.seq_id].append((len(tokens), out.round))
    return results, rounds


def structured_remotely(pair, params, draft):
    """`structured_run` over an engine whose target and `draft` servicer serve on loopback: (results, rounds,
    engine)."""
    tserver, taddr = serve_locally(target_servicer(pair))
    dserver, daddr = serve_locally(draft)
    try:
        engine, _ = remote_engine(pair, [taddr], [daddr])
        got, rounds = structured_run(pair[0], engine, params, 3)
    finally:
        tserver.stop(0)
        dserver.stop(0)
    return got, rounds, engine
