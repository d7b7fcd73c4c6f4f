"""The drafting methods, by the names that configs (`draft.method`) and flags give them: the one list that the
in-process builder (`build.build_engine`), the router and the Serve application choose from.

A new method is a file in this package that defines its drafter and a `METHOD` (`base.DraftMethod`), plus its
line in `METHODS` below. "none", plain decoding (no drafter at all), is not a method: `resolve` answers None.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from specdec_core.drafters import draft_model, ngram, suffix
from specdec_core.drafters.base import DraftMethod
from specdec_core.errors import InvalidArgument

NONE = "none"

METHODS: Mapping[str, DraftMethod] = MappingProxyType({method.name: method for method in (
    draft_model.METHOD,
    ngram.METHOD,
    suffix.METHOD,
)})


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
