"""deploy/prometheus/fleetwatch-alerts.yaml with the real promtool (Debian's prometheus package):
the rules load, their unit tests (fleetwatch-alerts.test.yaml) pass, every alert is tested both
firing and quiet, and every rule says what it is, why, and where to look."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.harness.prometheus import PrometheusError, find_promtool

RULES = ROOT / "deploy" / "prometheus" / "fleetwatch-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "fleetwatch-alerts.test.yaml"

# What the rules file is for (issue 17): each must have an alert.
WATCHED = {
    "FleetWatchMetricsDown", "FleetWatchMetricsAbsent", "FleetWatchDatabaseUnreadable",
    "FleetWatchSourceDown", "FleetWatchSourceLagging", "FleetWatchDiagnosisBacklog",
    "FleetWatchRemediationStepStuck", "FleetWatchStormBrakeEngaged",
    "FleetWatchDeliveriesFailed", "FleetWatchDeliveriesRetrying",
    "FleetWatchAuditTrailShrank", "FleetWatchAuditTrailRewritten",
    "FleetWatchDrillFailed", "FleetWatchNoRecentDrill",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return find_promtool()
    except PrometheusError as exc:
        pytest.fail(f"{exc}; run the tests with `make test`")


def run(promtool: str, *args: str | Path) -> str:
    done = subprocess.run([promtool, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=RULES.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def test_rules_load(promtool: str) -> None:
    output = run(promtool, "check", "rules", RULES)
    assert f"SUCCESS: {len(rules())} rules found" in output


def test_rule_unit_tests_pass(promtool: str) -> None:
    assert "SUCCESS" in run(promtool, "test", "rules", RULE_TESTS)


def test_every_alert_is_tested_firing_and_quiet() -> None:
    alerts = {rule["alert"] for rule in rules()}
    assert alerts == WATCHED
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert alerts - fired == set(), "never seen firing"
    assert alerts - quiet == set(), "never seen quiet"
    # The unit tests are of this file, not a copy.
    assert yaml.safe_load(RULE_TESTS.read_text())["rule_files"] == [RULES.name]


def test_every_rule_explains_itself() -> None:
    text = RULES.read_text()
    for rule in rules():
        name = rule["alert"]
        annotations = rule.get("annotations", {})
        assert {"summary", "description", "runbook"} <= set(annotations), name
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert "for" in rule, f"{name}: say how long, even 0m"
        # The `for:` is explained in a comment just above the rule's expression.
        block = text[text.index(f"alert: {name}"):]
        assert "\n        #" in block[:block.index("expr:")], f"{name}: no comment on why"
