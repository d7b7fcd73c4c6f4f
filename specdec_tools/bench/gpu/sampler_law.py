"""Part 3, the rejection sampler's law: `rejection.rejection_sample` on the device over toy models (V tokens, k
drafts, p and q depending on the prefix). A round's output, completed to k + 1 tokens by sampling from p, must have
p's joint law (Leviathan et al. 2023, Theorem 1): a chi-square test (`chi_square.py`) over many rows, for drafts
sampled from q (dense q), deterministic drafts (q None), and a mixed batch (sampled rows with q beside point-mass
rows with one-hot q, 0..k drafts per row). Two wrong samplers must FAIL the same test, or the test proves nothing:
"accept always" (the same function, every acceptance uniform 0) and "residual ignored" (its output with the token
after a rejection redrawn from p, not from max(0, p - q))."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from specdec_core.rejection import VerifyResult, rejection_sample
from specdec_tools.bench.gpu.chi_square import ALPHA, chi_square, completed_law, joint_law
from specdec_tools.bench.gpu.report import Report

TOY_CONFIGS = ((4, 2, 21), (5, 3, 12))  # (V, k, seed) of each toy model


@dataclass(frozen=True)
class Toy:
    """A toy model on the device: p and q per level (level j is [V**j, V], the law of token j after each prefix,
    the prefix as a base-V code, first token most significant), p's joint law, and the generator every draw uses."""

    V: int
    k: int
    p: list[torch.Tensor]
    q: list[torch.Tensor]
    law: torch.Tensor  # [V**(k+1)] float64
    gen: torch.Generator


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


def toy(V: int, k: int, seed: int, device: torch.device) -> Toy:
    p, q = toy_tables(V, k, seed, device)
    return Toy(V, k, p, q, joint_law(p), torch.Generator(device=device).manual_seed(seed))


def verdict(
    report: Report,
    model: Toy,
    name: str,
    result: VerifyResult,
    expect_pass: bool = True,
) -> dict[str, Any]:
    """The chi-square test of `result`'s rounds against the toy's law, as a check that passes when the test's
    verdict is the one expected (a wrong sampler must fail it)."""
    stats = chi_square(completed_law(result, model.p, model.gen), model.law)
    stats |= {
        "check": name,
        "V": model.V,
        "k": model.k,
        "accepted_per_round": float(result.num_accepted.float().mean()),
        "expected_to_pass": expect_pass,
        "ok": stats["pass"] == expect_pass,
    }
    line = (
        f"chi2 {stats['chi2']} on {stats['dof']} dof, p-value {stats['p_value']:.3g}, TV "
        f"{stats['total_variation']}, {stats['impossible']} impossible, "
        f"{stats['accepted_per_round']:.2f} accepted/round -> {'pass' if stats['pass'] else 'FAILS'}"
    )
    report.check(f"rejection V={model.V} k={model.k}: {name}{'' if expect_pass else ' (must fail)'}", stats["ok"], line)
    return stats


def sample(
    model: Toy,
    drafts: torch.Tensor,  # [n, k], -1 past a row's drafts
    num_draft: torch.Tensor,  # [n]
    p_rows: torch.Tensor,  # [n, k+1, V]
    q_rows: torch.Tensor | None,  # [n, k, V]
    u_accept: torch.Tensor | None = None,  # [n, k]; None: uniform draws
) -> VerifyResult:
    """`rejection_sample` with its randomness drawn from the toy's generator."""
    n, device = drafts.shape[0], drafts.device
    u_accept = torch.rand(n, model.k, generator=model.gen, device=device) if u_accept is None else u_accept
    u_sample = torch.rand(n, generator=model.gen, device=device)  # [n]
    return rejection_sample(drafts, num_draft, p_rows, q_rows, u_accept, u_sample)


def full_rounds(report: Report, model: Toy, rows: int) -> list[dict[str, Any]]:
    """Rows of k drafts each: sampled from q, then the two wrong samplers on them, then deterministic drafts."""
    device = model.p[0].device
    full = torch.full((rows,), model.k, dtype=torch.long, device=device)  # [rows]
    drafts, p_rows, q_rows = draft_rows(model.p, model.q, rows, True, model.gen)
    out = [verdict(report, model, "drafts sampled from q", sample(model, drafts, full, p_rows, q_rows))]
    accept_always = sample(model, drafts, full, p_rows, q_rows, u_accept=torch.zeros_like(q_rows[..., 0]))
    out.append(verdict(report, model, "wrong sampler: accept always", accept_always, expect_pass=False))
    residual = residual_ignored(sample(model, drafts, full, p_rows, q_rows), full, p_rows, model.gen)
    out.append(verdict(report, model, "wrong sampler: residual ignored", residual, expect_pass=False))
    drafts, p_rows, _ = draft_rows(model.p, model.q, rows, False, model.gen)
    out.append(verdict(report, model, "deterministic drafts, q None", sample(model, drafts, full, p_rows, None)))
    return out


def mixed_batch(report: Report, model: Toy, rows: int) -> list[dict[str, Any]]:
    """First half drafted from q, second half deterministic (one-hot q, as `target._dense_q` writes it), each row
    with 0..k drafts (-1 past them), in one call. Each half's law is checked on its own rows."""
    device, gen = model.p[0].device, model.gen
    sampled, greedy = draft_rows(model.p, model.q, rows, True, gen), draft_rows(model.p, model.q, rows, False, gen)
    drafts, p_rows, q_rows = (torch.cat(pair) for pair in zip(sampled, greedy))  # [2 rows, ...]
    num_draft = torch.randint(0, model.k + 1, (2 * rows,), generator=gen, device=device)  # [2 rows]
    drafts = torch.where(torch.arange(model.k, device=device) < num_draft.unsqueeze(1), drafts, -1)
    result = sample(model, drafts, num_draft, p_rows, q_rows)
    halves = (("mixed batch, sampled rows", slice(0, rows)), ("mixed batch, point-mass rows", slice(rows, 2 * rows)))
    return [
        verdict(report, model, name, VerifyResult(result.output_token_ids[half], result.num_accepted[half]))
        for name, half in halves
    ]


def rejection_checks(report: Report, device: torch.device, rows: int) -> list[dict[str, Any]]:
    """Part 3: each toy model's checks, `rows` rounds each, every tensor the sampler reads on `device`."""
    print(f"rejection sampling at temperature > 0 ({rows} rows per check, alpha {ALPHA}):", flush=True)
    out = []
    for V, k, seed in TOY_CONFIGS:
        model = toy(V, k, seed, device)
        out += full_rounds(report, model, rows)
        out += mixed_batch(report, model, rows)
    return out
