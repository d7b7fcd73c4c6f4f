"""Helpers shared by tests: model variants that make a draft agree always, sometimes or never."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread():
    """Torch on one thread while the block runs. The engine's loop on tiny models is thousands of small ops; with a
    benchmark on this 2-core machine, torch's pool contending for both cores made such a test 10-30x slower
    (measured: 46 s against 1.6 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def perturbed(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """A copy of `model` with Gaussian noise on every weight: a draft that agrees with it only sometimes."""
    clone = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std().clamp(min=1e-3))
    return clone


def contrarian(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose LM head is negated: its argmax is the target's argmin, so greedy drafts are never right."""
    clone = copy.deepcopy(model)
    clone.lm_head.weight = torch.nn.Parameter(-model.lm_head.weight.detach().clone(), requires_grad=False)
    return clone


def make_engine(loaded, draft=None, *, num_slots: int = 8, max_seq_len: int = 256, prefix_caching: bool = False,
                hybrid: bool = False, **config):
    """An engine over `loaded` (a LoadedModel). `draft`: None, "ngram", "suffix", or a Transformer to draft with
    (`hybrid`: beside a suffix drafter, as `draft.method: hybrid` runs them). `prefix_caching`: in the target's
    runner and the draft model's."""
    from specdec_core.drafters.base import Hybrid
    from specdec_core.drafters.draft_model import DraftModelDrafter
    from specdec_core.drafters.ngram import NgramDrafter
    from specdec_core.drafters.suffix import SuffixDrafter
    from specdec_core.engine import EngineConfig, SpecEngine
    from specdec_core.runner import ModelRunner, RunnerConfig
    from specdec_core.target import LocalTarget

    runner_config = RunnerConfig(num_slots=num_slots, max_seq_len=max_seq_len, prefix_caching=prefix_caching)
    target = ModelRunner(loaded.model, runner_config)
    drafter = None
    if draft == "ngram":
        drafter = NgramDrafter()
    elif draft == "suffix":
        drafter = SuffixDrafter()
    elif draft is not None:
        drafter = DraftModelDrafter(ModelRunner(draft, runner_config), target.vocab_size)
    if hybrid:
        drafter = Hybrid(free=SuffixDrafter(), model=drafter)
    return SpecEngine(LocalTarget(target), drafter, loaded.tokenizer, loaded.eos_token_ids, EngineConfig(**config))


def logits_after(model, tokens):  # [len(tokens), V]: one fresh forward, none of an engine's caches
    from specdec_core.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=256))
    return runner.extend([runner.allocate()], [tokens], all_logits=True)[0]


def reference_prob(logits, token, params):  # logits [V]
    """A token's probability as the proposal log defines it, written out here for greedy (plain softmax) and
    temperature plus top-k (top_p must be off): the reference the engine's p and q are checked against."""
    assert params.top_p == 1.0
    if params.greedy:
        return float(torch.softmax(logits, dim=-1)[token])
    scaled = logits / params.temperature  # [V]
    kept = scaled.topk(params.top_k).values  # [top_k]
    return float(torch.exp(scaled[token] - kept.logsumexp(dim=-1))) if scaled[token] >= kept[-1] else 0.0


def run_to_completion(engine, requests):
    """Add (request_id, prompt_ids, params, k[, cache_salt]) tuples, step until done; return {id: (tokens, text,
    last output)}."""
    for request_id, prompt, params, k, *salt in requests:
        engine.add_request(request_id, prompt, params, k, cache_salt=salt[0] if salt else None)
    results = {r[0]: ([], "", None) for r in requests}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = results[out.seq_id]
            results[out.seq_id] = (tokens + list(out.new_token_ids), text + out.new_text, out)
    return results


def worker_stats(served, kind):
    """GetStats of every `kind` ("target" or "draft") worker replica of the `served` stack."""
    import grpc
    import ray

    from deployments import registry
    from specdec.v1 import worker_pb2 as wpb
    from specdec.v1 import worker_pb2_grpc as wpb_grpc

    _, config = served
    addresses = ray.get(registry.registry().addresses.remote(config.app_name, kind))
    stats = []
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            method = wpb_grpc.TargetServiceStub if kind == "target" else wpb_grpc.DraftServiceStub
            stats.append(method(channel).GetStats(wpb.GetStatsRequest(), timeout=10))
    return stats


def wait_until_idle(served, timeout=30.0):
    """True once no worker of the `served` stack holds a session (False at the timeout)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.active_sessions == 0 for kind in ("target", "draft") for s in worker_stats(served, kind)):
            return True
        time.sleep(0.2)
    return False


# Structured output through the service: a JSON schema the tiny random models can finish (enums, bounded numbers and
# strings), and whether a parsed value satisfies it. No "x-guidance": the served APIs write JSON compact already.
SERVED_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "size", "tags"],
    "properties": {
        "name": {"enum": ["add", "mean", "count"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 6},  # optional
    },
}


def satisfies_served_schema(value) -> bool:
    return (isinstance(value, dict) and {"name", "size", "tags"} <= set(value) <= {"name", "size", "tags", "note"}
            and value["name"] in ("add", "mean", "count") and isinstance(value["size"], int)
            and 0 <= value["size"] <= 99 and len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
            and len(value.get("note", "")) <= 6)
