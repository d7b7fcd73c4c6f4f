"""The workers' protocol's codec: DraftService / TargetService messages (specdec.v1 worker.proto) <-> the engine's
types, between the router and the workers.

Decoding validates: a bad value raises `InvalidArgument` naming the request field, which the servicers turn into
INVALID_ARGUMENT. Nothing else in the service touches a worker message's fields. The public protocol's codec is
`deployments.generation_codec`, whose rules for a cache salt and for sampling values hold here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deployments.generation_codec import decode_cache_salt, validated_sampling
from specdec.v1 import worker_pb2 as wpb
from specdec_core.config import TokenShaping
from specdec_core.decode_run import DecodeItem, Step
from specdec_core.drafters.base import Alternative, DraftGrammar, DraftRequest, Proposal
from specdec_core.errors import InvalidArgument
from specdec_core.grammar.bits import PackedMasks
from specdec_core.grammar.constraint import Constraint
from specdec_core.sparse_q import SparseQ
from specdec_core.target import Prefilled, PrefillItem, VerifyItem, VerifyOutcome


def encode_token_sampling(shaping: TokenShaping) -> wpb.TokenSampling:
    return wpb.TokenSampling(temperature=shaping.temperature, top_p=shaping.top_p, top_k=shaping.top_k)


def decode_token_sampling(sampling: wpb.TokenSampling) -> TokenShaping:
    """The token shaping of a request's settings: all a worker needs. top_p unset is off (1); a top_p sent as 0 is
    refused, never read as unset. float32 carries every shaping the router accepts with the sampler's meaning (it
    samples in float32: `specdec_core.config`'s bounds)."""
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    return validated_sampling(TokenShaping, temperature=sampling.temperature, top_p=top_p, top_k=sampling.top_k)


def encode_distributions(q: SparseQ) -> list[wpb.SparseDistribution]:
    """One message per draft position, its padding (probability 0) left out."""
    ids, probs = q.token_ids.cpu(), q.probs.cpu()  # [k, n]
    kept = probs != 0  # [k, n]
    return [wpb.SparseDistribution(token_ids=i[m].tolist(), probs=p[m].tolist()) for i, p, m in zip(ids, probs, kept)]


def decode_distributions(rows: Sequence[wpb.SparseDistribution], vocab_size: int) -> SparseQ | None:
    """q at len(rows) positions, still sparse; None when there are no rows (deterministic drafts)."""
    if not rows:
        return None
    ids, probs = [], []
    for row in rows:
        if len(row.probs) != len(row.token_ids) or (len(row.token_ids) and max(row.token_ids) >= vocab_size):
            raise InvalidArgument("q", "a draft distribution has mismatched or out-of-vocabulary entries")
        ids.append(torch.tensor(list(row.token_ids), dtype=torch.long))
        probs.append(torch.tensor(list(row.probs), dtype=torch.float32))
    return SparseQ.from_rows(ids, probs)


def encode_masks(masks: PackedMasks) -> wpb.TokenMasks:
    """The words as bytes, as they lie in memory: bytes of little-endian uint32 (`grammar.bits` refuses other
    hosts), so no copy on either side; repeated fixed32 would cost a Python int per word (4,748 a position at 152k)."""
    words = masks.words  # [n, W] uint32
    return wpb.TokenMasks(words_per_position=words.shape[1], words=words.astype("<u4", copy=False).tobytes())


def decode_masks(msg: wpb.TokenMasks, positions: int, vocab_size: int) -> PackedMasks:
    """A row's masks at the `positions` it samples at, over the worker's `vocab_size` logits. A malformed mask, or
    one that allows nothing somewhere (its softmax would be NaN), is refused: the router never sends one."""
    width = msg.words_per_position
    if not 0 < width <= (vocab_size + 31) // 32:
        raise InvalidArgument("allowed", f"{width} words a position, for a vocabulary of {vocab_size}")
    if len(msg.words) != 4 * positions * width:
        raise InvalidArgument("allowed", f"{len(msg.words)} bytes for {positions} positions of {width} words")
    words = np.frombuffer(msg.words, dtype="<u4").reshape(positions, width)  # [positions, W], read only
    if not words.any(axis=1).all():
        raise InvalidArgument("allowed", "a position allows no token")
    return PackedMasks(words, vocab_size)


