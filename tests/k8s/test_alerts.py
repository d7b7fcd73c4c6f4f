"""The alert rules (k8s/monitoring/specdec-alerts.yaml): promtool checks them and runs their unit tests
(specdec-alerts.test.yaml), the PrometheusRule in k8s/components/monitoring carries the same groups, and every alert
has its runbook in docs/observability.md.

promtool comes from `make setup` (Debian's prometheus package, where apt-get is). Where it is missing these tests
fail, so that a machine without it cannot pass them silently; SPECDEC_NO_PROMTOOL=1 makes them skip instead."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.k8s.manifests import K8S, ROOT, one, render_with
from tests.k8s.shapes import SHAPES

RULES = K8S / "monitoring" / "specdec-alerts.yaml"
RULE_TESTS = K8S / "monitoring" / "specdec-alerts.test.yaml"
DOCS = ROOT / "docs" / "observability.md"


def promtool() -> str:
    """promtool's path; a failure where it is missing, or a skip where SPECDEC_NO_PROMTOOL=1 says to."""
    path = shutil.which("promtool")
    if path:
        return path
    if os.environ.get("SPECDEC_NO_PROMTOOL") == "1":
        pytest.skip("promtool is missing and SPECDEC_NO_PROMTOOL=1: the alert rules are NOT checked")
    pytest.fail(
        "promtool is missing: run `make setup` (it installs Debian's prometheus package where apt-get is), "
        "or set SPECDEC_NO_PROMTOOL=1 to skip the alert rules' tests",
        pytrace=False,
    )


def run_promtool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_the_rules():
    result = run_promtool("check", "rules", RULES, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_the_rules_pass_their_promtool_unit_tests():
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alerts()])
def test_the_unit_tests_fail_when_an_alert_that_should_fire_is_left_out(tmp_path, alert):
    # The same tests with every expectation that `alert` fires made empty: promtool must see it fire and fail.
    tests = yaml.safe_load(RULE_TESTS.read_text())
    emptied = 0
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            if check["alertname"] == alert and check.get("exp_alerts"):
                check["exp_alerts"] = []
                emptied += 1
    assert emptied, f"no unit test expects {alert} to fire"
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / RULE_TESTS.name).write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr, result.stdout
    assert alert in result.stdout + result.stderr


def test_every_alert_is_tested_both_firing_and_quiet():
    checks = [check for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for check in case["alert_rule_test"]]
    for rule in alerts():
        mine = [check for check in checks if check["alertname"] == rule["alert"]]
        assert any(check.get("exp_alerts") for check in mine), f"{rule['alert']}: never expected to fire"
        assert any(not check.get("exp_alerts") for check in mine), f"{rule['alert']}: never expected to stay quiet"


def test_without_promtool_the_tests_fail_unless_told_to_skip(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no promtool on it
    monkeypatch.delenv("SPECDEC_NO_PROMTOOL", raising=False)
    with pytest.raises(pytest.fail.Exception, match="make setup"):
        promtool()
    monkeypatch.setenv("SPECDEC_NO_PROMTOOL", "1")
    with pytest.raises(pytest.skip.Exception, match="SPECDEC_NO_PROMTOOL=1"):
        promtool()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="renders the component with `kubectl kustomize`")
def test_the_prometheus_rule_carries_the_plain_files_groups(tmp_path):
    rule = one(render_with(tmp_path, "gpu", "monitoring"), "PrometheusRule")
    jsonschema.Draft7Validator(SHAPES[rule["apiVersion"], rule["kind"]]).validate(rule)
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"], (
        "the PrometheusRule differs from k8s/monitoring/specdec-alerts.yaml: run scripts/prometheus_rule.py"
    )


def test_the_prometheus_rule_shape_catches_a_misspelt_key(tmp_path):
    rule = yaml.safe_load_all((K8S / "components" / "monitoring" / "prometheusrule.yaml").read_text())
    [rule] = list(rule)
    rule["spec"]["groups"][0]["rules"][0]["annotation"] = rule["spec"]["groups"][0]["rules"][0].pop("annotations")
    with pytest.raises(jsonschema.ValidationError, match="annotation"):
        jsonschema.Draft7Validator(SHAPES[rule["apiVersion"], rule["kind"]]).validate(rule)


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as dashes."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_a_severity_words_and_a_runbook_in_the_docs():
    anchors = _anchors(DOCS.read_text())
    assert "alerts" in anchors
    for rule in alerts():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), rule["alert"]
        page, anchor = rule["annotations"]["runbook_url"].split("#")
        assert (ROOT / page) == DOCS and anchor == rule["alert"].lower() and anchor in anchors, rule["alert"]
