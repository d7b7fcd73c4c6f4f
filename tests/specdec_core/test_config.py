"""TokenShaping: validated as SamplingParams' shaping fields are, and what a request's settings give the workers."""

from __future__ import annotations

import pytest

from specdec_core.config import MIN_TEMPERATURE, SamplingParams, TokenShaping
from specdec_core.errors import InvalidArgument

BAD_SHAPING = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
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
