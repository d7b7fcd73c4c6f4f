"""Writes k8s/components/monitoring/prometheusrule.yaml, the Prometheus Operator's PrometheusRule carrying the groups
of k8s/monitoring/specdec-alerts.yaml (the plain rules file, which promtool checks and tests). Run it after editing
the rules; tests/k8s/test_alerts.py fails while the two differ.

Usage: python scripts/prometheus_rule.py [--check]   (--check: exit 1 if the checked-in file is not what it would write)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "k8s" / "monitoring" / "specdec-alerts.yaml"
OUT = ROOT / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# Generated from k8s/monitoring/specdec-alerts.yaml by scripts/prometheus_rule.py: edit that file, then run the script.
# The alerts, what they mean and what to do: docs/observability.md#alerts.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the expressions) as literal blocks, as the rules file writes them."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _string)


def prometheus_rule(rules_text: str) -> str:
    """The PrometheusRule's YAML for the plain rules file's text."""
    groups = yaml.safe_load(rules_text)["groups"]
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "specdec-alerts"},
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in file is out of date")
    wanted = prometheus_rule(RULES.read_text())
    if parser.parse_args().check:
        if not OUT.exists() or OUT.read_text() != wanted:
            print(f"{OUT.relative_to(ROOT)} is out of date: run scripts/prometheus_rule.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
