"""What every model family is held to, against transformers' own implementation of it and against plain decoding:
shared by the per-family test modules (`test_families_*.py`), each with a tiny random model of its family."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from specdec_core.config import SamplingParams
from specdec_core.models.loader import LoadedModel
from specdec_core.request import Request
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import chi_square_p_value, make_engine, one_torch_thread, run_to_completion
from tests.specdec_core.test_statistical import PROMPT, _exact_law

TOKENS = [3, 77, 12, 5, 200, 41, 9, 150, 7, 7, 2]
PROMPTS = ["def add(a, b):", "The quick brown fox", "for index, value in enumerate(range(10)):\n    print("]
# fp32 on both sides: the only differences are the order of float operations (measured: below 1e-5).
LOGITS_TOLERANCE = 1e-4
# The sampled law: 3 tokens at temperature 1 and top-k 3 (27 outputs at most) after a prefill and one round of
# k = 2, over SAMPLES seeded requests; fewer than test_statistical.py's, enough to tell two nearby models apart.
SAMPLED = dict(temperature=1.0, top_k=3, top_p=1.0, max_tokens=3, ignore_eos=True)
SAMPLES = 1500


def our_logits(loaded: LoadedModel, tokens: list[int]) -> torch.Tensor:  # [T, V]
    """All positions' logits, in two extends (a prefill, then a verify-like call reading the cache)."""
    runner = ModelRunner(loaded.model, RunnerConfig(num_slots=1, max_seq_len=64))
    slot = runner.allocate()
    half = len(tokens) // 2
    first = runner.extend([slot], [tokens[:half]], all_logits=True)[0]
    return torch.cat([first, runner.extend([slot], [tokens[half:]], all_logits=True)[0]])


def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_logits_match_transformers(loaded: LoadedModel, hf: torch.nn.Module) -> None:
    with torch.inference_mode():
        expected = hf(torch.tensor([TOKENS])).logits[0]  # [T, V]
    torch.testing.assert_close(our_logits(loaded, TOKENS), expected, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE)


def assert_greedy_matches_generate(loaded: LoadedModel, hf: torch.nn.Module, new_tokens: int = 24) -> None:
    """Our plain greedy decoding, token for token, against transformers' `generate` (end of text suppressed on
    both sides, so every prompt runs `new_tokens` long)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for text in PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        ours, _, _ = run_to_completion(make_engine(loaded), [("r", ids, params, 0)])["r"]
        assert ours == out[0, len(ids) :].tolist(), text


def greedy_acceptance(target: LoadedModel, draft: torch.nn.Module, k: int | str = 3) -> float:
    """Greedy speculation with `draft` against plain decoding of `target`, every prompt: the outputs must be
    identical. Returns the acceptance rate (for the caller to check that drafts were neither all right nor all
    wrong: otherwise identity proves little)."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    proposed = accepted = 0
    with one_torch_thread():
        for text in PROMPTS:
            ids = target.tokenizer(text)["input_ids"]
            plain, _, _ = run_to_completion(make_engine(target), [("r", ids, params, 0)])["r"]
            tokens, _, last = run_to_completion(make_engine(target, draft), [("r", ids, params, k)])["r"]
            assert tokens == plain, text
            proposed, accepted = proposed + last.stats.proposed, accepted + last.stats.accepted
    return accepted / proposed


def sampled_counts(
    target: LoadedModel, draft: torch.nn.Module, prompt: list[int] = PROMPT
) -> tuple[dict[tuple[int, ...], int], float]:
    """Counts of each 3-token output of SAMPLES seeded requests after `prompt` speculating with `draft` (k = 2), and
    the acceptance rate."""
    with one_torch_thread():
        engine = make_engine(target, draft, num_slots=256, max_seq_len=64)
        for i in range(SAMPLES):
            engine.add_request(Request(str(i), tuple(prompt), SamplingParams(seed=i, **SAMPLED), 2))
        outputs: dict[str, list[int]] = {}
        proposed = accepted = 0
        while engine.has_work:
            for out in engine.step():
                outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
                if out.finished:
                    proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
    counts: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts, accepted / proposed


def assert_sampling_follows_the_target(target: LoadedModel, draft: torch.nn.Module) -> None:
    """The sampled outputs follow the target's exact law (chi-square), and the same counts reject the draft's law:
    at this sample size the test tells the two apart, so a loop that sampled from q, not p, would fail it."""
    counts, acceptance = sampled_counts(target, draft)
    assert 0.2 < acceptance < 0.95, acceptance  # drafts accepted sometimes: the residual and bonus paths both run
    num = SAMPLED["max_tokens"]
    assert chi_square_p_value(counts, _exact_law(target, num, SAMPLED), SAMPLES) > 1e-3
    assert chi_square_p_value(counts, _exact_law(SimpleNamespace(model=draft), num, SAMPLED), SAMPLES) < 1e-6
