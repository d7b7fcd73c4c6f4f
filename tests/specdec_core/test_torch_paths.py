"""Greedy exactness where the CPU kernels do not run: torch's own code paths (SPECDEC_DISABLE_CPU_KERNELS, float32,
or bfloat16 on a CPU without the kernels).

There, nothing makes a verify of k + 1 rows round each row as a one-row decode does: torch picks its matmul and
attention kernels by shape, and they sum in different orders. What holds, and what these tests assert:

- the logits of a multi-row verify differ from one-row decodes by rounding only: at most `REL_BOUND[dtype]` of the
  largest logit (measured on the tiny pair: about 1.5e-6 in float32, 6e-3 in bfloat16);
- greedy speculative output therefore equals plain greedy output except where the target's top two tokens are
  within twice that bound of each other (a near-tie that rounding may flip); on the tiny pair in float32 no
  margin is that small, and the outputs are identical.

Each test reports what it measured (`record_property`, and printed with `-s`).
"""

from __future__ import annotations

import pytest
import torch

from specdec_core.build import prepare_model
from specdec_core.config import SamplingParams
from specdec_core.kernels import library, report
from specdec_core.runner import ModelRunner, RunnerConfig
from tests.helpers import make_engine, run_to_completion

DTYPES = ["float32", "bfloat16"]
# |verify - decode| over max |logit|: rounding differences are a few units in the last place; a wrong position,
# mask or cache row would be of the order of 1.
REL_BOUND = {"float32": 1e-4, "bfloat16": 5e-2}
NUM_PROMPTS, MAX_TOKENS, K = 24, 48, 3


@pytest.fixture(scope="module")
def torch_models(tiny_dir, near_draft_dir):
    """{dtype: (target, draft)} built by `prepare_model` with the kernel switch off: torch's code paths."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_DISABLE_CPU_KERNELS", "1")
        library.load_library.cache_clear()  # it caches the machine's answer; the switch is read when it loads
        try:
            models = {
                dtype: (prepare_model(tiny_dir / "target", dtype=dtype), prepare_model(near_draft_dir, dtype=dtype))
                for dtype in DTYPES
            }
            for target, _draft in models.values():
                assert report.kernel_path(target.model).startswith("torch fallback")
                assert not report.rows_batch_invariant(target.model)
        finally:
            library.load_library.cache_clear()
    return models


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 384, (4 + 3 * i,), generator=gen).tolist() for i in range(n)]


def _decode_path_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    """What plain decoding computes: the prompt's prefill, then `tokens` one row at a time; the logits after each."""
    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=256))
    slot = runner.allocate()
    runner.extend([slot], [prompt])
    return torch.stack([runner.extend([slot], [[t]])[0] for t in tokens])


def _verify_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    """What a verify computes: the prompt's prefill, then `tokens` in one forward; the logits at each."""
    runner = ModelRunner(model, RunnerConfig(num_slots=1, max_seq_len=256))
    slot = runner.allocate()
    runner.extend([slot], [prompt])
    return runner.extend([slot], [tokens], all_logits=True)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_differ_from_decode_rows_by_rounding_only(torch_models, dtype, record_property):
    target, _ = torch_models[dtype]
    gen = torch.Generator().manual_seed(5)
    worst, equal_rows, rows = 0.0, 0, 0
    for prompt in _prompts(NUM_PROMPTS):
        tail = torch.randint(3, 384, (K + 1,), generator=gen).tolist()
        decoded = _decode_path_logits(target.model, prompt, tail)
        verified = _verify_logits(target.model, prompt, tail)
        scale = decoded.abs().max().item()
        worst = max(worst, (verified - decoded).abs().max().item() / scale)
        equal_rows += sum(torch.equal(a, b) for a, b in zip(decoded, verified))
        rows += len(tail)
    record_property("max_relative_logit_difference", worst)
    record_property("bit_equal_rows", f"{equal_rows}/{rows}")
    print(f"{dtype}: verify vs decode, max |diff| / max |logit| = {worst:.3g}, bit-equal rows {equal_rows}/{rows}")
    assert worst <= REL_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_speculation_differs_from_plain_only_at_near_ties(torch_models, dtype, record_property):
    target, draft = torch_models[dtype]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    divergences, accepted = [], 0
    for prompt in _prompts(NUM_PROMPTS):
        plain = run_to_completion(make_engine(target), [("r", prompt, params, 0)])["r"][0]
        tokens, _, last = run_to_completion(make_engine(target, draft.model), [("r", prompt, params, K)])["r"]
        accepted += last.stats.accepted
        assert len(tokens) == len(plain) == MAX_TOKENS
        at = next((i for i, (a, b) in enumerate(zip(plain, tokens)) if a != b), None)
        if at is None:
            continue
        assert at > 0  # both prefill the prompt alike: the first token cannot differ
        logits = _decode_path_logits(target.model, prompt, plain[:at])[-1]  # [V]: what plain decoding chose from
        assert int(logits.argmax()) == plain[at]
        margin = (logits[plain[at]] - logits[tokens[at]]).item()
        divergences.append((at, margin, margin / logits.abs().max().item()))
    record_property("diverging_prompts", f"{len(divergences)}/{NUM_PROMPTS}")
    record_property("divergences", divergences)
    print(
        f"{dtype}: {len(divergences)}/{NUM_PROMPTS} prompts diverge; (position, margin, relative margin): {divergences}"
    )
    assert accepted > 0  # speculation ran
    for _, _, relative in divergences:
        # Speculation took a token that trails plain decoding's by less than both paths' rounding together.
        assert relative <= 2 * REL_BOUND[dtype]
    if dtype == "float32":
        assert not divergences  # no near-tie on the tiny pair is as close as float32 rounding


def test_float32_names_its_torch_path(tiny_target):
    assert report.kernel_path(tiny_target.model) == "torch fallback (float32: the kernels are bf16)"
    assert not report.rows_batch_invariant(tiny_target.model)