def encode_prefill(items: Sequence[PrefillItem]) -> wpb.PrefillRequest:
    request = wpb.PrefillRequest()
    for item in items:
        msg = request.items.add(seq_id=item.seq_id, prompt_token_ids=list(item.prompt_ids))
        msg.sampling.CopyFrom(encode_token_sampling(item.shaping))
        if item.uniform is not None:
            msg.uniform = item.uniform
        msg.cache_salt = item.cache_salt or ""
        if item.allowed is not None:
            msg.allowed.CopyFrom(encode_masks(item.allowed))
    return request


def decode_prefill(request: wpb.PrefillRequest, vocab_size: int) -> list[PrefillItem]:
    return [
        PrefillItem(
            seq_id=item.seq_id,
            prompt_ids=list(item.prompt_token_ids),
            shaping=decode_token_sampling(item.sampling),
            uniform=item.uniform if item.HasField("uniform") else None,
            cache_salt=decode_cache_salt(item.cache_salt),
            allowed=decode_masks(item.allowed, 1, vocab_size) if item.HasField("allowed") else None,
        )
        for item in request.items
    ]


def encode_prefilled(results: Sequence[Prefilled]) -> wpb.PrefillResponse:
    return wpb.PrefillResponse(
        first_token_ids=[r.first_token_id for r in results], cached_tokens=[r.num_cached_tokens for r in results]
    )


def decode_prefilled(response: wpb.PrefillResponse) -> list[Prefilled]:
    """One result per item (a worker that reports no cached_tokens found none in its cache)."""
    cached = list(response.cached_tokens) or [0] * len(response.first_token_ids)
    return [Prefilled(token, n) for token, n in zip(response.first_token_ids, cached)]


@dataclass(frozen=True)
class StartItem:
    """A decoded StartRequest.Item: a draft session to begin."""

    seq_id: str
    token_ids: list[int]
    cache_salt: str | None


def encode_start(seq_id: str, token_ids: Sequence[int], cache_salt: str | None) -> wpb.StartRequest:
    return wpb.StartRequest(
        items=[wpb.StartRequest.Item(seq_id=seq_id, prompt_token_ids=list(token_ids), cache_salt=cache_salt or "")]
    )


def decode_start(request: wpb.StartRequest) -> list[StartItem]:
    return [
        StartItem(item.seq_id, list(item.prompt_token_ids), decode_cache_salt(item.cache_salt))
        for item in request.items
    ]


def decode_started(response: wpb.StartResponse, num_items: int) -> list[int]:
    """Cached tokens per item (0 for each when the worker reports none)."""
    return list(response.cached_tokens) or [0] * num_items


def encode_verify(items: Sequence[VerifyItem]) -> wpb.VerifyRequest:
    request = wpb.VerifyRequest()
    for item in items:
        msg = request.items.add(
            seq_id=item.seq_id, last_token_id=item.last_token_id, draft_token_ids=list(item.draft_token_ids)
        )
        msg.sampling.CopyFrom(encode_token_sampling(item.shaping))
        if item.q is not None:
            msg.q.extend(encode_distributions(item.q))
        if item.uniform_accept is not None:
            msg.uniform_accept.extend(item.uniform_accept.tolist())
        if item.uniform_sample is not None:
            msg.uniform_sample = item.uniform_sample
        msg.return_probs = item.return_probs
        if item.allowed is not None:
            msg.allowed.CopyFrom(encode_masks(item.allowed))
    return request


