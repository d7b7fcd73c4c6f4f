"""Helpers shared by tests: model variants that make a draft agree always, sometimes or never; engines, workers and
the served stack's state; the chi-square test of sampled outputs against an exact law; an in-process ASGI client."""

from __future__ import annotations

import asyncio
import copy
import json
import warnings
from collections.abc import Mapping, Sequence
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


def make_engine(
    loaded,
    draft=None,
    *,
    num_slots: int = 8,
    max_seq_len: int = 256,
    prefix_caching: bool = False,
    hybrid: bool = False,
    confidence_threshold: float = 0.0,
    **config,
):
    """An engine over `loaded` (a LoadedModel). `draft`: None, "ngram", "suffix", or a Transformer to draft with
    (`hybrid`: beside a suffix drafter, as `draft.method: hybrid` runs them; `confidence_threshold`: its
    `DraftModelDrafter`'s). `prefix_caching`: in the target's runner and the draft model's."""
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
        drafter = DraftModelDrafter(
            ModelRunner(draft, runner_config), target.vocab_size, confidence_threshold=confidence_threshold
        )
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
    from specdec_core.request import Request

    for request_id, prompt, params, k, *salt in requests:
        engine.add_request(Request(request_id, tuple(prompt), params, k, cache_salt=salt[0] if salt else None))
    results = {r[0]: ([], "", None) for r in requests}
    while engine.has_work:
        for out in engine.step():
            tokens, text, _ = results[out.seq_id]
            results[out.seq_id] = (tokens + list(out.new_token_ids), text + out.new_text, out)
    return results


def drive(engine, arrivals, on_step=None):
    """Step `engine` until done, adding (step, Request) `arrivals` as their step comes and calling
    `on_step(engine, step)` after each: {seq_id: (tokens, last output)}."""
    results, step, pending = {}, 0, sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for out in engine.step():
            tokens, _ = results.get(out.seq_id, ([], None))
            results[out.seq_id] = (tokens + list(out.new_token_ids), out)
        if on_step is not None:
            on_step(engine, step)
        step += 1
    return results


def serve_pair(pair, runner, credentials=None):
    """Both workers over the tiny pair, each on its own gRPC server on loopback (with `credentials`: mutual TLS and
    the secret, as `deployments.workers.start_server` takes them): yields {kind: (servicer, address)}."""
    from deployments.workers import DraftServicer, TargetServicer, start_server
    from specdec_core.drafters.draft_model import DraftModelDrafter
    from specdec_core.grammar.compiler import GrammarCompiler
    from specdec_core.runner import ModelRunner
    from specdec_core.target import LocalTarget

    target, draft = pair
    t = TargetServicer(LocalTarget(ModelRunner(target.model, runner)), "tiny-target")
    grammars = GrammarCompiler(target.tokenizer, target.model.vocab_size, sorted(target.eos_token_ids))
    d = DraftServicer(
        DraftModelDrafter(ModelRunner(draft.model, runner), target.model.vocab_size), "tiny-draft", grammars=grammars
    )
    (ts, tport), (ds, dport) = (
        start_server(t, "127.0.0.1", credentials=credentials),
        start_server(d, "127.0.0.1", credentials=credentials),
    )
    yield {"target": (t, f"127.0.0.1:{tport}"), "draft": (d, f"127.0.0.1:{dport}")}
    ts.stop(0)
    ds.stop(0)


def operator_tls_dir(directory, name="specdec.example.internal", usages=None, key_of_other=False):
    """What an operator's issuer (cert-manager) writes into a Kubernetes TLS Secret, as a directory: ca.crt, and one
    certificate (DNS name `name`, extended key usages `usages`: both ends by default) with its key (another key
    with `key_of_other`)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator CA")])

    def builder(subject, public_key):
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        builder(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(ca_key, hashes.SHA256())
    )
    usages = usages or [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    leaf = (
        builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specdec")]), key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), False)
        .add_extension(x509.ExtendedKeyUsage(usages), False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    written_key = ec.generate_private_key(ec.SECP256R1()) if key_of_other else key
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "tls.crt").write_bytes(leaf.public_bytes(pem))
    (directory / "tls.key").write_bytes(
        written_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return directory


def worker_stats(served, kind):
    """GetStats of every `kind` ("target" or "draft") worker replica of the `served` stack."""
    import ray

    from deployments import worker_registry as registry
    from deployments.auth import dial
    from deployments.tls import Role
    from specdec.v1 import worker_pb2 as wpb
    from specdec.v1 import worker_pb2_grpc as wpb_grpc

    _, config = served
    addresses = ray.get(registry.registry().addresses.remote(config.app_name, kind))
    credentials = registry.credentials(config.app_name, Role.CLIENT)  # as a router or a tool gets them
    stats = []
    for address in addresses:
        with dial(address, credentials) as channel:
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
    return (
        isinstance(value, dict)
        and {"name", "size", "tags"} <= set(value) <= {"name", "size", "tags", "note"}
        and value["name"] in ("add", "mean", "count")
        and isinstance(value["size"], int)
        and 0 <= value["size"] <= 99
        and len(value["tags"]) <= 3
        and set(value["tags"]) <= {"a", "b"}
        and len(value.get("note", "")) <= 6
    )


def perturbed_checkpoint(source, out, scale: float, seed: int = 0):
    """A copy of the checkpoint directory `source` at `out` (tokenizer and config included) with Gaussian noise on
    every weight, as `perturbed` does to a loaded model: another draft of the same family and vocabulary."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    gen = torch.Generator().manual_seed(seed)
    for file in out.glob("*.safetensors"):
        state = load_file(file)
        noisy = {
            k: (v + torch.randn(v.shape, generator=gen) * scale * v.float().std().clamp(min=1e-3)).to(v.dtype)
            for k, v in state.items()
        }
        save_file(noisy, file, metadata={"format": "pt"})
    return out


