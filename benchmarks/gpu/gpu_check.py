"""Check that the engine package (`specdec_core`) works, and stays exact, on a CUDA device.

Four parts, each printed as it ends and written into one JSON report:

1. environment: torch, the device, the dtypes checked.
2. the engine on the device: tiny random-weight models (`models.tiny`: a qwen2 target, a smaller draft, and the
   target with noise on its weights as a "near" draft whose drafts are often right, and that draft again with its
   LM head cut to 128 ids plus the contexts', `models.vocab_head`) loaded onto it. First the calls
   that sample (the target's prefill and verify, greedy and sampled rows together, the draft model's propose) made
   directly, each on its own. Then, for every drafting method of the registry (the draft-model methods with each
   draft), several greedy prompts batched in one engine must give, token for token, the output of plain decoding
   (method "none") on the same device, with drafts proposed and no warning logged (the engine turns a failing
   drafter into plain decoding, which would pass for the wrong reason). And per method a mixed batch: greedy rows
   beside sampled ones (temperature 0.8, top-p 0.95) must still give the plain output, the sampled rows must run to
   their length. On CUDA in float32 and bfloat16; a bfloat16 divergence at a near tie of the target's two best
   logits is reported as such, not as a failure.
3. rejection sampling at temperature > 0: `rejection.rejection_sample` on the device over toy models (V tokens,
   k drafts, p and q depending on the prefix). A round's output, completed to k + 1 tokens by sampling from p,
   must have p's joint law: a chi-square test over 200k rows, for drafts sampled from q (dense q), deterministic
   drafts (q None), and a mixed batch (sampled rows with q beside point-mass rows with one-hot q, 0..k drafts per
   row). Two wrong samplers must FAIL the same test: "accept always" (the same function, every acceptance uniform
   0) and "residual ignored" (its output with the token after a rejection redrawn from p, not from max(0, p - q)).
4. the cost of verifying w tokens: a random-weight model of Qwen2.5-1.5B's shape built on the device, a forward of
   w new tokens after a context of 600, w = 1, 2, 3, 5, 9, 17, 33, 65 (medians of 20 after warm-up), and a draft
   step (w = 1) of a Qwen2.5-0.5B-shaped model: the table, and the draft/target step cost ratio. On CUDA also the
   same forwards captured once as CUDA graphs and replayed: the device's own time, without Python's launches.

The exit status is 0 only if every check passes (the wrong samplers failing as they must); the last line sums up.

    PYTHONPATH=.:proto python benchmarks/gpu/gpu_check.py --device cuda --json out/gpu_check.json
    PYTHONPATH=.:proto python benchmarks/gpu/gpu_check.py --device cpu --quick --threads 1 --json /tmp/gpu_check.json

`--quick` shrinks every part (fewer tokens and rows, tiny shapes for the costs) to develop the script on a CPU.
Needs what `specdec_core` needs (torch, numpy, safetensors, llguidance; transformers and tokenizers for the tiny
models), nothing of the service.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec_core.build import build_engine, prepare_model
from specdec_core.config import SamplingParams, TokenShaping
from specdec_core.drafters import registry
from specdec_core.drafters.base import DraftRequest, DraftSpec
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.kv_cache import KVCache
from specdec_core.models.families import args_from_hf_config
from specdec_core.models.loader import LoadedModel
from specdec_core.models.tiny import build_tiny_pair
from specdec_core.models.transformer import Transformer
from specdec_core.rejection import VerifyResult, rejection_sample
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_core.sparse_q import SparseQ
from specdec_core.stopping import FinishReason
from specdec_core.target import LocalTarget, PrefillItem, VerifyItem

PROMPTS = (
    "def add(a, b):",
    "The quick brown fox",
    "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n",  # repeats: n-gram and suffix lookups find matches
    "for index, value in enumerate(range(10)):\n    print(",
)
K = 4  # drafts per round in the engine checks
RUNNER = RunnerConfig(num_slots=8, max_seq_len=256)
SAMPLED = dict(temperature=0.8, top_p=0.95)
# A divergence from plain decoding is a near tie when both tokens are the target's two best and their logits differ
# by less than this fraction of the best: rounding, not the engine, decides such a token.
TIE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

ALPHA = 1e-4  # chi-square: a correct sampler fails with this probability per check
TOY_CONFIGS = ((4, 2, 21), (5, 3, 12))  # (V, k, seed) of each toy model

QWEN2 = dict(
    model_type="qwen2",
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
TARGET_SHAPE = QWEN2 | dict(
    hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960
)  # Qwen2.5-1.5B
DRAFT_SHAPE = QWEN2 | dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
)  # Qwen2.5-0.5B
TINY_TARGET_SHAPE = QWEN2 | dict(
    vocab_size=400,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
)
TINY_DRAFT_SHAPE = TINY_TARGET_SHAPE | dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)
WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65)


class Report:
    """Every check's verdict, and the JSON report the parts fill in."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"checks": []}

    def check(self, name: str, ok: bool, line: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok)})
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + line if line else ''}", flush=True)
        return ok

    def part(self, key: str, run: Callable[[], Any]) -> None:
        """Run one part into `data[key]`; an exception fails the part (its traceback goes into the report)."""
        try:
            self.data[key] = run()
        except Exception as exc:
            self.data[key] = {"error": traceback.format_exc()}
            self.check(f"{key} ran", False, f"{type(exc).__name__}: {exc}")

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.data["checks"] if not c["ok"]]


