"""scripts/timeline.py: its drawing (made-up samples) and a short real run.

The picture in docs/scheduling.md is what the script draws from a real kiwid; these
tests check that the drawing says what the samples say, and that a real run works
and leaves nothing behind (no kiwid, no cgroup, so nothing frozen).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "timeline.py"
SVG = "{http://www.w3.org/2000/svg}"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kiwi_timeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


timeline = load_script()
drawing = importlib.import_module("timeline_svg")  # its drawing half, found beside it


def at(t: float, **tenants: dict[str, Any]) -> dict[str, Any]:
    return {"t": t, "tenants": tenants}


def holds(**kw: Any) -> dict[str, Any]:
    return {"state": "holder", "gated": False, "boosted": False, "preempted_priority": 0, **kw}


def waits(**kw: Any) -> dict[str, Any]:
    return {"state": "waiting", "gated": True, "boosted": False, "preempted_priority": 0, **kw}


# A made-up run: a and b take turns, c (a higher class) comes at 3 s and preempts b,
# then a gets one quantum after max_wait; c leaves at 6 s.
SAMPLES = [
    at(0.0, a=holds(), b=waits()),
    at(1.0, a=holds(), b=waits()),
    at(2.0, a=waits(), b=holds()),
    at(3.0, a=waits(), b=holds(), c=waits()),
    at(3.5, a=waits(), b=waits(preempted_priority=1, preempted_by="c"), c=holds()),
    at(5.0, a=holds(boosted=True), b=waits(preempted_priority=1), c=waits()),
    at(6.0, a=waits(), b=holds(preempted_priority=1)),
    at(7.0, a=waits(), b=holds(preempted_priority=1)),
]
LANES = [
    timeline.Lane("a", "a: weight 1, priority 0", "#111111"),
    timeline.Lane("b", "b <&> weight 2", "#222222"),
    timeline.Lane("c", "c: priority 10", "#333333"),
]


def rects(root: ET.Element, kind: str, color: str) -> list[ET.Element]:
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == kind and r.get("fill") == color]


def test_the_drawing_is_an_svg_that_shows_the_samples() -> None:
    text = timeline.render(
        SAMPLES, LANES, title="A made-up run", markers=[(3.0, "c starts")], notes=["a note"]
    )

    root = ET.fromstring(text)  # well-formed XML, or this raises
    assert root.tag == f"{SVG}svg"
    width, height = float(root.get("width", "0")), float(root.get("height", "0"))
    assert root.get("viewBox") == f"0 0 {width:g} {height:g}"
    for r in root.iter(f"{SVG}rect"):
        x, w = float(r.get("x", "0")), float(r.get("width", "0"))
        assert x >= 0 and w > 0 and x + w <= width
    # a holds 0-2 s and, boosted, 5-6 s; b holds 2-3.5 s and 6-7 s; c 3.5-5 s.
    assert len(rects(root, "holds", "#111111")) == 1
    assert len(rects(root, "boosted", "#111111")) == 1
    assert len(rects(root, "holds", "#222222")) == 2
    assert len(rects(root, "holds", "#333333")) == 1
    assert len(rects(root, "waits", "#222222")) == 2  # 0-2 s and 3.5-6 s
    (first,) = rects(root, "holds", "#111111")
    (later,) = rects(root, "holds", "#333333")
    assert float(first.get("x", "0")) < float(later.get("x", "0"))
    # One preemption, on b's lane, for c.
    (preemption,) = [g for g in root.iter(f"{SVG}g") if g.get("class") == "preemption"]
    assert preemption.findtext(f"{SVG}title") == "preempted at 3.5 s for c"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "b <&> weight 2" in texts  # escaped in the file, intact when read
    assert "c starts" in texts
    assert "a note" in texts
    # What each lane held: a 2 s + 1 s boosted, b 1.5 s + 1 s, c 1.5 s.
    assert [t for t in texts if t and t.startswith("held")] == [
        "held 3.0 s",
        "held 2.5 s",
        "held 1.5 s",
    ]
    assert root.findtext(f"{SVG}title") == "A made-up run"


def test_spans_merge_samples_and_a_tenant_that_left_has_none() -> None:
    spans = drawing.spans(SAMPLES, "a")
    assert [(s.start, s.end, s.kind) for s in spans] == [
        (0.0, 2.0, "holds"),
        (2.0, 5.0, "waits"),
        (5.0, 6.0, "boosted"),
        (6.0, 7.0, "waits"),
    ]
    # c waits, holds, waits for a's boost, and is gone from 6 s on.
    assert [(s.start, s.end, s.kind) for s in drawing.spans(SAMPLES, "c")] == [
        (3.0, 3.5, "waits"),
        (3.5, 5.0, "holds"),
        (5.0, 6.0, "waits"),
    ]
    assert drawing.spans(SAMPLES, "nobody") == []
    assert drawing.preemptions(SAMPLES, "b") == [(3.5, "c")]
    assert drawing.preemptions(SAMPLES, "a") == []


def test_a_timeline_needs_two_samples() -> None:
    with pytest.raises(ValueError, match="two samples"):
        timeline.render(SAMPLES[:1], LANES, title="too short")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_short_real_run_draws_its_timeline_and_leaves_nothing_behind(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the script puts tenants in cgroups: it needs root")
    if not (timeline.V2 / "cgroup.subtree_control").exists():
        pytest.skip("no cgroup2 hierarchy")
    out, samples = tmp_path / "t.svg", tmp_path / "t.json"
    args = ["--duration", "5", "--tq", "0.5", "--urgent-at", "1.5", "--urgent-for", "2"]
    args += [
        "--preempt-after",
        "0",
        "--max-wait",
        "0",
        "--out",
        str(out),
        "--samples",
        str(samples),
    ]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the script cleans up on SIGTERM
            stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stdout + stderr

    started = re.search(r"kiwid \(pid (\d+)\) on the simulated GPU, tenants under (\S+);", stdout)
    assert started, stdout
    assert not Path(f"/proc/{started.group(1)}").exists(), "the script left its kiwid running"
    assert not Path(started.group(2)).exists(), "the script left its cgroups behind"

    data = json.loads(samples.read_text())
    seen: dict[str, dict[str, Any]] = {}
    for sample in data["samples"]:
        for name, tenant in sample["tenants"].items():
            seen.setdefault(name, tenant)
    # kiwid took the script's [[tenants]] rules.
    assert {n: (t["weight"], t["priority"]) for n, t in seen.items()} == {
        "alice": (1, 0),
        "bob": (2, 0),
        "urgent": (1, 10),
    }
    states = {(n, t["state"]) for s in data["samples"] for n, t in s["tenants"].items()}
    assert ("urgent", "holder") in states  # the priority tenant got the GPU

    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"
    labels = [t.text or "" for t in root.iter(f"{SVG}text")]
    for name in ("alice", "bob", "urgent"):
        assert any(label.startswith(f"{name}: ") for label in labels), labels
    assert any(r.get("class") == "holds" for r in root.iter(f"{SVG}rect"))
