"""Errors the engine raises before any work starts.

Each carries the offending field so that the serving layer can map it onto a gRPC status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND) whose message names that field.
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class for every error specdec raises on purpose."""


class InvalidArgument(SpecdecError, ValueError):
    """A request or config value is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class ResourceExhausted(SpecdecError):
    """A request does not fit (context length, KV slots); `field` names what overflowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class Unavailable(SpecdecError):
    """A part of the model (a worker, a tensor-parallel rank) could not be reached; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class ModelNotFound(SpecdecError, LookupError):
    """A model name is not in the catalog, or a path does not exist."""


class ModelIntegrityError(SpecdecError):
    """A download's SHA-256 does not match the pinned one."""


class TokenizerMismatch(SpecdecError):
    """Draft and target tokenizers map tokens to ids differently."""


class GrammarError(SpecdecError, RuntimeError):
    """A request's grammar engine failed part-way through its output (the matcher reports an error, or no token
    continues the output and it cannot end): that output can no longer be shown to be in its language, so the
    request ends with an error, never with a normal stop. `kind` names the constraint (`Constraint.kind`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind} constraint: {message}")
        self.kind, self.message = kind, message
