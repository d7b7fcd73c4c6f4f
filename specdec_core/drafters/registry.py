"""The drafting methods, by the names that configs (`draft.method`) and flags give them: the one list that the
in-process builder (`build.build_engine`), the router and the Serve application choose from.

A new method is a file in this package that defines its drafter and a `METHOD` (`base.DraftMethod`), plus its
line in `METHODS` below. "none", plain decoding (no drafter at all), is not a method: `resolve` answers None.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from specdec_core.drafters import draft_model, hybrid, ngram, suffix
from specdec_core.drafters.base import DraftContext, Drafter, DraftMethod, Hybrid
from specdec_core.errors import InvalidArgument

NONE = "none"

METHODS: Mapping[str, DraftMethod] = MappingProxyType(
    {
        method.name: method
        for method in (
            draft_model.METHOD,
            ngram.METHOD,
            suffix.METHOD,
            hybrid.METHOD,
        )
    }
)


def choices() -> tuple[str, ...]:
    """Every name `draft.method` may take: the registered methods, then "none"."""
    return (*METHODS, NONE)


def resolve(name: str) -> DraftMethod | None:
    """The method called `name`; None for "none" (plain decoding). An unknown name is `InvalidArgument` naming
    every choice."""
    if name == NONE:
        return None
    method = METHODS.get(name)
    if method is None:
        raise InvalidArgument("draft.method", f"unknown drafting method {name!r}; choose one of {', '.join(choices())}")
    return method


def assemble(method: DraftMethod, drafter: Drafter, context: DraftContext) -> Drafter | Hybrid:
    """The engine's drafter for `method`: `drafter` (built by `method.build`, or the router's stand-in for the draft
    workers that run it), paired with the method's model-free part (built here, from `context`) where it has one."""
    if method.free_part is None:
        return drafter
    return Hybrid(free=METHODS[method.free_part].build(context), model=drafter)
