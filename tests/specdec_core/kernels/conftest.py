"""The tiny target built both ways, shared by the surgery and report tests."""

from __future__ import annotations

import pytest

from specdec_core.build import prepare_model
from specdec_core.models.loader import load_model


@pytest.fixture(scope="module")
def bf16_pair(tiny_dir):
    """The tiny target in bf16 twice: with the CPU kernels and with torch's code paths."""
    return prepare_model(tiny_dir / "target", dtype="bfloat16"), load_model(tiny_dir / "target", dtype="bfloat16")
