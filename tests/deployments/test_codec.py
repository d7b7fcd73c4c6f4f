"""Wire <-> engine conversions: exact where exactness matters, errors that name the field."""

from __future__ import annotations

import pytest
import torch

from deployments import codec
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2 as wpb
from specdec_core.config import AUTO, MIN_TEMPERATURE, SamplingParams, TokenShaping
from specdec_core.errors import InvalidArgument
from specdec_core.target import VerifyItem


def test_draft_distributions_cross_the_wire_exactly():
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(3, 50), dim=-1)
    q[:, 10:] = 0  # sparse, as the drafter sends them
    q = q / q.sum(-1, keepdim=True)
    item = VerifyItem("s", 4, [1, 2, 3], q, TokenShaping(temperature=0.7, top_k=5), torch.rand(3, dtype=torch.float64), 0.25)
    back = codec.decode_verify(codec.encode_verify([item]), vocab_size=50)[0]
    assert torch.equal(back.q, q)
    assert torch.equal(back.uniform_accept, item.uniform_accept) and back.uniform_sample == 0.25
    assert (back.shaping.temperature, back.shaping.top_k) == (pytest.approx(0.7), 5)
    assert back.draft_token_ids == [1, 2, 3] and back.last_token_id == 4


def test_proposal_labels_cross_the_wire():
    from specdec_core.drafters.base import Proposal

    for label in ("ngram-3", None):
        back = codec.decode_proposal(codec.encode_proposal(Proposal([7, 8], None, label=label)), 50, False)
        assert back.label == label and back.token_ids == [7, 8]


@pytest.mark.parametrize(
    "request_kwargs, field",
    [
        ({}, "prompt"),
        ({"prompt": "hi", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=-1)}, "sampling.temperature"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(temperature=1e-45)}, "sampling.temperature"),  # overflows
        ({"prompt": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
        ({"prompt": "hi", "sampling": pb.SamplingParams(max_tokens=0)}, "sampling.max_tokens"),
    ],
)
def test_bad_requests_name_the_field(request_kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        codec.decode_generate(pb.GenerateRequest(**request_kwargs), default_max_tokens=16)
    assert err.value.field == field


def test_the_smallest_temperature_survives_both_float32_hops():
    """Client -> router and router -> worker each carry temperature as a float32: MIN_TEMPERATURE passes both."""
    message = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=MIN_TEMPERATURE))
    call = codec.decode_generate(message, default_max_tokens=16)
    worker = codec.decode_token_sampling(codec.encode_token_sampling(call.params.shaping))
    assert worker.temperature == call.params.temperature >= MIN_TEMPERATURE


def test_workers_get_the_token_shaping_only():
    """What a worker decodes is a TokenShaping (no made-up max_tokens or seed); proto3's unset top_p is off."""
    shaping = TokenShaping(temperature=0.5, top_p=0.75, top_k=7)
    assert codec.decode_token_sampling(codec.encode_token_sampling(shaping)) == shaping
    assert codec.decode_token_sampling(codec.encode_token_sampling(TokenShaping())) == TokenShaping()
    with pytest.raises(InvalidArgument) as err:
        codec.decode_token_sampling(wpb.TokenSampling(temperature=-1.0))
    assert err.value.field == "sampling.temperature"


def test_defaults_and_speculation_options():
    call = codec.decode_generate(pb.GenerateRequest(prompt="x"), default_max_tokens=33)
    assert call.params == SamplingParams(max_tokens=33) and call.num_speculative_tokens is None
    off = pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(num_speculative_tokens=0))
    assert codec.decode_generate(off, 1).num_speculative_tokens == 0
    auto = pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(adaptive=True))
    assert codec.decode_generate(auto, 1).num_speculative_tokens == AUTO


def test_engine_errors_are_named_as_request_fields():
    from deployments.codec import in_request_terms

    assert in_request_terms(InvalidArgument("max_tokens", "too many")).field == "sampling.max_tokens"
    assert str(in_request_terms(InvalidArgument("num_speculative_tokens", "x"))).startswith("speculation.")
    same = InvalidArgument("prompt", "empty")
    assert in_request_terms(same) is same
