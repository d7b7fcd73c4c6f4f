"""What `serving` sets for a local cluster before Ray starts: its workers at nice 0 everywhere, and relaxed Serve
settings on a small machine."""

from __future__ import annotations

import os

from deployments.launch import (
    SERVING_ENVIRONMENT,
    SMALL_MACHINE_CORES,
    SMALL_MACHINE_ENVIRONMENT,
    cluster_defaults,
)

EVERY_SETTING = {**SERVING_ENVIRONMENT, **SMALL_MACHINE_ENVIRONMENT}
NICENESS = next(iter(SERVING_ENVIRONMENT))  # Ray's own spelling, lower case and all


def _unset(monkeypatch):
    """Each setting absent, and absent again after the test (what the code sets is undone too)."""
    for name in EVERY_SETTING:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_a_small_machine_gets_the_relaxed_serve_settings_and_a_users_own_value_wins(monkeypatch):
    _unset(monkeypatch)
    mine = next(iter(SMALL_MACHINE_ENVIRONMENT))
    monkeypatch.setenv(mine, "0.25")
    chosen = cluster_defaults(SMALL_MACHINE_CORES)
    assert mine not in chosen and chosen == {k: v for k, v in EVERY_SETTING.items() if k != mine}

    assert os.environ[mine] == "0.25"
    assert all(os.environ[name] == value for name, value in chosen.items())


def test_a_larger_machine_keeps_serves_defaults_but_not_rays_worker_niceness(monkeypatch):
    _unset(monkeypatch)
    assert cluster_defaults(SMALL_MACHINE_CORES + 1) == SERVING_ENVIRONMENT

    assert not any(name in os.environ for name in SMALL_MACHINE_ENVIRONMENT)
    assert os.environ[NICENESS] == "0"


def test_a_niceness_already_chosen_is_kept(monkeypatch):
    _unset(monkeypatch)
    monkeypatch.setenv(NICENESS, "5")
    assert NICENESS not in cluster_defaults(SMALL_MACHINE_CORES + 1)
    assert os.environ[NICENESS] == "5"
