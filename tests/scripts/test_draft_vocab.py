"""scripts/draft_vocab.py: agreement under a cut head against a loop over positions, and the paired timing on the
tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.kernels import cpu
from tests.scripts import scripts_loaded


def test_agreement_counts_the_positions_whose_best_scored_id_is_the_targets():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 8, generator=gen), torch.randn(50, 8, generator=gen)
    logits = hidden @ weight.T
    targets = logits.argmax(-1)  # the whole head agrees everywhere
    contexts = [[int(t)] if p % 2 else [] for p, t in enumerate(targets)]  # odd positions saw their target's id
    keep, always = 10, [49]
    with scripts_loaded("draft_vocab") as (script,):
        whole = script.agreement(hidden, weight, targets, contexts, None, always, False)
        alone = script.agreement(hidden, weight, targets, contexts, keep, always, False)
        widened = script.agreement(hidden, weight, targets, contexts, keep, always, True)
    inside = [t < keep or t == 49 for t in targets.tolist()]
    assert whole == 1.0
    assert alone == pytest.approx(sum(inside) / 40)  # the argmax over all ids is the best over any set holding it
    assert widened == pytest.approx(sum(i or p % 2 == 1 for p, i in enumerate(inside)) / 40)
    assert alone < widened < 1.0


@pytest.mark.skipif(cpu.load_library() is None, reason="the int4 draft needs the CPU kernels")
def test_the_timing_alternates_a_whole_and_a_cut_head(tiny_dir, tmp_path):
    out = tmp_path / "vocab.json"
    with scripts_loaded("draft_vocab") as (script,):
        assert script.main(["--draft", str(tiny_dir / "target"), "--timing", "--keep", "128", "--context", "20",
                            "--repeats", "3", "--threads", "1", "--json", str(out)]) == 0
    timing = json.loads(out.read_text())["timing"]
    assert timing["keep"] == 128 and timing["context_ids_scored"] > 0
    assert timing["whole_ms"] > 0 and timing["cut_ms"] > 0 and timing["paired_ratio"] > 0
