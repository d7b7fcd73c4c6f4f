"""How a run's greedy rows compare with plain decoding's: identical, or where each first diverges and whether the
target's logits there make it a near tie (its two best logits closer than rounding decides); and, graphs on, with
the same method's run with graphs off too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specdec_core.models.loader import LoadedModel
from specdec_core.runner import ModelRunner, RunnerConfig
from specdec_tools.bench.gpu.engines import RUNNER

# A divergence from plain decoding is a near tie when both tokens are the target's two best and their logits differ
# by less than this fraction of the best: rounding, not the engine, decides such a token.
TIE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


def divergence(
    target: LoadedModel, prompt: list[int], plain: list[int], spec: list[int], dtype: torch.dtype
) -> dict[str, Any]:
    """Where `spec` first leaves `plain`, and whether the target's logits there make it a near tie."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if i >= min(len(plain), len(spec)):
        return {"position": i, "near_tie": False, "lengths": [len(plain), len(spec)]}
    assert target.model is not None  # a LoadedModel always carries its weights
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


@dataclass(frozen=True)
class GraphsVerdict:
    """Graphs-on tokens against graphs-off tokens and plain decoding's, over the greedy rows."""

    vs_plain: tuple[str, ...]  # rows whose graphs-on tokens differ from plain decoding's
    vs_graphs_off: tuple[str, ...]  # rows whose graphs-on tokens differ from the same method's, graphs off
    near_ties_only: bool  # rows differ, each first at a near tie of the target's logits

    @property
    def identical(self) -> bool:
        return not self.vs_plain and not self.vs_graphs_off

    @property
    def ok(self) -> bool:
        """Equal token for token, or apart only at near ties: a captured forward reads every key of a row's slot,
        masked, where an eager one reads its length, so its sums may round apart at a tie in any dtype."""
        return self.identical or self.near_ties_only


def graphs_verdict(
    plain: dict[str, dict[str, Any]],
    off: dict[str, dict[str, Any]],
    on: dict[str, dict[str, Any]],
    near_tie: Callable[[str, list[int], list[int]], bool],
) -> GraphsVerdict:
    """Compare the greedy rows (`plain`'s ids) of a graphs-on run `on` with plain decoding and with the same
    method's graphs-off run `off`. `near_tie(seq_id, expected, got)`: whether `got` first leaves `expected` at a
    near tie (`divergence`)."""
    vs_plain = tuple(s for s, row in plain.items() if on[s]["tokens"] != row["tokens"])
    vs_off = tuple(s for s in plain if on[s]["tokens"] != off[s]["tokens"])
    ties = all(near_tie(s, plain[s]["tokens"], on[s]["tokens"]) for s in vs_plain) and all(
        near_tie(s, off[s]["tokens"], on[s]["tokens"]) for s in vs_off
    )
    return GraphsVerdict(vs_plain, vs_off, bool(vs_plain or vs_off) and ties)
