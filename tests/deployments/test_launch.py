"""What `serving` sets for a local cluster on a small machine, before Ray starts."""

from __future__ import annotations

import os

from deployments.launch import SMALL_MACHINE_CORES, SMALL_MACHINE_ENVIRONMENT, small_machine_defaults


def _unset(monkeypatch):
    """Each setting absent, and absent again after the test (what the code sets is undone too)."""
    for name in SMALL_MACHINE_ENVIRONMENT:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_a_small_machine_gets_the_relaxed_serve_settings_and_a_users_own_value_wins(monkeypatch):
    _unset(monkeypatch)
    mine = next(iter(SMALL_MACHINE_ENVIRONMENT))
    monkeypatch.setenv(mine, "0.25")
    chosen = small_machine_defaults(SMALL_MACHINE_CORES)
    assert mine not in chosen and chosen == {k: v for k, v in SMALL_MACHINE_ENVIRONMENT.items() if k != mine}

    assert os.environ[mine] == "0.25"
    assert all(os.environ[name] == value for name, value in chosen.items())


def test_a_larger_machine_keeps_serves_defaults(monkeypatch):
    _unset(monkeypatch)
    assert small_machine_defaults(SMALL_MACHINE_CORES + 1) == {}

    assert not any(name in os.environ for name in SMALL_MACHINE_ENVIRONMENT)