class _Warnings(logging.Handler):
    """Collects what the engine logs at WARNING and above: a drafter or a round that failed and was covered over."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. environment -------------------------------------------------------------------------------------------------


def environment(device: torch.device, dtypes: list[torch.dtype]) -> dict[str, Any]:
    """Part 1."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": name,
        "dtypes": [str(d) for d in dtypes],
    }
    print(
        f"environment: torch {env['torch']} (cuda {env['cuda']}), {device} = {name}, dtypes {', '.join(env['dtypes'])}",
        flush=True,
    )
    return env


# -- 2. the engine on the device -------------------------------------------------------------------------------------


def build_tiny_models(root: Path) -> dict[str, Path]:
    """The tiny target and draft (`build_tiny_pair`), and the target with noise on its weights (the near draft)."""
    from safetensors.torch import load_file, save_file

    build_tiny_pair(root)
    near = root / "near"
    shutil.copytree(root / "target", near)
    gen = torch.Generator().manual_seed(7)
    for file in near.glob("*.safetensors"):
        noisy = {
            k: (v + torch.randn(v.shape, generator=gen) * 0.05 * v.float().std().clamp(min=1e-3)).to(v.dtype)
            for k, v in load_file(file).items()
        }
        save_file(noisy, file, metadata={"format": "pt"})
    return {"target": root / "target", "draft": root / "draft", "near": near, "near_cut": near}


# The near draft again with its LM head cut to its first 128 ids and the contexts' (`models.vocab_head`).
CUT_VOCABULARY = {"near_cut": 128}


def drafting_runs() -> list[tuple[str, str | None]]:
    """(method, draft) for every registered method: those that run a draft model once with each draft."""
    return [
        (name, draft)
        for name, method in registry.METHODS.items()
        for draft in (("draft", "near", "near_cut") if method.runs_draft_model else (None,))
    ]


def generate(engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, dict[str, Any]]:
    """Run `requests` (id, prompt ids, params) to the end in one engine: per id its tokens, end and stats."""
    for seq_id, ids, params in requests:
        engine.add_request(Request(seq_id, tuple(ids), params, num_speculative_tokens=K))
    out = {seq_id: {"tokens": []} for seq_id, _, _ in requests}
    while engine.has_work:
        for step in engine.step():
            row = out[step.seq_id]
            row["tokens"] += step.new_token_ids
            if step.finished:
                row.update(
                    finish=step.finish_reason.value,
                    error=None if step.error is None else str(step.error),
                    rounds=step.stats.rounds,
                    proposed=step.stats.proposed,
                    accepted=step.stats.accepted,
                )
    return out


