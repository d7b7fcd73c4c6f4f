"""Wire <-> engine conversions: exact where exactness matters, errors that name the field."""

from __future__ import annotations

import pytest
import torch

from deployments import codec
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2 as wpb
from specdec_core.config import AUTO, MIN_TEMPERATURE, SamplingParams, TokenShaping
from specdec_core.errors import InvalidArgument
from specdec_core.sparse_q import SparseQ
from specdec_core.target import VerifyItem


def _sparse_q(k: int, vocab: int, support: int, seed: int = 0) -> SparseQ:
    """A drafter's q: `support` ids per position, ascending, one row padded (probability 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:support].sort().values for _ in range(k)])  # [k, n]
    probs = torch.softmax(torch.randn(k, support, generator=gen), dim=-1)  # [k, n]
    probs[-1, -2:] = 0  # the last position has two entries fewer: padding
    return SparseQ(ids, probs)


def test_draft_distributions_cross_the_wire_exactly_and_stay_sparse():
    q = _sparse_q(3, 50, 10)
    item = VerifyItem("s", 4, [1, 2, 3], q, TokenShaping(temperature=0.7, top_k=5), torch.rand(3, dtype=torch.float64), 0.25)
    message = codec.encode_verify([item])
    assert [len(row.token_ids) for row in message.items[0].q] == [10, 10, 8]  # padding is not sent
    back = codec.decode_verify(message, vocab_size=50)[0]
    assert isinstance(back.q, SparseQ) and back.q.token_ids.shape == (3, 10)  # not [3, V]
    assert torch.equal(back.q.dense(50), q.dense(50))
    assert torch.equal(back.uniform_accept, item.uniform_accept) and back.uniform_sample == 0.25
    assert (back.shaping.temperature, back.shaping.top_k) == (pytest.approx(0.7), 5)
    assert back.draft_token_ids == [1, 2, 3] and back.last_token_id == 4


def test_the_router_passes_q_on_as_it_came():
    """Draft worker -> router (decode_proposal) -> target worker (encode_verify): the same bytes, never dense."""
    from specdec_core.drafters.base import Proposal

    sent = codec.encode_proposal(Proposal([5, 6, 7], _sparse_q(3, 1000, 16), None))
    proposal = codec.decode_proposal(sent, vocab_size=1000, return_probs=False)
    assert proposal.q.token_ids.shape == (3, 16)
    item = VerifyItem("s", 4, proposal.token_ids, proposal.q, TokenShaping(temperature=1.0), torch.rand(3), 0.5)
    assert list(codec.encode_verify([item]).items[0].q) == list(sent.q)


@pytest.mark.parametrize(
    "row",
    [
        wpb.SparseDistribution(token_ids=[1, 2], probs=[1.0]),  # mismatched
        wpb.SparseDistribution(token_ids=[1, 50], probs=[0.5, 0.5]),  # outside the vocabulary
    ],
)
def test_bad_draft_distributions_are_refused_naming_q(row):
    message = wpb.VerifyRequest()
    item = message.items.add(seq_id="s", last_token_id=1, draft_token_ids=[1], uniform_accept=[0.5],
                             uniform_sample=0.5)
    item.sampling.temperature = 1.0
    item.q.append(row)
    with pytest.raises(InvalidArgument) as err:
        codec.decode_verify(message, vocab_size=50)
    assert err.value.field == "q"
    with pytest.raises(InvalidArgument) as err:
        codec.decode_proposal(wpb.Proposal(token_ids=[1], q=[row]), vocab_size=50, return_probs=False)
    assert err.value.field == "q"


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
        ({"prompt": "hi", "messages": [pb.ChatMessage(role="user", content="x")]}, "prompt"),
        ({"prompt_token_ids": [1], "messages": [pb.ChatMessage(role="user", content="x")]}, "prompt_token_ids"),
        ({"messages": [pb.ChatMessage(role="robot", content="x")]}, "messages.role"),
        ({"messages": [pb.ChatMessage(role="user", content="x")], "raw_prompt": True}, "raw_prompt"),
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


def test_cache_salts_and_cached_counts_cross_to_the_workers_and_back():
    from specdec_core.target import Prefilled, PrefillItem

    items = [PrefillItem("a", [1, 2, 3], TokenShaping(), None, "tenant-1"), PrefillItem("b", [4, 5], TokenShaping(), None)]
    back = codec.decode_prefill(wpb.PrefillRequest.FromString(codec.encode_prefill(items).SerializeToString()))
    assert [item.cache_salt for item in back] == ["tenant-1", None]  # no salt stays the shared namespace
    results = [Prefilled(7, 2), Prefilled(9, 0)]
    assert codec.decode_prefilled(codec.encode_prefilled(results)) == results
    assert codec.decode_prefilled(wpb.PrefillResponse(first_token_ids=[7])) == [Prefilled(7, 0)]  # an older worker
    start = codec.decode_start(codec.encode_start("s", [1, 2, 3], "tenant-1"))
    assert start == [codec.StartItem("s", [1, 2, 3], "tenant-1")]
    assert codec.decode_start(codec.encode_start("s", [1], None))[0].cache_salt is None
    assert codec.decode_started(wpb.StartResponse(cached_tokens=[5]), 1) == [5]
    assert codec.decode_started(wpb.StartResponse(), 1) == [0]
    with pytest.raises(InvalidArgument) as err:
        codec.decode_generate(pb.GenerateRequest(prompt="x", cache_salt="s" * 257), 1)
    assert err.value.field == "cache_salt"


def test_a_constrained_row_is_refused_rather_than_sent_without_its_masks():
    """The wire has no field for a grammar's masks yet: encoding one must fail, never drop them."""
    import numpy as np

    from specdec_core.grammar.bits import PackedMasks
    from specdec_core.target import PrefillItem

    masks = PackedMasks(np.ones((1, 13), dtype=np.uint32), 400)
    for encode, item in [(codec.encode_prefill, PrefillItem("a", [1, 2], TokenShaping(), None, allowed=masks)),
                         (codec.encode_verify, VerifyItem("a", 1, [], None, TokenShaping(), None, None,
                                                          allowed=masks))]:
        with pytest.raises(InvalidArgument) as err:
            encode([item])
        assert err.value.field == "constraint"
