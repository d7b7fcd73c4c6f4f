"""The workers' protocol's codec (router <-> workers): exact where exactness matters, errors that name the field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments import generation_codec, worker_codec
from specdec.v1 import generation_pb2 as pb
from specdec.v1 import worker_pb2 as wpb
from specdec_core.config import MIN_TEMPERATURE, MIN_TOP_P, TokenShaping
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.bits import PackedMasks
from specdec_core.sparse_q import SparseQ
from specdec_core.target import PrefillItem, VerifyItem


def _sparse_q(k: int, vocab: int, support: int, seed: int = 0) -> SparseQ:
    """A drafter's q: `support` ids per position, ascending, one row padded (probability 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:support].sort().values for _ in range(k)])  # [k, n]
    probs = torch.softmax(torch.randn(k, support, generator=gen), dim=-1)  # [k, n]
    probs[-1, -2:] = 0  # the last position has two entries fewer: padding
    return SparseQ(ids, probs)


def test_draft_distributions_cross_the_wire_exactly_and_stay_sparse():
    q = _sparse_q(3, 50, 10)
    item = VerifyItem(
        "s", 4, [1, 2, 3], q, TokenShaping(temperature=0.7, top_k=5), torch.rand(3, dtype=torch.float64), 0.25
    )
    message = worker_codec.encode_verify([item])
    assert [len(row.token_ids) for row in message.items[0].q] == [10, 10, 8]  # padding is not sent
    back = worker_codec.decode_verify(message, vocab_size=50)[0]
    assert isinstance(back.q, SparseQ) and back.q.token_ids.shape == (3, 10)  # not [3, V]
    assert torch.equal(back.q.dense(50), q.dense(50))
    assert torch.equal(back.uniform_accept, item.uniform_accept) and back.uniform_sample == 0.25
    assert (back.shaping.temperature, back.shaping.top_k) == (pytest.approx(0.7), 5)
    assert back.draft_token_ids == [1, 2, 3] and back.last_token_id == 4


def test_the_router_passes_q_on_as_it_came():
    """Draft worker -> router (decode_proposal) -> target worker (encode_verify): the same bytes, never dense."""
    from specdec_core.drafters.base import Proposal

    sent = worker_codec.encode_proposal(Proposal([5, 6, 7], _sparse_q(3, 1000, 16), None))
    proposal = worker_codec.decode_proposal(sent, vocab_size=1000, return_probs=False)
    assert proposal.q.token_ids.shape == (3, 16)
    item = VerifyItem("s", 4, proposal.token_ids, proposal.q, TokenShaping(temperature=1.0), torch.rand(3), 0.5)
    assert list(worker_codec.encode_verify([item]).items[0].q) == list(sent.q)


@pytest.mark.parametrize(
    "row",
    [
        wpb.SparseDistribution(token_ids=[1, 2], probs=[1.0]),  # mismatched
        wpb.SparseDistribution(token_ids=[1, 50], probs=[0.5, 0.5]),  # outside the vocabulary
    ],
)
def test_bad_draft_distributions_are_refused_naming_q(row):
    message = wpb.VerifyRequest()
    item = message.items.add(seq_id="s", last_token_id=1, draft_token_ids=[1], uniform_accept=[0.5], uniform_sample=0.5)
    item.sampling.temperature = 1.0
    item.q.append(row)
    with pytest.raises(InvalidArgument) as err:
        worker_codec.decode_verify(message, vocab_size=50)
    assert err.value.field == "q"
    with pytest.raises(InvalidArgument) as err:
        worker_codec.decode_proposal(wpb.Proposal(token_ids=[1], q=[row]), vocab_size=50, return_probs=False)
    assert err.value.field == "q"


def test_proposal_labels_cross_the_wire():
    from specdec_core.drafters.base import Proposal

    for label in ("ngram-3", None):
        sent = worker_codec.encode_proposal(Proposal([7, 8], None, label=label))
        back = worker_codec.decode_proposal(sent, 50, False)
        assert back.label == label and back.token_ids == [7, 8]


