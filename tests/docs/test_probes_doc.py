"""docs/kubernetes.md, "Probes", says what kiwid does: the names and numbers it gives.

The series and gates it names exist; the status fields are those a waiter has; the
worked example's bounds are those the real scheduler gives (TQ 30 s, three tenants);
and its probe budget covers the longest of them by the rule it states. What the
probes see under each gate is tested on real containers and the driver double in
tests/daemon/test_probes_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from kiwid.adapters.metrics import METRIC_FAMILIES
from kiwid.config.schema import GATES, SchedulerSettings
from kiwid.core.events import SwapFinished
from kiwid.core.model import SwapMode
from tests.daemon.test_status_waits import Card, GiB

TIMES = "\N{MULTIPLICATION SIGN}"  # as the doc writes it
DOC = Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Probes\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def bounds(**policy: object) -> list[float]:
    """The waiters' ``wait_bound_s`` with three busy tenants at TQ 30 s (one holds)."""
    card = Card(idle_release_s=60, **policy)
    card.burst("a", "b", "c", size=3 * GiB)
    for swap in card.swaps:  # the waiters' memory is in host RAM
        card.do(SwapFinished(swap.tenant, "out", ok=True, moved_bytes=3 * GiB, epoch=swap.epoch))
    return [w["wait_bound_s"] for w in card.waiters()]


def test_the_series_and_gates_it_names_exist() -> None:
    text = section()
    named = set(re.findall(r"\bkiwi_[a-z0-9_]+\b", text))
    assert "kiwi_waiter_wait_bound_seconds" in named
    assert named <= set(METRIC_FAMILIES), named - set(METRIC_FAMILIES)
    gates = set(re.findall(r'gpu\.gate = "([^"]+)"', text))
    assert gates == {"freeze", "cuda-lock"}
    assert gates <= set(GATES)


def test_the_status_fields_it_names_are_a_waiters() -> None:
    text = section()
    card = Card()
    card.burst("a", "b")
    (waiter,) = card.waiters()
    for field in ("wait_bound_s", "wait_bound_reason"):
        assert f"`{field}" in text
        assert field in waiter
    assert f"({SchedulerSettings().handover_allowance:g} s by default)" in text


def test_the_worked_example_gives_the_schedulers_bounds() -> None:
    text = section()
    resident = bounds()
    assert resident == [32.0, 62.0]
    assert "bounds are 32 s (next: the holder's 30 s + 2) and 62 s" in text
    assert "frozen up to 62 s at a time" in text
    swapping = bounds(swap=SwapMode.CHECKPOINT, capacity_bytes=10 * GiB, reserve_bytes=GiB)
    assert swapping == [62.0, 122.0]
    assert "62 s and 122 s in the example" in text


def test_its_budget_covers_the_longest_wait_and_the_defaults_do_not() -> None:
    text = section()
    block = re.search(r"```yaml\n(livenessProbe:.*?)```", text, re.DOTALL)
    assert block is not None
    probe = yaml.safe_load(block.group(1))["livenessProbe"]
    period, timeout, threshold = (
        probe[k] for k in ("periodSeconds", "timeoutSeconds", "failureThreshold")
    )
    longest = max(bounds())
    covered = (threshold - 1) * period + timeout
    assert covered > longest
    said = f"{threshold - 1} {TIMES} {period} + {timeout} = {covered} s > {longest:g} s"
    assert said in text
    # The kubelet's defaults: period 10, timeout 1, threshold 3.
    assert (3 - 1) * 10 + 1 == 21 < longest
    assert f"2 {TIMES} 10 + 1 = 21 s" in text
