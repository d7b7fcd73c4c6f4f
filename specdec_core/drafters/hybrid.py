"""Hybrid drafting: SuffixDecoding's cached proposals and a draft model, chosen per request and per round.

A suffix proposal costs a lookup in the router; a draft model's costs a draft call of k steps. Where a request
repeats what it or earlier requests said (an edit of the last answer, a tool call echoing a schema), the suffix
structure proposes long spans the draft model would have to produce step by step; elsewhere it proposes nothing,
or a short, weak guess, and the draft model does better. The engine weighs both each round by the cost model
`auto` uses (`adaptive.AdaptivePolicy.choose_batch` with the free proposals): the suffix proposal's expected
tokens by its label's acceptance record, the draft model's by the request's own, each over what its round costs
(no draft call for the suffix proposal), and plain decoding where neither pays. Both proposals are verified
exactly: the suffix one as point masses, the model's with its q.

The draft workers run the draft model (`build`); the suffix structure runs wherever the engine does.
"""

from __future__ import annotations

from specdec_core.drafters import draft_model, suffix
from specdec_core.drafters.base import DraftMethod

METHOD = DraftMethod("hybrid", runs_draft_model=True, build=draft_model.METHOD.build, free_part=suffix.METHOD.name)
