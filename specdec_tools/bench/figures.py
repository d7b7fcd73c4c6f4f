"""What the in-process side-by-side benchmarks (`bench methods`, `bench structured`) report alike: their run's
settings, and speedups of every mode over the baseline mode measured in the same run."""

from __future__ import annotations

from typing import Any


def ratio(a: float, b: float) -> float | None:
    """a / b; None where b is 0 (a group without decode time, say)."""
    return a / b if b else None


def add_speedups(figures: dict[str, dict[str, dict[str, Any]]], baseline: str) -> None:
    """Give every mode's figures, per group ({mode: {group: figures}}), its `speedup` and `decode_speedup` over
    `baseline`'s in the same group."""
    for groups in figures.values():
        for group, row in groups.items():
            base = figures[baseline][group]
            row["speedup"] = ratio(row["tokens_per_s"], base["tokens_per_s"])
            row["decode_speedup"] = ratio(row["decode_tokens_per_s"], base["decode_tokens_per_s"])


def run_settings(config: Any) -> dict[str, Any]:
    """The settings every such report opens with (`config`: the benchmark's config, which has these fields)."""
    return {
        name: getattr(config, name)
        for name in (
            "target",
            "draft",
            "draft_quantization",
            "draft_vocabulary",
            "dtype",
            "device",
            "temperature",
            "seed",
            "max_new_tokens",
            "num_speculative_tokens",
            "max_seq_len",
        )
    }
