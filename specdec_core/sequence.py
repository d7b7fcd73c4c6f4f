"""One running request as the engine keeps it: the `Request` as it came, and what the engine adds (randomness,
committed tokens, stopping, grammar, its drafters' `DraftSession`, its acceptance estimate and totals).

Mutable and private to the engine. Its methods read it, but for two that say so: `uniform` draws from the
sequence's generator (the order of draws is part of a seeded output's reproducibility), and `output` counts text
as returned. The methods that build a call's item draw their uniforms in a fixed order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from specdec_core import structured
from specdec_core.adaptive import AcceptanceEstimate
from specdec_core.config import AUTO, SamplingParams
from specdec_core.decode_run import DecodeItem
from specdec_core.drafters.base import DraftRequest, Proposal
from specdec_core.drafters.session import DraftSession
from specdec_core.grammar.masks import verify_masks
from specdec_core.grammar.state import GrammarState
from specdec_core.outputs import RequestOutput, RoundInfo, SpecStats
from specdec_core.request import Request
from specdec_core.stopping import FinishReason, StopChecker
from specdec_core.target import PrefillItem, VerifyItem


@dataclass
class SequenceState:
    request: Request
    tokens: list[int]  # prompt + committed output
    k_setting: int | str  # fixed k or "auto": the request's, until `SpecEngine.set_speculation` changes it
    generator: torch.Generator
    stopper: StopChecker
    draft: DraftSession
    grammar: GrammarState | None = None  # a constrained request's, after its committed output (never its drafts)
    num_cached: int = 0  # prompt tokens the target read from its prefix cache
    stats: SpecStats = SpecStats()
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    emitted_text: int = 0  # characters of the stable text already returned
    # A pre-drafted branch the last round confirmed (`overlap.py`): (the committed length it is valid at, the
    # proposal); the next round verifies it instead of drafting.
    predrafted: tuple[int, Proposal] | None = None
    split_drafted: bool = False  # that proposal was drafted while the other group of a split batch verified

    @property
    def seq_id(self) -> str:
        return self.request.seq_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_ids)

    def output(self, committed: list[int], info: RoundInfo | None) -> RequestOutput:
        """This step's output, after committing `committed`. Mutates: its new text counts as returned."""
        text = self.stopper.stable_text
        new_text, self.emitted_text = text[self.emitted_text :], len(text)
        return RequestOutput(
            self.seq_id,
            tuple(committed),
            new_text,
            self.stopper.finish_reason,
            self.num_prompt,
            self.stopper.num_output,
            self.stats,
            self.num_cached,
            round=info,
        )

    def final(self, reason: FinishReason, error: Exception | None = None) -> RequestOutput:
        """The output that ends the request for `reason` (cancelled, failed), with no new tokens."""
        return RequestOutput(
            self.seq_id,
            (),
            "",
            reason,
            self.num_prompt,
            self.stopper.num_output,
            self.stats,
            self.num_cached,
            error=error,
        )

    def uniform(self, n: int) -> torch.Tensor:  # [n]
        """Mutates: the next `n` draws of the sequence's generator."""
        return torch.rand(n, generator=self.generator, dtype=torch.float64)

    def run_uniforms(self, steps: int) -> tuple[torch.Tensor, tuple[float, ...]]:
        """Mutates: the draws of `steps` plain rounds, in the order `verify_item` makes them (a k = 0 round draws
        its accept tests, none, then its sample), and the generator's state before them, for `rewind_run`."""
        state = self.generator.get_state()
        draws = []
        for _ in range(steps):
            self.uniform(0)
            draws.append(float(self.uniform(1)))
        return state, tuple(draws)

    def rewind_run(self, state: torch.Tensor, steps_taken: int) -> None:
        """Mutates: the generator as if only the `steps_taken` rounds a run used had drawn (`run_uniforms`): a run
        cut short leaves the draws after it as per-round decoding would have made them."""
        self.generator.set_state(state)
        self.run_uniforms(steps_taken)

    def room(self, max_seq_len: int) -> int:
        """Tokens the sequence may still commit."""
        return min(self.params.max_tokens - self.stopper.num_output, max_seq_len - len(self.tokens))

    def spec_cap(self, max_speculative_tokens: int, max_seq_len: int) -> int:
        """The longest proposal it may verify this round: its fixed k (else the largest), within its room."""
        k = max_speculative_tokens if self.k_setting == AUTO else int(self.k_setting)
        return max(0, min(k, self.room(max_seq_len) - 1))

    def forced(self, max_seq_len: int) -> list[int]:
        """The tokens its grammar forces next, within its room. None for a request at k = 0: plain decoding stays
        token by token."""
        if self.grammar is None or self.k_setting == 0:
            return []
        return structured.forced_tokens(self.grammar, self.room(max_seq_len))

    def fixed_k(self) -> int | None:
        """The draft model's k where the request fixed it (0 where it may not use the draft model); None: `auto`
        chooses."""
        if not self.draft.model_allowed:
            return 0
        return None if self.k_setting == AUTO else int(self.k_setting)

    def prefill_item(self) -> PrefillItem:
        """The target's prefill of the prompt; draws the first token's uniform."""
        uniform = None if self.params.greedy else float(self.uniform(1))
        masks = None if self.grammar is None else verify_masks(self.grammar, [])
        return PrefillItem(self.seq_id, self.tokens, self.params.shaping, uniform, self.request.cache_salt, masks)

    def draft_request(self, k: int) -> DraftRequest:
        """The draft model's share of a round; draws its k uniforms."""
        return DraftRequest(
            seq_id=self.seq_id,
            token_ids=self.tokens,
            num_tokens=k,
            shaping=self.params.shaping,
            uniform=None if self.params.greedy else self.uniform(k),
            return_probs=self.request.return_probs,
            grammar=self.grammar,  # a draft model masks its q with it; point-mass drafters may ignore it
        )

    def predrafted_proposal(self) -> Proposal | None:
        """The branch pre-drafted for exactly the committed tokens, if any."""
        if self.predrafted is None or self.predrafted[0] != len(self.tokens):
            return None
        return self.predrafted[1]

    def free_request(self, k: int) -> DraftRequest:
        """The free drafter's share of a round: no randomness, and no grammar (its proposals are point masses,
        cut where they leave it, `structured.cut_to_grammar`)."""
        return DraftRequest(self.seq_id, self.tokens, k, self.params.shaping, None, self.request.return_probs)

    def decode_item(self, max_steps: int, stop_token_ids: frozenset[int]) -> tuple[DecodeItem, torch.Tensor | None]:
        """The target's share of a run of at most `max_steps` plain rounds, and the generator's state before its
        draws (None when greedy: it draws nothing). Draws its uniforms."""
        state, uniforms = (None, None) if self.params.greedy else self.run_uniforms(max_steps)
        stops = frozenset() if self.params.ignore_eos else stop_token_ids
        item = DecodeItem(self.seq_id, self.tokens[-1], self.params.shaping, uniforms, max_steps, stops)
        return item, state

    def verify_item(self, proposal: Proposal) -> VerifyItem:
        """The target's share of the round; randomness drawn in a fixed order (accept tests, then the sample).
        A constrained row's masks are its grammar's along the drafts (`verify_masks`: a proposal that leaves the
        grammar here has a q, and is verified whole)."""
        n = len(proposal.token_ids)
        greedy = self.params.greedy
        return VerifyItem(
            seq_id=self.seq_id,
            last_token_id=self.tokens[-1],
            draft_token_ids=proposal.token_ids,
            q=proposal.q,
            shaping=self.params.shaping,
            uniform_accept=None if greedy else self.uniform(n),
            uniform_sample=None if greedy else float(self.uniform(1)),
            return_probs=self.request.return_probs,
            allowed=None if self.grammar is None else verify_masks(self.grammar, proposal.token_ids),
        )


def seeded_generator(seed: int | None) -> torch.Generator:
    """A request's generator: seeded by the request where it says, else at random."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return generator
