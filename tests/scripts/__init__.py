"""Tests of the analysis scripts under scripts/, which are files, not a package."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

SCRIPTS = Path(__file__).parents[2] / "scripts"


@contextmanager
def scripts_loaded(*names: str) -> Iterator[list[ModuleType]]:
    """The scripts `names` loaded in order, as modules of those names while the block runs: their dataclasses look
    their module up in sys.modules, and the scripts import each other by name."""
    modules = []
    try:
        for name in names:
            spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules.append(module)
        yield modules
    finally:
        for name in names:
            sys.modules.pop(name, None)