def test_a_pre_drafts_alternatives_cross_the_wire():
    """Asked for (`num_alternatives`, with the assumed drafts) and returned (each rejection branch with its
    position, guessed token and drafts)."""
    from specdec_core.drafters.base import Alternative, DraftRequest, Proposal

    request = DraftRequest("s", [1, 2, 3, 9, 8], 4, TokenShaping(), None, num_assumed=2, num_alternatives=3)
    item = worker_codec.encode_propose_item(request, [3])
    back = worker_codec.decode_propose_item(item, [1, 2, 3])
    assert (back.token_ids, back.num_assumed, back.num_alternatives) == ([1, 2, 3, 9, 8], 2, 3)
    plain = worker_codec.decode_propose_item(worker_codec.encode_propose_item(replace(request, num_assumed=0), []), [1])
    assert plain.num_alternatives == 0  # nothing assumed: no rejection to cover

    alternatives = (
        Alternative(1, 44, Proposal([5, 6], None, (0.5, 0.25))),
        Alternative(0, 45, Proposal([7], None, (0.5,))),
    )
    sent = worker_codec.encode_proposal(Proposal([4, 5, 6], None, (0.9, 0.8, 0.7), alternatives=alternatives))
    got = worker_codec.decode_proposal(wpb.Proposal.FromString(sent.SerializeToString()), 50, True)
    assert got.alternatives == alternatives and got.token_ids == [4, 5, 6]


def test_the_smallest_temperature_survives_both_float32_hops():
    """Client -> router and router -> worker each carry temperature as a float32: MIN_TEMPERATURE passes both."""
    message = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=MIN_TEMPERATURE))
    call = generation_codec.decode_generate(message, default_max_tokens=16)
    worker = worker_codec.decode_token_sampling(worker_codec.encode_token_sampling(call.request.params.shaping))
    assert worker.temperature == call.request.params.temperature >= MIN_TEMPERATURE


def test_workers_get_the_token_shaping_only():
    """What a worker decodes is a TokenShaping (no made-up max_tokens or seed); proto3's unset top_p is off."""
    shaping = TokenShaping(temperature=0.5, top_p=0.75, top_k=7)
    assert worker_codec.decode_token_sampling(worker_codec.encode_token_sampling(shaping)) == shaping
    assert worker_codec.decode_token_sampling(worker_codec.encode_token_sampling(TokenShaping())) == TokenShaping()
    with pytest.raises(InvalidArgument) as err:
        worker_codec.decode_token_sampling(wpb.TokenSampling(temperature=-1.0))
    assert err.value.field == "sampling.temperature"


def test_a_top_p_sent_as_zero_is_refused_not_switched_off():
    """Explicit presence: unset is off (1), and a 0 (what float32 made of a tiny top_p) is never read as unset."""
    assert worker_codec.decode_token_sampling(wpb.TokenSampling(temperature=1.0)).top_p == 1.0
    with pytest.raises(InvalidArgument) as err:
        worker_codec.decode_token_sampling(wpb.TokenSampling(temperature=1.0, top_p=0.0))
    assert err.value.field == "sampling.top_p"


def test_the_smallest_top_p_reaches_the_worker_as_it_left_the_router():
    shaping = TokenShaping(temperature=1.0, top_p=MIN_TOP_P)
    sent = wpb.PrefillRequest.FromString(
        worker_codec.encode_prefill([PrefillItem("s", [1], shaping, 0.5)]).SerializeToString()
    )
    assert worker_codec.decode_prefill(sent, 400)[0].shaping == shaping


# What a gRPC client can put in the fields that reach the workers: every float32, every uint32 and uint64, any text.
FLOAT32 = st.floats(width=32)
SAMPLING = st.builds(
    pb.SamplingParams,
    temperature=FLOAT32,
    top_p=st.one_of(st.none(), FLOAT32),
    top_k=st.integers(0, 2**32 - 1),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)


@settings(max_examples=300, deadline=None)
@given(sampling=SAMPLING, salt=st.text(max_size=300))
def test_every_generate_request_the_edge_accepts_reaches_the_workers_unchanged(sampling, salt):
    try:
        call = generation_codec.decode_generate(pb.GenerateRequest(prompt="x", sampling=sampling, cache_salt=salt), 16)
    except InvalidArgument:
        return
    request = call.request
    item = PrefillItem("s", [1, 2], request.params.shaping, 0.5, request.cache_salt)
    sent = wpb.PrefillRequest.FromString(worker_codec.encode_prefill([item]).SerializeToString())
    assert worker_codec.decode_prefill(sent, 400) == [item]


def test_cache_salts_and_cached_counts_cross_to_the_workers_and_back():
    from specdec_core.target import Prefilled, PrefillItem

    items = [
        PrefillItem("a", [1, 2, 3], TokenShaping(), None, "tenant-1"),
        PrefillItem("b", [4, 5], TokenShaping(), None),
    ]
    message = wpb.PrefillRequest.FromString(worker_codec.encode_prefill(items).SerializeToString())
    back = worker_codec.decode_prefill(message, 400)
    assert [item.cache_salt for item in back] == ["tenant-1", None]  # no salt stays the shared namespace
    results = [Prefilled(7, 2), Prefilled(9, 0)]
    assert worker_codec.decode_prefilled(worker_codec.encode_prefilled(results)) == results
    older = wpb.PrefillResponse(first_token_ids=[7])  # from an older worker
    assert worker_codec.decode_prefilled(older) == [Prefilled(7, 0)]
    start = worker_codec.decode_start(worker_codec.encode_start("s", [1, 2, 3], "tenant-1"))
    assert start == [worker_codec.StartItem("s", [1, 2, 3], "tenant-1")]
    assert worker_codec.decode_start(worker_codec.encode_start("s", [1], None))[0].cache_salt is None
    assert worker_codec.decode_started(wpb.StartResponse(cached_tokens=[5]), 1) == [5]
    assert worker_codec.decode_started(wpb.StartResponse(), 1) == [0]
    with pytest.raises(InvalidArgument) as err:
        generation_codec.decode_generate(pb.GenerateRequest(prompt="x", cache_salt="s" * 257), 1)
    assert err.value.field == "cache_salt"


