"""A small causal LM as the drafter, with its own KV cache rolled back exactly like the target's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from specdec_core.config import TokenShaping
from specdec_core.drafters.alternatives import MIN_CHANCE, StepRecord, likeliest_rejections
from specdec_core.drafters.base import Alternative, DraftContext, DraftMethod, DraftRequest, Proposal
from specdec_core.drafters.draft_chain import ChainRow, draft_chain
from specdec_core.errors import InvalidArgument
from specdec_core.models.vocab_head import VocabHead, context_ids
from specdec_core.runner import ModelRunner
from specdec_core.sampling import mask_logits, processed_probs, sample_from, token_probs
from specdec_core.sparse_q import SparseQ

# Sampled drafts come from the draft's processed distribution cut to its `Q_SUPPORT` most likely tokens. Any q
# keeps verification exact as long as the drafts are drawn from the q the target sees; a short support keeps q
# small on the wire (under a kilobyte per position instead of the whole vocabulary) and costs almost no
# acceptance. q is kept sparse (`SparseQ`) from here to the verifier.
Q_SUPPORT = 128
START_BATCH = 16  # sequences whose contexts are read in one forward when they start together


@dataclass(frozen=True)
class _Drawn:
    """A sampled row at one draft position: the q it drew from (one `SparseQ` row) and q of the token drawn."""

    token_ids: torch.Tensor  # [n] long, ascending
    probs: torch.Tensor  # [n]
    prob: float


@dataclass(frozen=True)
class _Fork:
    """A branch a pre-draft drafts for a rejection outcome: of request row `parent` (with `committed` tokens
    known committed), the assumed draft at `position` rejected and `token` committed in its place; drafted on `slot`
    (a copy of the parent's up to that position) by `request`. What the slot holds past `committed` is assumed,
    the parent's drafts before `position` included, and kept only as far as the committed tokens agree."""

    parent: int
    position: int
    token: int
    slot: int
    committed: int
    request: DraftRequest


class DraftModelDrafter:
    """Autoregressive drafting with a smaller model: k batched forward steps per round.

    The draft cache holds every committed token the draft has read. Each round first feeds the committed tokens
    it has not read yet (usually the last round's recovered or bonus token, plus the last accepted draft), then
    one token per step; the next round keeps of the drafts in the cache those the committed tokens agree with
    (`_settle`: rollback by a length). With prefix caching on the runner,
    `start` reads only what the cache lacks of the context, exactly as the target's prefill does. A constrained
    row (`DraftRequest.grammar`) masks its logits at each step with its grammar after the drafts so far, and stops
    at an eos: its q is the masked draft's, as exactness requires (`drafters/base.py`). With a
    `confidence_threshold` a row stops after a draft whose q (the plain softmax for greedy rows) is below it,
    as transformers' assisted generation does: a draft the draft model doubts is rarely followed by accepted
    ones, so its later steps and verify rows are saved. A draft whose head is cut (`models.vocab_head`) scores its
    kept ids plus those of the round's contexts.
    """

    name = "draft_model"

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab_size: int,
        q_support: int | None = Q_SUPPORT,
        confidence_threshold: float = 0.0,
        chain_on_device: bool | None = None,
        alternative_min_chance: float = MIN_CHANCE,
    ) -> None:
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"need 0 <= confidence_threshold < 1, got {confidence_threshold}")
        self.runner = runner
        self.target_vocab_size = target_vocab_size
        self.q_support = q_support
        self.confidence_threshold = confidence_threshold
        # On a GPU a step's read-back costs more than the step: greedy rows draft as one chain there. On a CPU the
        # loop stops early (every row done, or unsure) and saves whole steps, which cost far more than a read-back.
        self.chain_on_device = runner.device.type == "cuda" if chain_on_device is None else chain_on_device
        self._slots: dict[str, int] = {}
        # Per sequence, what its cache holds past the tokens known to be committed: (the first such position, the
        # tokens there): its last call's assumed tokens (`DraftRequest.num_assumed`) and the drafts it wrote.
        self._fed: dict[str, tuple[int, list[int]]] = {}
        # Per sequence, the branches its last pre-draft drafted for rejection outcomes (`Proposal.alternatives`):
        # (slot, what it holds past the committed tokens, as `_fed`). The next call keeps the one that agrees with
        # the committed tokens, if it agrees further than the sequence's own slot, and drops the rest.
        self._forks: dict[str, list[tuple[int, tuple[int, list[int]]]]] = {}
        # Per slot, per position drafted there: what the draft thought (`alternatives.StepRecord`), kept once a
        # pre-draft asks for alternatives, for the drafts a later pre-draft assumes.
        self._records: dict[int, dict[int, StepRecord]] = {}
        self._recording = False
        self.alternative_min_chance = alternative_min_chance  # rejection outcomes less likely are not drafted
        head = getattr(runner.model, "lm_head", None)
        self._keep = head.keep if isinstance(head, VocabHead) else None

    def start(self, seq_id: str, prompt_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self.start_many([(seq_id, prompt_ids, cache_salt)])[0]

    def start_many(self, starts: Sequence[tuple[str, Sequence[int], str | None]]) -> list[int]:
        """`start` for several sequences (seq_id, prompt_ids, cache_salt): what their caches lack is read in
        forwards of equal lengths, up to START_BATCH rows each (no padding), as the target's prefill reads prompts.
        A burst of new requests that draft in one round costs a few forwards, not one each. All or none start."""
        self._make_room(len(starts))
        # The last prompt token is read with the first propose, whose logits we need anyway.
        contexts = [self._readable(prompt_ids[:-1]) for _, prompt_ids, _ in starts]
        slots: list[int] = []
        try:
            for context, (_, _, salt) in zip(contexts, starts):
                slots.append(self.runner.allocate(context, salt))  # holding the longest cached prefix of it
            cached = [self.runner.length(slot) for slot in slots]
            by_length: dict[int, list[int]] = {}
            for i, (context, n) in enumerate(zip(contexts, cached)):
                if len(context) > n:
                    by_length.setdefault(len(context) - n, []).append(i)
            for members in by_length.values():
                for first in range(0, len(members), START_BATCH):
                    chunk = members[first : first + START_BATCH]
                    self.runner.extend([slots[i] for i in chunk], [contexts[i][cached[i] :] for i in chunk])
        except Exception:
            for slot in slots:
                self.runner.release(slot)
            raise
        for (seq_id, _, _), slot in zip(starts, slots):
            self._slots[seq_id] = slot
        return cached

    def cached(self, seq_id: str, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self.runner.cached_prefix(self._readable(token_ids[:-1]), cache_salt)

    def release(self, seq_id: str) -> None:
        self._fed.pop(seq_id, None)
        for fork, _ in self._forks.pop(seq_id, []):
            self._drop(fork)
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._records.pop(slot, None)
            self.runner.release(slot)

    def observe(self, seq_id: str, num_committed: int) -> None:
        """Nothing now: the next `propose` keeps of the drafts in the cache those its tokens agree with
        (`_settle`). A pre-drafted branch (`overlap.py`) that the round confirmed stays, and is not
        read again."""
        if seq_id not in self._slots:
            raise KeyError(f"draft session {seq_id!r} was not started")

    @property
    def active_sequences(self) -> int:
        return len(self._slots)

    @property
    def free_slots(self) -> int:
        """Cache slots a new sequence could take: the free ones and the branches' (`_make_room` frees those)."""
        return self.runner.cache.free_slots + sum(len(forks) for forks in self._forks.values())

    def _make_room(self, needed: int) -> None:
        """Drop pre-drafted branches until `needed` slots are free: a sequence's start outranks a branch, which
        at best saves a draft call."""
        for seq_id in list(self._forks):
            if self.runner.cache.free_slots >= needed:
                return
            for slot, _ in self._forks.pop(seq_id):
                self._drop(slot)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        rows = [i for i, r in enumerate(requests) if r.num_tokens > 0]
        slots: dict[int, int] = {}  # row -> the slot it drafts on
        feeds = {}  # row -> the committed tokens its slot has not read (a long backlog read first, alone)
        for i in rows:
            slots[i] = self._settle(requests[i])
            feeds[i] = self._catch_up(slots[i], self._readable(requests[i].token_ids[self.runner.length(slots[i]) :]))
        extra = (
            None
            if self._keep is None or not rows
            else context_ids((requests[i].token_ids for i in rows), self._keep, self.runner.vocab_size)
        )  # [E]
        if rows and self._chains(requests, rows):
            return self._propose_chain(requests, rows, feeds, extra)
        forks = self._fork(requests, rows, slots)
        calls = [*requests, *(f.request for f in forks)]  # a fork drafts as a row of its own
        for n, fork in enumerate(forks, start=len(requests)):
            rows.append(n)
            slots[n] = fork.slot
            feeds[n] = self._readable(fork.request.token_ids[self.runner.length(fork.slot) :])
        tokens, qs, chosen = self._steps(calls, rows, slots, feeds, extra)
        self._note_fed(requests, tokens)
        for n, fork in enumerate(forks, start=len(requests)):
            fed = self._fed_after(fork.request, fork.slot, fork.committed, tokens[n])
            self._forks.setdefault(fork.request.seq_id, []).append((fork.slot, fed))
        proposals = [
            Proposal(token_ids=t, q=_stack(q), draft_probs=tuple(c) if r.return_probs else None)
            for t, q, c, r in zip(tokens, qs, chosen, calls)
        ]
        by_parent: dict[int, list[Alternative]] = {}
        for n, fork in enumerate(forks, start=len(requests)):
            by_parent.setdefault(fork.parent, []).append(Alternative(fork.position, fork.token, proposals[n]))
        for parent, alternatives in by_parent.items():
            proposals[parent] = replace(proposals[parent], alternatives=tuple(alternatives))
        return proposals[: len(requests)]

    def _steps(
        self,
        calls: Sequence[DraftRequest],
        rows: list[int],
        slots: dict[int, int],
        feeds: dict[int, list[int]],
        extra: torch.Tensor | None,
    ) -> tuple[list[list[int]], list[list[_Drawn]], list[list[float]]]:
        """The step loop: each row's drafts, the q rows it drew from (sampled rows), and q of each pick (rows that
        asked, `return_probs`)."""
        tokens: list[list[int]] = [[] for _ in calls]
        qs: list[list[_Drawn]] = [[] for _ in calls]
        chosen: list[list[float]] = [[] for _ in calls]
        advanced = [0] * len(calls)  # drafts each row's grammar was moved along: moved back before returning
        try:
            step = 0
            while rows:
                batch = [calls[i] for i in rows]
                logits = self.runner.extend([slots[i] for i in rows], [feeds[i] for i in rows], extra_vocab=extra)
                logits = _masked(self._align(logits), batch)  # [R, V]
                picked, drawn = self._pick(logits, batch, step)
                picked_probs = _picked_probs(logits, batch, picked, drawn, every_row=self.confidence_threshold > 0)
                if self._recording:
                    self._record(logits, batch, [slots[i] for i in rows], step)
                # Rows whose grammar ends with this draft (an eos: nothing after it is committed), and rows the
                # draft is unsure of (a later draft would rarely survive: its step and verify row are saved).
                ended = set()
                for j, i in enumerate(rows):
                    tokens[i].append(picked[j])
                    if (draw := drawn[j]) is not None:
                        qs[i].append(draw)
                    prob = picked_probs[j]
                    if calls[i].return_probs:
                        assert prob is not None  # computed for every row that asked
                        chosen[i].append(prob)
                    if prob is not None and prob < self.confidence_threshold:
                        ended.add(i)
                    feeds[i] = [picked[j]]
                    if (grammar := calls[i].grammar) is not None:
                        taken = grammar.advance([picked[j]])
                        advanced[i] += taken
                        if not taken or grammar.is_terminated():
                            ended.add(i)
                step += 1
                rows = [i for i in rows if calls[i].num_tokens > step and i not in ended]
        finally:
            for call, n in zip(calls, advanced):
                if n and call.grammar is not None:  # advanced only where there is a grammar
                    call.grammar.rollback(n)
        return tokens, qs, chosen

    # -- branches for rejection outcomes (`alternatives.py`) -----------------------------------------------------

    def _settle(self, request: DraftRequest) -> int:
        """The slot `request`'s sequence drafts on now: of its own slot and the branches its last pre-draft forked,
        the one whose contents agree furthest with `request.token_ids` (its own on a tie), rolled back (by a
        length) to that agreement; the others are dropped. A kept branch becomes the sequence's slot: a hit costs
        no recompute. Its records of earlier positions, now committed, are forgotten."""
        seq_id = request.seq_id
        own = self._slots[seq_id]
        candidates = [(own, self._fed.pop(seq_id, None)), *self._forks.pop(seq_id, [])]
        kept, keep = own, -1
        for slot, fed in candidates:
            agreed = self._agreed(slot, fed, request.token_ids)
            if agreed > keep:
                kept, keep = slot, agreed
        for slot, _ in candidates:
            if slot != kept:
                self._drop(slot)
        self._slots[seq_id] = kept
        if keep < self.runner.length(kept):
            self.runner.truncate(kept, keep)
        if (records := self._records.get(kept)) is not None:  # a record at p was read off the context before p
            committed = len(request.token_ids) - request.num_assumed
            for position in [p for p in records if p < committed or p > keep]:
                del records[position]
        return kept

    def _agreed(self, slot: int, fed: tuple[int, list[int]] | None, token_ids: Sequence[int]) -> int:
        """How much of `slot` to keep for a sequence now at `token_ids`: what it holds past the known committed
        tokens (`fed`: the last call's drafts and the tokens it assumed) only as far as `token_ids` agree with it.
        Rounds without drafts may have committed more since (a remote draft worker hears of them only now): a
        rejected draft left behind a prefix that grew past it would have the draft read a context that was never
        committed."""
        length = self.runner.length(slot)
        if fed is None:
            return length
        start, held = fed
        committed = self._readable(token_ids[start : start + len(held)])
        agree = next((j for j, (a, b) in enumerate(zip(held, committed)) if a != b), len(committed))
        return min(start + agree, len(token_ids) - 1, length)  # the last committed token is read with the next step

    def _fork(self, requests: Sequence[DraftRequest], rows: Sequence[int], slots: dict[int, int]) -> list[_Fork]:
        """For each pre-draft that asks (`DraftRequest.num_alternatives`; greedy rows without a grammar), a branch
        per rejection outcome it covers: a copy of its slot up to the rejected position, and the request that
        drafts after the guessed token there. None where no slot is free."""
        forks: list[_Fork] = []
        for i in rows:
            r = requests[i]
            if r.num_alternatives <= 0 or r.num_assumed <= 0 or r.num_tokens < 2:
                continue
            self._recording = True  # later calls record what the drafts assumed then need
            if not r.shaping.greedy or r.grammar is not None:
                continue
            committed = len(r.token_ids) - r.num_assumed
            assumed = r.token_ids[committed:]
            records = self._records.get(slots[i], {})
            chosen = likeliest_rejections(
                assumed,
                [records.get(committed + j) for j in range(len(assumed))],
                r.num_alternatives,
                self.alternative_min_chance,
            )
            for rejection in chosen:
                if not self.runner.cache.free_slots:
                    return forks
                at = committed + rejection.position
                context = [*r.token_ids[:at], rejection.token]
                slot = self.runner.fork(slots[i], min(at, self.runner.length(slots[i])))
                request = DraftRequest(r.seq_id, context, r.num_tokens - 1, r.shaping, None, r.return_probs)
                forks.append(_Fork(i, rejection.position, rejection.token, slot, committed, request))
        return forks

    def _record(self, logits: torch.Tensor, batch: Sequence[DraftRequest], slots: Sequence[int], step: int) -> None:
        """Keep, for each greedy row without a grammar, its pick, runner-up and their q at this step's position."""
        rows = [j for j, r in enumerate(batch) if r.shaping.greedy and r.grammar is None]
        if not rows:
            return
        sub = logits[rows]  # [G, V]
        top, ids = sub.topk(2, dim=-1)  # [G, 2]
        probs = (top - sub.logsumexp(dim=-1, keepdim=True)).exp().tolist()
        for g, j in enumerate(rows):
            record = StepRecord(int(ids[g, 0]), probs[g][0], int(ids[g, 1]), probs[g][1])
            self._records.setdefault(slots[j], {})[len(batch[j].token_ids) + step] = record

    def _drop(self, slot: int) -> None:
        """Free a branch's slot (or a sequence's old one, replaced by its branch)."""
        self._records.pop(slot, None)
        self.runner.discard(slot)

    def _chains(self, requests: Sequence[DraftRequest], rows: Sequence[int]) -> bool:
        """Whether this call drafts as one chain on the device (`draft_chain.py`): on by `chain_on_device` (a
        CUDA runner), for greedy rows without a grammar (whose steps need the host) within their length limit."""
        if not self.chain_on_device:
            return False
        steps = max(requests[i].num_tokens for i in rows)
        for i in rows:
            r = requests[i]
            if not r.shaping.greedy or r.grammar is not None:
                return False
            if len(r.token_ids) + steps > self.runner.max_seq_len:  # a short row runs the longest row's steps
                return False
        return True

    def _propose_chain(
        self,
        requests: Sequence[DraftRequest],
        rows: Sequence[int],
        feeds: dict[int, list[int]],
        extra: torch.Tensor | None,
    ) -> list[Proposal]:
        chain = [
            ChainRow(self._slots[requests[i].seq_id], feeds[i], requests[i].num_tokens, requests[i].shaping)
            for i in rows
        ]
        with_probs = self.confidence_threshold > 0 or any(requests[i].return_probs for i in rows)
        drafted = dict(
            zip(rows, draft_chain(self.runner, chain, self._align, self.confidence_threshold, with_probs, extra))
        )
        tokens = [drafted[i].token_ids if i in drafted else [] for i in range(len(requests))]
        self._note_fed(requests, tokens)
        return [
            Proposal(
                token_ids=t,
                q=None,  # greedy rows: their drafts are point masses
                draft_probs=(tuple(drafted[i].probs) if i in drafted else ()) if r.return_probs else None,
            )
            for i, (t, r) in enumerate(zip(tokens, requests))
        ]

    def _note_fed(self, requests: Sequence[DraftRequest], tokens: Sequence[list[int]]) -> None:
        """What each row's cache now holds past its committed tokens (`_fed`): the assumed tokens, then drafts."""
        for r, drafted in zip(requests, tokens):
            if r.num_tokens > 0:
                slot = self._slots[r.seq_id]
                self._fed[r.seq_id] = self._fed_after(r, slot, len(r.token_ids) - r.num_assumed, drafted)

    def _fed_after(self, r: DraftRequest, slot: int, committed: int, drafted: list[int]) -> tuple[int, list[int]]:
        """What `slot` holds past the first `committed` of `r.token_ids`, after drafting `drafted` on it."""
        written = self.runner.length(slot) - len(r.token_ids)
        return committed, self._readable(r.token_ids[committed:]) + drafted[:written]

    def _catch_up(self, slot: int, feed: list[int]) -> list[int]:
        """Read all but the last token of a long feed (a sequence that sat at k = 0 for a while) in a forward of
        its own; what is left is short. A batched step pads every row to its longest feed: one long row would
        make every row pay for its length, and could push the padding past the other rows' cache slots."""
        if len(feed) <= self.runner.config.max_extend:
            return feed
        self.runner.extend([slot], [feed[:-1]])
        return feed[-1:]

    def _readable(self, tokens: Sequence[int]) -> list[int]:
        """Ids the draft can embed. The target's embedding may have rows the draft lacks (padding beyond the
        tokenizer); should the target ever emit one, the draft reads a stand-in: its guesses get worse there,
        the output cannot change."""
        limit = self.runner.vocab_size
        return [t if t < limit else 0 for t in tokens]

    def _align(self, logits: torch.Tensor) -> torch.Tensor:  # [B, Vd] -> [B, Vt]
        """Draft and target may pad their embeddings differently; q must live on the target's vocabulary."""
        V = self.target_vocab_size
        if logits.shape[-1] >= V:
            return logits[:, :V]
        pad = logits.new_full((logits.shape[0], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _pick(
        self, logits: torch.Tensor, requests: Sequence[DraftRequest], step: int
    ) -> tuple[list[int], list[_Drawn | None]]:
        """Greedy rows take the argmax; sampled rows draw from their shaped q and keep it for verification."""
        picked = logits.argmax(dim=-1).tolist()
        drawn: list[_Drawn | None] = [None] * len(requests)
        sampled = [j for j, r in enumerate(requests) if not r.shaping.greedy]
        if not sampled:
            return picked, drawn
        q = self._q(logits[sampled], [requests[j].shaping for j in sampled])  # [S, n]
        # A sampled row's uniforms are drawn by the engine (`DraftRequest.uniform`): never None here.
        uniform = torch.stack([cast(torch.Tensor, requests[j].uniform)[step] for j in sampled]).to(logits.device)  # [S]
        at = sample_from(q.probs, uniform).unsqueeze(-1)  # [S, 1]: the entry each row drew
        tokens = q.token_ids.gather(-1, at).squeeze(-1).tolist()
        probs = q.probs.gather(-1, at).squeeze(-1).tolist()
        for s, j in enumerate(sampled):
            picked[j] = tokens[s]
            drawn[j] = _Drawn(q.token_ids[s], q.probs[s], probs[s])
        return picked, drawn

    def _q(self, logits: torch.Tensor, shaping: Sequence[TokenShaping]) -> SparseQ:  # [S, V] -> [S, n]
        """The shaped distribution, cut to its `q_support` most likely tokens."""
        q = processed_probs(
            logits,
            torch.tensor([s.temperature for s in shaping], device=logits.device),
            torch.tensor([s.top_k for s in shaping], device=logits.device),
            torch.tensor([s.top_p for s in shaping], device=logits.device),
        )  # [S, V]
        if self.q_support is None or self.q_support >= q.shape[-1]:
            return SparseQ.from_dense(q)
        return _truncate(q, self.q_support)


def _masked(logits: torch.Tensor, requests: Sequence[DraftRequest]) -> torch.Tensor:  # [B, V] -> [B, V]
    """Constrained rows' logits with what their grammar forbids at -inf: everything after (greedy argmax, q, its
    support cut, the probabilities reported) is then the masked draft's, so every draft stays in the grammar."""
    rows = [j for j, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [B, V]
    for j in rows:
        grammar = requests[j].grammar
        assert grammar is not None  # `rows` are those with one
        allowed[j] = grammar.allowed_mask()  # [V]
    return mask_logits(logits, allowed.to(logits.device))


def _build(context: DraftContext) -> DraftModelDrafter:
    if context.runner is None:
        raise InvalidArgument("draft.model", f"method {DraftModelDrafter.name} needs a draft model")
    return DraftModelDrafter(
        context.runner, context.target_vocab_size, confidence_threshold=context.spec.confidence_threshold
    )


METHOD = DraftMethod(DraftModelDrafter.name, runs_draft_model=True, build=_build)


def _picked_probs(
    logits: torch.Tensor,  # [B, V]
    requests: Sequence[DraftRequest],
    picked: list[int],
    drawn: list[_Drawn | None],
    every_row: bool = False,
) -> list[float | None]:
    """q of each row's picked token, for the rows that asked, or every row (None for the others): from the
    distribution a sampled row drew from (its support cut included), else the plain softmax. No row asked:
    nothing computed."""
    out: list[float | None] = [None] * len(requests)
    greedy = []
    for j, r in enumerate(requests):
        if not (r.return_probs or every_row):
            continue
        if (draw := drawn[j]) is not None:
            out[j] = draw.prob
        else:
            greedy.append(j)
    if greedy:
        chosen = torch.tensor([picked[j] for j in greedy])  # [G]
        values = token_probs(logits[greedy], [requests[j].shaping for j in greedy], chosen)  # [G]
        for j, value in zip(greedy, values.tolist()):
            out[j] = value
    return out


def _truncate(q: torch.Tensor, support: int) -> SparseQ:  # [S, V] -> [S, support]
    """q's `support` most likely tokens, renormalised; ids ascending, so that the cdf a row is sampled by runs in
    the order of the dense row (the same uniform draws the same token)."""
    top, index = q.topk(support, dim=-1)  # [S, support]
    probs = top / top.sum(dim=-1, keepdim=True)  # [S, support]
    ids, order = index.sort(dim=-1)  # [S, support]
    return SparseQ(ids, probs.gather(-1, order))


def _stack(drawn: list[_Drawn]) -> SparseQ | None:
    """A proposal's q: one row per sampled position; None when no position was sampled."""
    if not drawn:
        return None
    return SparseQ.from_rows([d.token_ids for d in drawn], [d.probs for d in drawn])
