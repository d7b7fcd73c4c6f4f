"""The report every part of `specdec bench gpu` fills: each check's verdict, printed as it is made, and the parts'
figures, written as one JSON file at the end."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Report:
    """Every check's verdict, and the JSON report the parts fill in. Mutable: the parts add to it."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"checks": []}

    def check(self, name: str, ok: bool, line: str = "") -> bool:
        self.data["checks"].append({"name": name, "ok": bool(ok)})
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + line if line else ''}", flush=True)
        return ok

    def part(self, key: str, run: Callable[[], T], to_json: Callable[[T], Any] = lambda value: value) -> T | None:
        """Run one part into `data[key]` (as `to_json` writes its result) and return its result; an exception fails
        the part (its traceback goes into the report, None comes back): the other parts still run."""
        try:
            result = run()
        except Exception as exc:
            self.data[key] = {"error": traceback.format_exc()}
            self.check(f"{key} ran", False, f"{type(exc).__name__}: {exc}")
            return None
        self.data[key] = to_json(result)
        return result

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.data["checks"] if not c["ok"]]


class Warnings(logging.Handler):
    """Collects what the engine logs at WARNING and above: a drafter or a round that failed and was covered over
    (the engine turns a failing drafter into plain decoding, which would pass an exactness check for the wrong
    reason)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])