def corpus_prompt(words, start, length):
    return " ".join(words[start : start + length])


def build_taught_target(tiny_dir, out, steps=400):
    """A tiny target that knows a text: the tiny qwen2 target trained (cross-entropy, with the distillation loop on
    one-hot targets) to answer a chat turn holding a few words of the tiny tokenizer's corpus with the words that
    follow them. A random target is no use for testing distillation: its next-token distributions are nearly flat
    (top-1 probability ~0.07) and chaotic in the context, so no draft learns them from a few thousand positions
    (measured: 1,000 prompts, 1,500 steps, held-out acceptance 0.001 -> 0.03). This one has structure to learn,
    as a real target does."""
    import random

    from specdec_core.chat import encode_prompt
    from specdec_core.distill.data import Example
    from specdec_core.distill.forward import use_causal_attention
    from specdec_core.distill.lora import trainable
    from specdec_core.distill.save import write_draft
    from specdec_core.distill.train import TrainConfig, train
    from specdec_core.models.loader import load_model
    from specdec_core.models.tiny import _CORPUS

    source = load_model(tiny_dir / "target", dtype="float32")
    tokenizer, words, rng = source.tokenizer, _CORPUS.split(" "), random.Random(0)
    examples = []
    for start in range(len(words) - 30):
        n = rng.randint(2, 6)
        prompt = encode_prompt(tokenizer, corpus_prompt(words, start, n))
        answer = tokenizer(" " + corpus_prompt(words, start + n, 16))["input_ids"][:24]
        tokens = prompt + answer
        examples.append(
            Example(
                tuple(tokens[:-1]),
                tuple(range(len(prompt) - 1, len(tokens) - 1)),
                torch.tensor(answer).view(-1, 1),
                torch.zeros(len(answer), 1),
                torch.ones(len(answer)),
            )
        )  # p = 1 on the next token: the KL is cross-entropy
    model = trainable(use_causal_attention(source.model), 0)
    vocab = source.model.vocab_size
    train(
        model,
        examples,
        TrainConfig(steps=steps, batch_size=8, learning_rate=3e-3),
        draft_rows=vocab,
        shared_vocab=vocab,
    )
    return write_draft(model, source, out)


def chi_square_p_value(
    counts: Mapping[tuple[int, ...], int], law: Mapping[tuple[int, ...], float], samples: int
) -> float:
    """Pearson's chi-square test of `counts` (each output's count over `samples` draws) against the exact `law`
    (each output's probability): its p-value. Cells expected fewer than 5 times are pooled into one, as the test's
    approximation needs; 0.0 where an output the law gives no mass was sampled."""
    from scipy.stats import chisquare

    if not set(counts) <= set(law):
        return 0.0
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell in sorted(law, key=law.__getitem__, reverse=True):
        e = law[cell] * samples
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o, rest_e = rest_o + counts.get(cell, 0), rest_e + e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    return float(chisquare(observed, expected).pvalue)


async def asgi_post(app, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> tuple[int, dict, int]:
    """One JSON POST through an ASGI `app` in process, as Serve's HTTP proxy makes it (content-type
    application/json, then `headers`): (status, the JSON body, how many times the app read the request). The
    client never goes away: a read past the body waits forever."""
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    reads = 0

    async def receive() -> dict:
        nonlocal reads
        reads += 1
        if pending:
            return pending.pop()
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:])), reads


# A tiny Gemma 3 (text): sliding-window layers around a full one, each kind with its own RoPE (the full layers'
# scaled linearly), an attention scale of its own (query_pre_attn_scalar 24 against a head dim of 16).
GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_CONFIG = dict(
    layer_types=GEMMA3_LAYERS,
    sliding_window=8,
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)


def build_tiny_gemma3(path, tokenizer_dir, seed: int = 31, tie: bool = False, **config):
    """A tiny random Gemma 3 saved at `path` (transformers' `Gemma3TextConfig`), with its norm weights drawn around
    0: Gemma's (1 + weight) norms start at 0, where a norm scaling by the weight alone (or rounding before scaling)
    would go unnoticed. Untied embeddings unless `tie`: tied, a tiny random Gemma's scaled embedding dominates its
    residual stream and it repeats its last token whatever the context (a test of greedy identity would pass for
    the wrong reason). `config`: overrides of `GEMMA3_CONFIG`."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from specdec_core.models.tiny import build_tiny_model

    fields = {**GEMMA3_CONFIG, **config}
    layers = len(fields["layer_types"])
    path = build_tiny_model(
        path,
        family="gemma3_text",
        seed=seed,
        num_layers=layers,
        tie_word_embeddings=tie,
        tokenizer_dir=tokenizer_dir,
        config_overrides=fields,
    )
    gen = torch.Generator().manual_seed(seed)
    for file in Path(path).glob("*.safetensors"):
        state = load_file(file)
        state = {k: v + 0.3 * torch.randn(v.shape, generator=gen) if "norm" in k else v for k, v in state.items()}
        save_file(state, file, metadata={"format": "pt"})
    return path


def syncs_during(call) -> int:
    """Synchronising CUDA calls (copies that wait for the device) made by `call()`, as torch's sync debug mode
    reports them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
