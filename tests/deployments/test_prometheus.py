"""The online watch's metrics (`WatchMetrics`): what each export sets, and the exported names the alert rules use."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import yaml

from deployments.prometheus import ServingMetrics, WatchMetrics
from specdec_core.watch import WindowSnapshot

RULES = Path(__file__).resolve().parents[2] / "k8s" / "monitoring" / "specdec-alerts.yaml"

FULL = WindowSnapshot(
    variant="v1",
    rounds=10,
    proposed=30,
    accepted=15,
    acceptance_rate=0.5,
    position_acceptance=(0.8, 0.5, None),
    tokens_per_round=2.5,
    speculative_tokens_per_s=40.0,
    plain_tokens_per_s=25.0,
)
EMPTY = WindowSnapshot(
    variant="v2",
    rounds=3,
    proposed=0,
    accepted=0,
    acceptance_rate=None,
    position_acceptance=(None, None, None),
    tokens_per_round=None,
    speculative_tokens_per_s=None,
    plain_tokens_per_s=None,
)


class RecordedGauge:
    """Stands in for a Ray gauge: the last value set, by its tags."""

    def __init__(self) -> None:
        self.values: dict[tuple, float] = {}

    def set(self, value: float, tags: dict | None = None) -> None:
        assert value is not None  # Ray's gauge takes None as "do nothing": the watch must not lean on that
        self.values[tuple(sorted((tags or {}).items()))] = value


def _recorded(metrics: WatchMetrics) -> WatchMetrics:
    for name in (
        "acceptance",
        "position_acceptance",
        "tokens_per_round",
        "speculative_rate",
        "plain_rate",
        "replicas",
        "weight",
    ):
        setattr(metrics, name, RecordedGauge())
    return metrics


def test_an_export_sets_every_gauge_of_the_variant():
    metrics = _recorded(WatchMetrics("t", "d"))
    metrics.export(FULL, replicas=2, weight=0.75)
    v1 = (("variant", "v1"),)
    assert metrics.acceptance.values == {v1: 0.5} and metrics.tokens_per_round.values == {v1: 2.5}
    assert metrics.speculative_rate.values == {v1: 40.0} and metrics.plain_rate.values == {v1: 25.0}
    assert metrics.replicas.values == {v1: 2} and metrics.weight.values == {v1: 0.75}
    # Positions no round reached are not set (position 3 here).
    assert metrics.position_acceptance.values == {(("position", "1"), *v1): 0.8, (("position", "2"), *v1): 0.5}


def test_none_fields_leave_their_gauges_unset():
    metrics = _recorded(WatchMetrics("t", "d"))
    metrics.export(EMPTY, replicas=None, weight=0.25)  # a model-free variant, nothing proposed, no plain rounds
    assert metrics.weight.values == {(("variant", "v2"),): 0.25}
    for gauge in (
        metrics.acceptance,
        metrics.position_acceptance,
        metrics.tokens_per_round,
        metrics.speculative_rate,
        metrics.plain_rate,
        metrics.replicas,
    ):
        assert gauge.values == {}


def test_ray_metrics_take_the_exports_tags():
    # Ray's own metrics check the tags (every tag key given, values strings) whether or not a cluster is up.
    metrics = WatchMetrics("t", "d")
    metrics.export(FULL, replicas=1, weight=1.0)
    metrics.export(EMPTY, replicas=None, weight=0.0)
    metrics.demoted("v1")


def _rule_series() -> set[str]:
    exprs = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    return set(re.findall(r"\bray_specdec_\w+", "\n".join(exprs)))


def test_the_series_the_alert_rules_read_are_exported_under_those_names(ray_cluster):
    watch, serving = WatchMetrics("t-rules", "d-rules"), ServingMetrics("t-rules", "d-rules")
    watch.export(FULL, replicas=1, weight=1.0)
    watch.demoted("v1")
    serving.round(3, 0, 0)  # asked for drafts, got none: a target-only round, and k in the histogram
    wanted = _rule_series()
    assert len(wanted) >= 7, wanted  # the regex found the rules' series
    port = next(n["MetricsExportPort"] for n in ray_cluster.nodes() if n["Alive"])
    exported: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not wanted <= exported:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        exported = {line.split("{")[0] for line in text.splitlines() if 'target="t-rules"' in line}
        time.sleep(1)
    assert wanted <= exported, f"the rules read series nobody exports: {sorted(wanted - exported)}"
