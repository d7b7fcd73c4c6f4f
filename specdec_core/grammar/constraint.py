"""What a request constrains its output to, as the engine sees it: one frozen value, whatever API it came from."""

from __future__ import annotations

from dataclasses import dataclass

from specdec_core.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class Constraint:
    """The language a request's output must belong to.

    kind:
      - "json_schema": `value` is a JSON Schema (JSON text); the output is one JSON value it accepts.
      - "json_object": any JSON object; `value` is ignored (empty).
      - "regex": `value` is a regular expression the whole output must match (Rust `regex` syntax).
      - "grammar": `value` is a context-free grammar, Lark syntax (start rule `start`) or GBNF (`root ::= ...`).

    strict (json_schema only): True, a schema keyword the grammar engine cannot enforce (say `not`) is an
    `InvalidArgument` naming it, so a strict request never gets output its schema would refuse. False, such
    keywords are dropped and the rest of the schema is still enforced: the "best effort" of a non-strict schema.

    compact (json_schema, json_object): no whitespace between JSON tokens, "," and ":" as separators, unless the
    schema's own "x-guidance" sets them (`whitespace_flexible`, `item_separator`, ...). False: any whitespace may
    come between tokens (llguidance's default), which a model can write until `max_tokens`. The served APIs set it.
    """

    kind: str
    value: str = ""
    strict: bool = True
    compact: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument("constraint", f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.value.strip():
            raise InvalidArgument(self.kind, "is empty")
