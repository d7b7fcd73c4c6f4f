"""A worker reads its niceness once and says so when it is above 0 (Ray's default for its workers is 15)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
os.nice(int(sys.argv[1]))
from deployments.niceness import checked_niceness
print("niceness", checked_niceness(), checked_niceness())
"""


def _run(nice: int) -> str:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(nice)], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_a_niced_worker_warns_once_and_reports_its_niceness():
    niceness = os.getpriority(os.PRIO_PROCESS, 0) + 5  # os.nice adds to what the test runs at
    out = _run(5)
    assert f"niceness {niceness} {niceness}" in out
    assert out.count("WARNING") == 1 and "RAY_worker_niceness=0" in out


def test_a_worker_at_nice_0_says_nothing():
    if os.getpriority(os.PRIO_PROCESS, 0) > 0:
        pytest.skip("the tests run niced: no process here is at nice 0")
    out = _run(0)
    assert "niceness 0 0" in out and "WARNING" not in out