def decode_verify(request: wpb.VerifyRequest, vocab_size: int) -> list[VerifyItem]:
    items = []
    for item in request.items:
        shaping = decode_token_sampling(item.sampling)
        n = len(item.draft_token_ids)
        if not shaping.greedy and (len(item.uniform_accept) != n or not item.HasField("uniform_sample")):
            raise InvalidArgument("uniform_accept", "a sampled row needs one uniform per draft and uniform_sample")
        if item.q and len(item.q) != n:
            raise InvalidArgument("q", f"{len(item.q)} distributions for {n} drafts")
        items.append(
            VerifyItem(
                seq_id=item.seq_id,
                last_token_id=item.last_token_id,
                draft_token_ids=list(item.draft_token_ids),
                q=decode_distributions(item.q, vocab_size),
                shaping=shaping,
                uniform_accept=None if shaping.greedy else torch.tensor(list(item.uniform_accept), dtype=torch.float64),
                uniform_sample=item.uniform_sample if item.HasField("uniform_sample") else None,
                return_probs=item.return_probs,
                allowed=decode_masks(item.allowed, n + 1, vocab_size) if item.HasField("allowed") else None,
            )
        )
    return items


def encode_outcomes(outcomes: Sequence[VerifyOutcome]) -> wpb.VerifyResponse:
    return wpb.VerifyResponse(
        outcomes=[
            wpb.VerifyOutcome(token_ids=o.token_ids, num_accepted=o.num_accepted, target_probs=o.target_probs or ())
            for o in outcomes
        ]
    )


def decode_outcomes(response: wpb.VerifyResponse, return_probs: Sequence[bool]) -> list[VerifyOutcome]:
    """`return_probs`: per outcome, whether its item asked (an empty repeated field cannot say)."""
    return [
        VerifyOutcome(tuple(o.token_ids), o.num_accepted, tuple(o.target_probs) if asked else None)
        for o, asked in zip(response.outcomes, return_probs)
    ]


def encode_propose_item(
    request: DraftRequest, new_token_ids: Sequence[int], send_grammar: bool = False
) -> wpb.ProposeRequest.Item:
    """`send_grammar`: the worker does not hold the session's grammar yet (`request.grammar` is set): send it."""
    committed = len(request.token_ids) - request.num_assumed
    item = wpb.ProposeRequest.Item(
        seq_id=request.seq_id,
        new_token_ids=list(new_token_ids),
        num_committed=committed,
        num_tokens=request.num_tokens,
        assumed_token_ids=list(request.token_ids[committed:]),
        num_alternatives=request.num_alternatives,
    )
    item.sampling.CopyFrom(encode_token_sampling(request.shaping))
    if request.uniform is not None:
        item.uniform.extend(request.uniform.tolist())
    item.return_probs = request.return_probs
    if send_grammar and request.grammar is not None:
        c = request.grammar.constraint
        item.grammar.CopyFrom(
            wpb.Grammar(
                kind=c.kind,
                value=c.value,
                strict=c.strict,
                compact=c.compact,
                output_start=committed - request.grammar.num_tokens,
            )
        )
    return item


def decode_propose_item(
    item: wpb.ProposeRequest.Item, token_ids: Sequence[int], grammar: DraftGrammar | None = None
) -> DraftRequest:
    """`token_ids`: the session's committed tokens, which the draft worker keeps; `grammar`: the session's, after them
    (`decode_grammar` reads the one an item brings). The item's assumed tokens follow the committed ones in the
    request (`DraftRequest.num_assumed`); a constrained session assumes none."""
    shaping = decode_token_sampling(item.sampling)
    if not shaping.greedy and len(item.uniform) != item.num_tokens:
        raise InvalidArgument("uniform", f"{len(item.uniform)} uniforms for {item.num_tokens} sampled drafts")
    assumed = list(item.assumed_token_ids)
    if assumed and grammar is not None:
        raise InvalidArgument("items.assumed_token_ids", "a constrained session cannot pre-draft")
    uniform = None if shaping.greedy else torch.tensor(list(item.uniform), dtype=torch.float64)
    tokens = [*token_ids, *assumed] if assumed else token_ids
    return DraftRequest(
        item.seq_id,
        tokens,
        item.num_tokens,
        shaping,
        uniform,
        item.return_probs,
        grammar,
        num_assumed=len(assumed),
        num_alternatives=item.num_alternatives if assumed else 0,
    )


