"""The Grafana dashboard (etc/grafana/kiwi.json): built by scripts/dashboard.py, and
querying only what kiwid and the shipped recording rules provide."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.prometheus.test_rules import REPO, RULE_FILES, exported_series, kiwi_names, promtool

DASHBOARD = REPO / "etc" / "grafana" / "kiwi.json"


def _exprs_of(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _exprs_of(value)]
    if isinstance(node, list):
        return [e for value in node for e in _exprs_of(value)]
    return []


def exprs() -> list[str]:
    return _exprs_of(json.loads(DASHBOARD.read_text()))


def test_the_committed_dashboard_is_what_the_script_builds() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_its_queries_use_only_series_kiwid_exports_and_the_shipped_rules() -> None:
    recorded = {
        rule["record"]
        for path in RULE_FILES
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    queries = exprs()
    assert len(queries) >= 15
    exported = exported_series()
    for expr in queries:
        assert kiwi_names(expr) <= exported, expr
        assert set(re.findall(r"\bkiwi:[a-z0-9_:]+", expr)) <= recorded, expr
    used = {name for expr in queries for name in kiwi_names(expr)}
    assert "kiwi_waiter_wait_seconds" in used and "up" not in used  # kiwi_ names only
    # Waits against kiwid's own bound; weights, priorities, preemptions by reason, and
    # entitled against received share (recorded from the entitled and holding counters).
    assert {
        "kiwi_waiter_wait_bound_seconds",
        "kiwi_tenant_weight",
        "kiwi_tenant_priority",
        "kiwi_tenant_preemptions_total",
        "kiwi_tenant_stuck",
        "kiwi_tenant_declared_bytes",
    } <= used
    assert not [e for e in queries if "kiwi_gpu_tq_seconds" in e and "+ 2" in e]
    shares = {
        "kiwi:tenant_gpu_time_entitled_share:ratio_rate5m",
        "kiwi:tenant_gpu_time_share:ratio_rate5m",
    }
    side_by_side = [
        panel["title"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        if shares <= {e.split("{")[0] for e in _exprs_of(panel)}
    ]
    assert side_by_side == ["Entitled and received share"]
    # What a tenant uses beside what it declared: one above the other grew past it.
    memory = {"kiwi_tenant_footprint_bytes", "kiwi_tenant_declared_bytes"}
    beside = [
        panel["title"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        if memory <= {e.split("{")[0] for e in _exprs_of(panel)}
    ]
    assert beside == ["GPU memory used and declared, per tenant"]


def test_its_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (its template variables filled in) as a rule."""
    rules = [
        {
            "record": f"dashboard:query{i}",
            "expr": expr.replace("$instance", ".*").replace("$gpu", ".*"),
        }
        for i, expr in enumerate(exprs())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