def divergence(
    target: LoadedModel, prompt: list[int], plain: list[int], spec: list[int], dtype: torch.dtype
) -> dict[str, Any]:
    """Where `spec` first leaves `plain`, and whether the target's logits there make it a near tie."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if i >= min(len(plain), len(spec)):
        return {"position": i, "near_tie": False, "lengths": [len(plain), len(spec)]}
    runner = ModelRunner(target.model, RunnerConfig(num_slots=1, max_seq_len=RUNNER.max_seq_len))
    logits = runner.extend([runner.allocate()], [prompt + plain[:i]])[0]  # [V]
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    relative = gap / max(abs(float(top.values[0])), 1e-6)
    near_tie = {plain[i], spec[i]} <= set(top.indices.tolist()) and relative < TIE.get(dtype, 0.0)
    return {
        "position": i,
        "plain": plain[i],
        "spec": spec[i],
        "top2": top.indices.tolist(),
        "gap": gap,
        "relative_gap": relative,
        "near_tie": near_tie,
    }


def compare(
    target: LoadedModel,
    prompts: dict[str, list[int]],
    expected: dict[str, dict],
    got: dict[str, dict],
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The greedy rows of `got` against plain decoding: identical, or where each first diverges (near ties?)."""
    result: dict[str, Any] = {"identical": True, "divergences": {}}
    for seq_id, plain in expected.items():
        tokens = got[seq_id]["tokens"]
        if tokens != plain["tokens"]:
            result["identical"] = False
            result["divergences"][seq_id] = divergence(target, prompts[seq_id], plain["tokens"], tokens, dtype)
    result["near_ties_only"] = not result["identical"] and all(d["near_tie"] for d in result["divergences"].values())
    return result


def totals(rows: dict[str, dict]) -> dict[str, Any]:
    """Rounds, drafts proposed and accepted over a run's rows, and every row that did not run to its length."""
    errors = [f"{k}: {r.get('error')}" for k, r in rows.items() if r.get("finish") != FinishReason.LENGTH.value]
    return {
        "rounds": sum(r.get("rounds", 0) for r in rows.values()),
        "proposed": sum(r.get("proposed", 0) for r in rows.values()),
        "accepted": sum(r.get("accepted", 0) for r in rows.values()),
        "errors": errors,
    }


def component_calls(report: Report, label: str, loaded: dict[str, LoadedModel]) -> dict[str, str | None]:
    """The target's and the draft model's calls at temperature > 0 made directly on the device, each on its own: in
    the engine a sampled prefill that fails ends its requests before any round of theirs. None: the call ran."""
    target, draft = loaded["target"], loaded["near"]
    greedy, sampled = TokenShaping(), TokenShaping(**SAMPLED)
    ids = target.tokenizer(PROMPTS[0])["input_ids"]
    local = LocalTarget(ModelRunner(target.model, RUNNER))
    drafter = DraftModelDrafter(ModelRunner(draft.model, RUNNER), local.vocab_size)
    q = SparseQ(torch.tensor([[7, 9], [3, 8]]), torch.tensor([[0.5, 0.5], [0.25, 0.75]]))  # [2, 2], drafts 7 and 3
    u = torch.tensor([0.3, 0.6], dtype=torch.float64)  # [2] acceptance uniforms
    calls = {
        "target prefill, greedy rows": lambda: local.prefill([PrefillItem(s, ids, greedy, None) for s in "gs"]),
        "target verify, greedy and sampled rows": lambda: local.verify(
            [
                VerifyItem("g", ids[-1], [7, 3], None, greedy, None, None),
                VerifyItem("s", ids[-1], [7, 3], q, sampled, u, 0.5),
            ]
        ),
        "target verify, sampled rows": lambda: local.verify([VerifyItem("s", ids[-1], [7, 3], q, sampled, u, 0.5)]),
        "target prefill, sampled row": lambda: local.prefill([PrefillItem("x", ids, sampled, 0.5)]),
        "draft model propose, sampled row": lambda: (
            drafter.start("d", ids),
            drafter.propose([DraftRequest("d", ids, 3, sampled, torch.rand(3, dtype=torch.float64))]),
        ),
    }
    out: dict[str, str | None] = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        report.check(f"device {label}: {name}", out[name] is None, out[name] or "")
    return out


