"""The shipped Prometheus rules (etc/prometheus): promtool's checks and unit tests.

promtool comes with Debian's ``prometheus`` package (scripts/bootstrap --dev
installs it). Without it these tests skip on a developer's machine and fail in
CI (``CI`` set), so that CI cannot pass by skipping them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from kiwid.adapters.metrics import HISTOGRAM_FAMILIES, METRIC_FAMILIES
from tests.tools import need

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "etc" / "prometheus"
RULE_FILES = (RULES / "kiwi.rules.yml", RULES / "kiwi.alerts.yml")
UNIT_TESTS = Path(__file__).with_name("kiwi_rules_test.yml")
# The alerts that docs/monitoring.md promises.
ALERTS = {
    "KiwidDown",
    "KiwidNotScraped",
    "KiwiTenantWaitsTooLong",
    "KiwiSwapRefusedHostMemoryFloor",
    "KiwiGateFailing",
    "KiwiTenantStuck",
    "KiwidReloadFailed",
    "KiwiGpuUnhealthy",
}


def promtool() -> str:
    return need("promtool", "scripts/bootstrap --dev installs Debian's prometheus")


def exported_series() -> set[str]:
    """Every series name kiwid's /metrics can carry (a histogram's three among them)."""
    names = set(METRIC_FAMILIES)
    for family in HISTOGRAM_FAMILIES:
        names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    return names


def kiwi_names(expr: str) -> set[str]:
    """The kiwid series an expression reads (recorded ``kiwi:`` names excepted)."""
    return set(re.findall(r"\bkiwi_[a-z0-9_]+\b", expr))


def rules() -> list[dict[str, object]]:
    found = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend(group["rules"])
    return found


def test_promtool_accepts_the_rule_files() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", *map(str, RULE_FILES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    done = subprocess.run(
        [promtool(), "test", "rules", UNIT_TESTS.name],
        cwd=UNIT_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_rules_read_only_series_kiwid_exports() -> None:
    exported = exported_series()
    for rule in rules():
        expr = str(rule["expr"])
        unknown = kiwi_names(expr) - exported
        assert not unknown, f"{rule.get('alert') or rule.get('record')} reads {unknown}"
    assert {str(r["alert"]) for r in rules() if "alert" in r} == ALERTS


def test_every_alert_is_unit_tested() -> None:
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == ALERTS
    recorded = {str(r["record"]) for r in rules() if "record" in r}
    assert recorded and recorded <= set(re.findall(r"expr: (kiwi:\S+)", UNIT_TESTS.read_text()))