def _masks(positions: int, vocab: int = 400, seed: int = 0) -> PackedMasks:
    """Random packed masks as a grammar fills them: the bits past the vocabulary are 0, every position allows one."""
    gen = np.random.default_rng(seed)
    dense = gen.random((positions, vocab)) < 0.3  # [n, V]
    dense[:, 7] = True
    bits = np.zeros((positions, 32 * ((vocab + 31) // 32)), dtype=np.uint8)  # [n, 32W]
    bits[:, :vocab] = dense
    return PackedMasks(np.packbits(bits, axis=-1, bitorder="little").view(np.uint32), vocab)  # [n, W]


def _same(a: PackedMasks, b: PackedMasks) -> bool:
    return a.vocab_size == b.vocab_size and a.words.dtype == b.words.dtype and np.array_equal(a.words, b.words)


def test_a_grammars_masks_cross_to_the_target_worker_bit_for_bit():
    """Prefill (one position) and verify (drafts + 1 positions) rows carry their masks as bytes; unconstrained rows
    beside them carry none."""
    prefill = [
        PrefillItem("a", [1, 2], TokenShaping(), None, allowed=_masks(1)),
        PrefillItem("b", [3], TokenShaping(), None),
    ]
    message = wpb.PrefillRequest.FromString(worker_codec.encode_prefill(prefill).SerializeToString())
    assert len(message.items[0].allowed.words) == 4 * 13 and message.items[0].allowed.words_per_position == 13
    back = worker_codec.decode_prefill(message, 400)
    assert _same(back[0].allowed, prefill[0].allowed) and back[1].allowed is None
    assert torch.equal(back[0].allowed.dense(), prefill[0].allowed.dense())

    masks = _masks(4, seed=1)
    verify = [
        VerifyItem("a", 1, [5, 6, 7], None, TokenShaping(), None, None, allowed=masks),
        VerifyItem("b", 1, [5], None, TokenShaping(), None, None),
    ]
    message = wpb.VerifyRequest.FromString(worker_codec.encode_verify(verify).SerializeToString())
    back = worker_codec.decode_verify(message, 400)
    assert _same(back[0].allowed, masks) and back[1].allowed is None
    assert torch.equal(back[0].allowed.dense(), masks.dense())


def test_a_tokenizer_narrower_than_the_logits_sends_fewer_words():
    """A grammar's masks span the tokenizer's ids (W words); the worker reads them over its wider logits, ids past
    the words never allowed."""
    narrow = _masks(2, vocab=384)
    item = VerifyItem("a", 1, [5], None, TokenShaping(), None, None, allowed=PackedMasks(narrow.words, 400))
    back = worker_codec.decode_verify(worker_codec.encode_verify([item]), 400)[0].allowed
    assert back.words.shape == (2, 12) and back.vocab_size == 400
    assert not back.dense()[:, 384:].any()


@pytest.mark.parametrize(
    "allowed, why",
    [
        (wpb.TokenMasks(words_per_position=13, words=bytes(4 * 13 * 2)), "allows no token"),
        (wpb.TokenMasks(words_per_position=13, words=b"\xff" * (4 * 13 * 2 - 1)), "bytes"),
        (wpb.TokenMasks(words_per_position=13, words=b"\xff" * (4 * 13 * 3)), "bytes"),  # a position too many
        (wpb.TokenMasks(words_per_position=14, words=b"\xff" * (4 * 14 * 2)), "words a position"),  # wider than V
        (wpb.TokenMasks(words_per_position=0, words=b""), "words a position"),
    ],
)
def test_malformed_masks_are_refused_naming_allowed(allowed, why):
    message = worker_codec.encode_verify([VerifyItem("a", 1, [5], None, TokenShaping(), None, None)])
    message.items[0].allowed.CopyFrom(allowed)
    with pytest.raises(InvalidArgument, match=why) as err:
        worker_codec.decode_verify(message, 400)
    assert err.value.field == "allowed"
