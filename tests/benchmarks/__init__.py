"""Tests of the benchmark scripts under benchmarks/, which are files, not a package (tests/benchmarks mirrors it)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_script(path: str) -> ModuleType:
    """The script at benchmarks/`path` (e.g. "kernels/kernel_costs.py") as a module, not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, BENCHMARKS / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def scripts_loaded(*paths: str) -> Iterator[list[ModuleType]]:
    """The scripts at benchmarks/`paths` loaded in order, each registered under its file's stem while the block runs:
    their dataclasses look their module up in sys.modules, and the scripts import each other by name."""
    names = [Path(path).stem for path in paths]
    modules = []
    try:
        for name, path in zip(names, paths):
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            modules.append(module)
        yield modules
    finally:
        for name in names:
            sys.modules.pop(name, None)
