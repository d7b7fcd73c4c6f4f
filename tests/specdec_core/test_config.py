"""TokenShaping: validated as SamplingParams' shaping fields are, and what a request's settings give the workers."""

from __future__ import annotations

import pytest

from specdec_core.config import MAX_TEMPERATURE, MAX_TOP_K, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, TokenShaping
from specdec_core.errors import InvalidArgument

BAD_SHAPING = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": 2**40}, "top_k"),  # past int32: no wire or tensor index need carry it
    ({"top_p": 1e-50}, "top_p"),  # 0 in the sampler's float32: it would keep no token
    ({"top_p": MIN_TOP_P / 2}, "top_p"),
    ({"temperature": 1e39}, "temperature"),  # inf in float32
]


@pytest.mark.parametrize("kwargs, field", BAD_SHAPING)
def test_bad_shaping_is_refused_by_both_types_naming_the_field(kwargs, field):
    for kind in (TokenShaping, SamplingParams):
        with pytest.raises(InvalidArgument) as err:
            kind(**kwargs)
        assert err.value.field == field, kind


def test_sampling_params_give_their_shaping_and_nothing_else():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3, max_tokens=5, stop=("x",))
    assert params.shaping == TokenShaping(temperature=0.7, top_p=0.9, top_k=40)
    assert SamplingParams().shaping == TokenShaping()


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (MIN_TEMPERATURE, False), (1.0, False)])
def test_greedy_is_temperature_zero(temperature, greedy):
    assert TokenShaping(temperature=temperature).greedy is greedy
    assert SamplingParams(temperature=temperature).shaping.greedy is greedy


def test_the_bounds_are_accepted_and_mean_the_same_in_float32():
    """The sampler holds temperature and top_p as float32: at each bound float32 keeps the value exactly."""
    import numpy as np

    shaping = TokenShaping(temperature=MAX_TEMPERATURE, top_p=MIN_TOP_P, top_k=MAX_TOP_K)
    assert float(np.float32(shaping.top_p)) == MIN_TOP_P and np.isfinite(np.float32(shaping.temperature))
    assert SamplingParams(top_p=MIN_TOP_P, top_k=MAX_TOP_K).shaping == TokenShaping(top_p=MIN_TOP_P, top_k=MAX_TOP_K)