def engine_run(
    target: LoadedModel,
    loaded: dict[str, LoadedModel],
    method: str,
    draft: str | None,
    batch: list[tuple[str, list[int], SamplingParams]],
    warnings: _Warnings,
) -> dict[str, Any]:
    """`batch` run to the end by an engine drafting with `method` (and the `draft` model): rows, totals, warnings."""
    warnings.messages.clear()
    t0 = time.perf_counter()
    try:
        engine = build_engine(
            target,
            loaded[draft] if draft else None,
            DraftSpec(method=method),
            runner_config=RUNNER,
            num_speculative_tokens=K,
        )
        rows = generate(engine, batch)
    except Exception as exc:  # the engine turns most failures into ended requests: this one it did not
        rows = {
            seq_id: {"tokens": [], "finish": "raised", "error": f"{type(exc).__name__}: {exc}"}
            for seq_id, _, _ in batch
        }
    return {
        "method": method + (f"/{draft}" if draft else ""),
        **totals(rows),
        "warnings": list(warnings.messages),
        "seconds": round(time.perf_counter() - t0, 2),
        "rows": rows,
    }


def engine_checks(
    report: Report,
    device: torch.device,
    dtype: torch.dtype,
    models: dict[str, Path],
    max_tokens: int,
    prompts_used: int,
) -> dict[str, Any]:
    """Part 2 in one dtype: the sampled calls on their own, then every drafting method against plain decoding, with
    greedy requests alone and in a batch with sampled ones."""
    label = str(dtype).removeprefix("torch.")
    loaded = {
        role: prepare_model(path, dtype=label, device=str(device), vocabulary=CUT_VOCABULARY.get(role, 0))
        for role, path in models.items()
    }
    target = loaded["target"]
    out: dict[str, Any] = {"components": component_calls(report, label, loaded), "greedy": [], "mixed": []}
    prompts = {f"p{i}": target.tokenizer(text)["input_ids"] for i, text in enumerate(PROMPTS[:prompts_used])}
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [(seq_id, ids, greedy) for seq_id, ids in prompts.items()]
    mixed = requests + [
        (f"s{seq_id}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **SAMPLED))
        for i, (seq_id, ids) in enumerate(prompts.items())
    ]
    warnings = _Warnings()
    logging.getLogger("specdec_core").addHandler(warnings)
    try:
        plain = out["plain"] = engine_run(target, loaded, "none", None, requests, warnings)
        report.check(
            f"greedy {label}: plain decoding runs",
            not plain["errors"] and not plain["warnings"],
            f"{len(prompts)} prompts x {max_tokens} tokens in {plain['seconds']} s",
        )
        for method, draft in [("none", None), *drafting_runs()]:
            for kind, batch in (("greedy", requests), ("mixed", mixed)):
                if kind == "greedy" and method == "none":
                    continue  # that is the plain run itself
                entry = engine_run(target, loaded, method, draft, batch, warnings)
                entry |= compare(target, prompts, plain["rows"], entry["rows"], dtype)
                sampled = [r["tokens"] for seq_id, r in entry["rows"].items() if seq_id.startswith("s")]
                entry["sampled_ok"] = all(
                    len(t) == max_tokens and 0 <= min(t) and max(t) < target.model.vocab_size for t in sampled
                )
                ok = (
                    (entry["identical"] or (dtype != torch.float32 and entry["near_ties_only"]))
                    and not entry["errors"]
                    and not entry["warnings"]
                    and entry["sampled_ok"]
                    and (method == "none" or entry["proposed"] > 0)
                )
                out[kind].append(entry)
                what = "equals plain decoding" if kind == "greedy" else "greedy rows exact beside sampled rows"
                report.check(f"{kind} {label}: {entry['method']} {what}", ok, _run_line(entry))
        return out
    finally:
        logging.getLogger("specdec_core").removeHandler(warnings)


def _run_line(entry: dict[str, Any]) -> str:
    verdict = "identical" if entry["identical"] else ("near ties only" if entry["near_ties_only"] else "DIFFERENT")
    line = (
        f"{verdict}, {entry['rounds']} rounds, {entry['accepted']}/{entry['proposed']} accepted, {entry['seconds']} s"
    )
    if entry["errors"]:
        line += f"; errors: {entry['errors'][0][:200]}"
    if entry["warnings"]:
        line += f"; {len(entry['warnings'])} warnings, first: {entry['warnings'][0][:200]}"
    return line


# -- 3. rejection sampling at temperature > 0 -----------------------------------------------------------------------


def toy_tables(V: int, k: int, seed: int, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """p and q of a toy model: level j is [V**j, V], the law of token j after each prefix (prefix as a base-V code,
    first token most significant). p gives 0 to one token after every other prefix: zero mass must stay zero."""
    gen = torch.Generator().manual_seed(seed)
    p, q = [], []
    for j in range(k + 1):
        logits = torch.randn(V**j, V, generator=gen, dtype=torch.float64) * 1.5  # [V**j, V]
        rows = torch.arange(0, V**j, 2)
        logits[rows, (rows + j) % V] = -math.inf
        p.append(torch.softmax(logits, dim=-1).float().to(device))
        q.append(torch.softmax(torch.randn(V**j, V, generator=gen, dtype=torch.float64), dim=-1).float().to(device))
    return p, q


def draft_rows(
    p: list[torch.Tensor], q: list[torch.Tensor], n: int, sampled: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows of k drafts, sampled from q or (not `sampled`) q's greedy path: drafts [n, k], p [n, k+1, V] along
    them, and the q the drafts were drawn from [n, k, V] (one-hot for the greedy path)."""
    k, V = len(q) - 1, p[0].shape[-1]
    code = torch.zeros(n, dtype=torch.long, device=p[0].device)  # [n] the prefix drafted so far
    drafts, p_rows, q_rows = [], [], []
    for j in range(k):
        p_rows.append(p[j][code])  # [n, V]
        q_j = q[j][code]  # [n, V]
        x = torch.multinomial(q_j, 1, generator=gen).squeeze(-1) if sampled else q_j.argmax(dim=-1)  # [n]
        drafts.append(x)
        q_rows.append(q_j if sampled else torch.nn.functional.one_hot(x, V).to(q_j.dtype))
        code = code * V + x
    p_rows.append(p[k][code])
    return torch.stack(drafts, 1), torch.stack(p_rows, 1), torch.stack(q_rows, 1)


def completed_law(result: VerifyResult, p: list[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """Counts [V**(k+1)] of the rounds' outputs, each completed to k + 1 tokens by sampling from p."""
    tokens = result.output_token_ids.clone()  # [n, k+1], -1 past the round's output
    V = p[0].shape[-1]
    code = tokens[:, 0].clone()  # [n]
    for j in range(1, tokens.shape[1]):
        empty = tokens[:, j] < 0  # [n]
        drawn = torch.multinomial(p[j][code], 1, generator=gen).squeeze(-1)  # [n]
        tokens[:, j] = torch.where(empty, drawn, tokens[:, j])
        code = code * V + tokens[:, j]
    return torch.bincount(code, minlength=V ** tokens.shape[1]).cpu()


def residual_ignored(
    result: VerifyResult, num_draft: torch.Tensor, p_rows: torch.Tensor, gen: torch.Generator
) -> VerifyResult:
    """A wrong sampler for the negative control: after a rejection the token is redrawn from p, not from the
    residual max(0, p - q); the acceptances are the true sampler's."""
    n = result.num_accepted  # [rows]
    rows = torch.arange(n.shape[0], device=n.device)
    drawn = torch.multinomial(p_rows[rows, n], 1, generator=gen).squeeze(-1)  # [rows]
    out = result.output_token_ids.clone()  # [rows, k+1]
    out[rows, n] = torch.where(n < num_draft, drawn, out[rows, n])
    return VerifyResult(out, n)


def joint_law(p: list[torch.Tensor]) -> torch.Tensor:  # [V**(k+1)] float64: k + 1 tokens sampled from p
    law = p[0][0].double().cpu()
    for level in p[1:]:
        law = (law.unsqueeze(-1) * level.double().cpu()).reshape(-1)
    return law / law.sum()


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof), by the Wilson-Hilferty cube-root normal approximation (no scipy)."""
    if dof <= 0:
        return 1.0
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square(counts: torch.Tensor, law: torch.Tensor) -> dict[str, Any]:
    """Pearson's test of `counts` [C] against `law` [C]; cells expecting fewer than 5 pooled into one. A count in a
    cell of probability 0 fails outright."""
    n = int(counts.sum())
    expected = law * n  # [C]
    observed = counts.double()
    small = (expected < 5) & (law > 0)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs - exp) ** 2 / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    impossible = int(counts[law == 0].sum())
    tv = 0.5 * float((observed / n - law).abs().sum())
    pvalue = chi2_sf(stat, dof)
    return {
        "rows": n,
        "chi2": round(stat, 1),
        "dof": dof,
        "p_value": pvalue,
        "impossible": impossible,
        "total_variation": round(tv, 5),
        "pass": impossible == 0 and pvalue >= ALPHA,
    }


def rejection_checks(report: Report, device: torch.device, rows: int) -> list[dict[str, Any]]:
    """Part 3: each toy model's checks, `rows` rounds each, every tensor the sampler reads on `device`."""
    out = []
    for V, k, seed in TOY_CONFIGS:
        p, q = toy_tables(V, k, seed, device)
        law = joint_law(p)
        gen = torch.Generator(device=device).manual_seed(seed)

        # Called within its iteration; the defaults bind this iteration's toy model for it.
        def verdict(
            name: str,
            drafts,
            num_draft,
            p_rows,
            q_rows,
            u_accept=None,
            expect_pass: bool = True,
            wrong: Callable[[VerifyResult], VerifyResult] | None = None,
            *,
            V=V,
            k=k,
            p=p,
            law=law,
            gen=gen,
        ) -> None:
            n = drafts.shape[0]
            u_accept = torch.rand(n, k, generator=gen, device=device) if u_accept is None else u_accept  # [n, k]
            u_sample = torch.rand(n, generator=gen, device=device)  # [n]
            result = rejection_sample(drafts, num_draft, p_rows, q_rows, u_accept, u_sample)
            result = result if wrong is None else wrong(result)
            stats = chi_square(completed_law(result, p, gen), law)
            stats |= {
                "check": name,
                "V": V,
                "k": k,
                "accepted_per_round": float(result.num_accepted.float().mean()),
                "expected_to_pass": expect_pass,
                "ok": stats["pass"] == expect_pass,
            }
            out.append(stats)
            line = (
                f"chi2 {stats['chi2']} on {stats['dof']} dof, p-value {stats['p_value']:.3g}, TV "
                f"{stats['total_variation']}, {stats['impossible']} impossible, "
                f"{stats['accepted_per_round']:.2f} accepted/round -> {'pass' if stats['pass'] else 'FAILS'}"
            )
            report.check(f"rejection V={V} k={k}: {name}{'' if expect_pass else ' (must fail)'}", stats["ok"], line)

        full = torch.full((rows,), k, dtype=torch.long, device=device)  # [rows]
        drafts, p_rows, q_rows = draft_rows(p, q, rows, True, gen)
        verdict("drafts sampled from q", drafts, full, p_rows, q_rows)
        verdict(
            "wrong sampler: accept always",
            drafts,
            full,
            p_rows,
            q_rows,
            u_accept=torch.zeros_like(q_rows[..., 0]),
            expect_pass=False,
        )
        verdict(
            "wrong sampler: residual ignored",
            drafts,
            full,
            p_rows,
            q_rows,
            expect_pass=False,
            wrong=lambda result, full=full, p_rows=p_rows, gen=gen: residual_ignored(result, full, p_rows, gen),
        )
        drafts, p_rows, _ = draft_rows(p, q, rows, False, gen)
        verdict("deterministic drafts, q None", drafts, full, p_rows, None)
        # A mixed batch: first half drafted from q, second half deterministic (one-hot q, as `target._dense_q` writes
        # it), each row with 0..k drafts (-1 past them). Each half's law is checked on its own rows.
        sampled, greedy = draft_rows(p, q, rows, True, gen), draft_rows(p, q, rows, False, gen)
        drafts, p_rows, q_rows = (torch.cat(pair) for pair in zip(sampled, greedy))  # [2 rows, ...]
        num_draft = torch.randint(0, k + 1, (2 * rows,), generator=gen, device=device)  # [2 rows]
        drafts = torch.where(torch.arange(k, device=device) < num_draft.unsqueeze(1), drafts, -1)
        u_accept = torch.rand(2 * rows, k, generator=gen, device=device)
        u_sample = torch.rand(2 * rows, generator=gen, device=device)
        result = rejection_sample(drafts, num_draft, p_rows, q_rows, u_accept, u_sample)
        for name, half in (
            ("mixed batch, sampled rows", slice(0, rows)),
            ("mixed batch, point-mass rows", slice(rows, 2 * rows)),
        ):
            part = VerifyResult(result.output_token_ids[half], result.num_accepted[half])
            stats = chi_square(completed_law(part, p, gen), law) | {"check": name, "V": V, "k": k}
            stats["ok"] = stats["pass"]
            out.append(stats)
            report.check(
                f"rejection V={V} k={k}: {name}",
                stats["ok"],
                f"chi2 {stats['chi2']} on {stats['dof']} dof, p-value {stats['p_value']:.3g}, "
                f"{stats['impossible']} impossible",
            )
    return out


# -- 4. the cost of verifying w tokens ------------------------------------------------------------------------------


def random_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Transformer:
    """A random-weight `Transformer` of `shape` (a Hugging Face config), built directly on `device` in `dtype`."""
    args = args_from_hf_config(shape)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in `dtype`; the RoPE table stays float32
    try:
        with torch.device(device):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def _forward_after_context(
    model: Transformer, widths: tuple[int, ...], context: int, device: torch.device
) -> Callable[[int], torch.Tensor]:
    """A forward of w new tokens (logits at all w, as a verify needs) after `context` cached ones."""
    args, attn = model.args, model.layers[0].self_attn
    dtype = model.embed_tokens.weight.dtype
    cache = KVCache(args.num_layers, 1, attn.num_kv_heads, context + max(widths) + 8, args.head_dim, dtype, device)
    ids = torch.randint(
        10, min(30000, model.vocab_size), (1, context + max(widths)), generator=torch.Generator().manual_seed(0)
    ).to(device)  # [1, context + max w]
    slots = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    model(
        ids[:, :context],
        torch.arange(context, device=device).view(1, -1),
        cache,
        slots,
        context,
        (0, 0),
        torch.tensor([[context - 1]], device=device),
    )

    def forward(w: int) -> torch.Tensor:  # [1, w, V]
        positions = (context + torch.arange(w, device=device)).view(1, w)  # [1, w]
        return model(ids[:, context : context + w], positions, cache, slots, context + w, (0, context))

    return forward


@torch.inference_mode()
def forward_ms(
    model: Transformer, widths: tuple[int, ...], context: int, repeats: int, device: torch.device
) -> dict[int, float]:
    """Median ms of a forward of w new tokens after `context` cached ones, launched from Python as the engine does."""
    forward = _forward_after_context(model, widths, context, device)

    for _ in range(3):
        for w in widths:
            forward(w)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(repeats):
        for w in widths:
            _sync(device)
            t0 = time.perf_counter()
            forward(w)
            _sync(device)
            times[w].append(time.perf_counter() - t0)
    return {w: 1000 * statistics.median(t) for w, t in times.items()}


@torch.inference_mode()
def replayed_ms(
    model: Transformer, widths: tuple[int, ...], context: int, repeats: int, device: torch.device
) -> dict[int, float]:
    """Median ms of the same forwards captured once as CUDA graphs and replayed: the device's own time for the step,
    without the launches from Python (each replay rewrites the same cache positions, which is all a timing needs)."""
    forward = _forward_after_context(model, widths, context, device)
    out: dict[int, float] = {}
    for w in widths:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up on the capturing stream, as torch's graph capture requires
                forward(w)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward(w)
        graph.replay()
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            graph.replay()
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[w] = 1000 * statistics.median(times)
        del graph
    return out


def verify_cost(report: Report, device: torch.device, quick: bool, context: int, repeats: int) -> dict[str, Any]:
    """Part 4: the target's forward of w tokens, and a draft step, on random weights (bfloat16 on CUDA)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_shape, draft_shape = (TINY_TARGET_SHAPE, TINY_DRAFT_SHAPE) if quick else (TARGET_SHAPE, DRAFT_SHAPE)
    t0 = time.perf_counter()
    target = random_model(target_shape, device, dtype)
    built = time.perf_counter() - t0
    target_ms = forward_ms(target, WIDTHS, context, repeats, device)
    graphs: dict[str, Any] = {}
    if device.type == "cuda":  # what the same steps cost the device itself, launched as one graph each
        try:
            graphs["target_ms"] = {
                str(w): round(ms, 4)
                for w, ms in replayed_ms(target, (1, 5, 9, 17, 65), context, repeats, device).items()
            }
        except Exception as exc:  # a measurement, not a check of the engine: reported, not failed
            graphs["error"] = f"{type(exc).__name__}: {exc}"
    del target
    draft = random_model(draft_shape, device, dtype)
    draft_ms = forward_ms(draft, (1,), context, repeats, device)[1]
    if device.type == "cuda" and "error" not in graphs:
        try:
            graphs["draft_ms"] = round(replayed_ms(draft, (1,), context, repeats, device)[1], 4)
        except Exception as exc:
            graphs["error"] = f"{type(exc).__name__}: {exc}"
    del draft
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ratio = draft_ms / target_ms[1]
    print(
        f"verify cost ({'tiny shapes' if quick else 'Qwen2.5-1.5B shape'}, {dtype}, context {context}, "
        f"medians of {repeats}; target built in {built:.1f} s):\n     w       ms   x w=1",
        flush=True,
    )
    for w, ms in target_ms.items():
        print(f"  {w:4d} {ms:8.3f} {ms / target_ms[1]:7.2f}", flush=True)
    print(
        f"  draft step ({'tiny' if quick else 'Qwen2.5-0.5B shape'}, w=1): {draft_ms:.3f} ms = {ratio:.3f} of a "
        "target step",
        flush=True,
    )
    if graphs:
        print(f"  replayed as CUDA graphs: {graphs}", flush=True)
    report.check("verify cost ran", True)
    return {
        "dtype": str(dtype),
        "context": context,
        "repeats": repeats,
        "target": target_shape,
        "draft": draft_shape,
        "target_ms": {str(w): round(ms, 4) for w, ms in target_ms.items()},
        "relative_to_w1": {str(w): round(ms / target_ms[1], 3) for w, ms in target_ms.items()},
        "draft_ms": round(draft_ms, 4),
        "draft_over_target_step": round(ratio, 4),
        "cuda_graphs": graphs,
    }


# -- main -----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (to develop on a CPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, required=True, help="where the JSON report goes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("highest")  # float32 exactness runs must not use TF32
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]
    max_tokens, prompts_used = (24, 3) if args.quick else (48, len(PROMPTS))
    rows = 100_000 if args.quick else 200_000
    context, repeats = (128, 5) if args.quick else (600, 20)

    report = Report()
    started = time.perf_counter()
    report.data["environment"] = environment(device, dtypes)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        models = build_tiny_models(Path(tmp))
        for dtype in dtypes:
            print(f"engine on the device, {dtype} ({max_tokens} tokens, k={K}):", flush=True)
            report.part(
                f"engine_{str(dtype).removeprefix('torch.')}",
                lambda dtype=dtype: engine_checks(report, device, dtype, models, max_tokens, prompts_used),
            )
    print(f"rejection sampling at temperature > 0 ({rows} rows per check, alpha {ALPHA}):", flush=True)
    report.part("rejection", lambda: rejection_checks(report, device, rows))
    report.part("verify_cost", lambda: verify_cost(report, device, args.quick, context, repeats))

    failed = report.failed
    report.data |= {"ok": not failed, "failed": failed, "seconds": round(time.perf_counter() - started, 1)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report.data, indent=1, default=str) + "\n")
    total = len(report.data["checks"])
    print(
        f"gpu_check on {report.data['environment']['device_name']}: "
        f"{'PASS' if not failed else 'FAIL'}, {total - len(failed)}/{total} checks passed in "
        f"{report.data['seconds']} s{'; failed: ' + ', '.join(failed) if failed else ''}",
        flush=True,
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