def decode_grammar(item: wpb.ProposeRequest.Item) -> tuple[Constraint, int] | None:
    """The grammar an item brings and where its output starts; None when it brings none."""
    if not item.HasField("grammar"):
        return None
    g = item.grammar
    try:
        return Constraint(g.kind, g.value, g.strict, g.compact), g.output_start
    except InvalidArgument as e:
        raise InvalidArgument("items.grammar", e.message) from None


def encode_proposal(proposal: Proposal) -> wpb.Proposal:
    msg = wpb.Proposal(token_ids=proposal.token_ids, draft_probs=proposal.draft_probs or (), label=proposal.label or "")
    if proposal.q is not None:
        msg.q.extend(encode_distributions(proposal.q))
    for a in proposal.alternatives:
        msg.alternatives.add(position=a.position, token_id=a.token, proposal=encode_proposal(a.proposal))
    return msg


def decode_proposal(msg: wpb.Proposal, vocab_size: int, return_probs: bool) -> Proposal:
    """`return_probs`: whether the item asked (an empty repeated field cannot say)."""
    draft_probs = tuple(msg.draft_probs) if return_probs else None
    q = decode_distributions(msg.q, vocab_size)
    alternatives = tuple(
        Alternative(a.position, a.token_id, decode_proposal(a.proposal, vocab_size, return_probs))
        for a in msg.alternatives
    )
    return Proposal(
        token_ids=list(msg.token_ids), q=q, draft_probs=draft_probs, label=msg.label or None, alternatives=alternatives
    )


def encode_decode(run_id: str, items: Sequence[DecodeItem]) -> wpb.DecodeRequest:
    request = wpb.DecodeRequest(run_id=run_id)
    for item in items:
        msg = request.items.add(
            seq_id=item.seq_id,
            last_token_id=item.last_token_id,
            uniforms=item.uniforms or (),
            max_steps=item.max_steps,
            stop_token_ids=sorted(item.stop_token_ids),
        )
        msg.sampling.CopyFrom(encode_token_sampling(item.shaping))
    return request


def decode_decode(request: wpb.DecodeRequest, vocab_size: int) -> list[DecodeItem]:
    """A run's items, checked as `DecodeItem` checks them, and their ids and uniforms within range."""
    items = []
    for item in request.items:
        if item.last_token_id >= vocab_size:
            raise InvalidArgument("items.last_token_id", f"{item.last_token_id} is outside the vocabulary")
        if any(not 0.0 <= u < 1.0 for u in item.uniforms):
            raise InvalidArgument("items.uniforms", "every uniform must be in [0, 1)")
        shaping = decode_token_sampling(item.sampling)
        uniforms = tuple(item.uniforms) if item.uniforms or not shaping.greedy else None
        stops = frozenset(item.stop_token_ids)
        items.append(DecodeItem(item.seq_id, item.last_token_id, shaping, uniforms, item.max_steps, stops))
    return items


def encode_step(step: Step, free_slots: int) -> wpb.DecodeStep:
    """A run's step as the router reads it. The worker sends only tokens: a row whose step failed failed its call."""
    return wpb.DecodeStep(token_ids=[-1 if t is None else int(t) for t in step], free_slots=free_slots)


def decode_step(message: wpb.DecodeStep) -> list[int | None]:
    return [None if t < 0 else t for t in message.token_ids]
