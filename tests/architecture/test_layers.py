"""The import contracts of pyproject.toml ([tool.importlinter]) hold, and they can fail: an upward import or a
cycle added to a copy of the tree breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec_core", "deployments", "specdec_tools")
LINT = Path(sys.executable).with_name("lint-imports")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """The three packages' sources and the contracts, copied: the scratch changes never touch the checkout."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def lint(root: Path) -> subprocess.CompletedProcess:
    # Run from the copy with it first on the path, so the copy's modules are the ones analysed.
    return subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": ""},
    )


def scratch(root: Path, module: str, source: str):
    path = root / Path(*module.split(".")).with_suffix(".py")
    path.write_text(source)
    return path


def test_the_checkout_keeps_every_contract(tree):
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("specdec_core.scratch_upward", "import deployments.router\n", "Layers"),
        ("deployments.scratch_upward", "from specdec_tools import cli\n", "Layers"),
        ("specdec_core.scratch_grpc", "import grpc\n", "The engine is pure"),
        # build imports kernels.surgery: kernels importing build back closes a cycle
        ("specdec_core.kernels.scratch_cycle", "import specdec_core.build\n", "No import cycles"),
    ],
)
def test_a_scratch_import_breaks_a_contract(tree, module, source, broken):
    path = scratch(tree, module, source)
    try:
        result = lint(tree)
    finally:
        path.unlink()
    assert result.returncode != 0
    assert broken in result.stdout and "BROKEN" in result.stdout
