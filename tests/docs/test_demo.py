"""scripts/demo.py as a user without root: it schedules, shows the rotation,
freezes nothing, and exits 0 (kiwid's own start-up and clean-up included).

It runs as uid nobody with the system's python3 and a world-readable copy of
kiwid and its dependencies (tests/readable.py): the checkout and its virtualenv
may be out of nobody's reach (under /root).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.readable import REPO, runtime_copy

NOBODY = 65534

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_the_demo_without_root_schedules_freezes_nothing_and_exits_0() -> None:
    if os.geteuid() != 0:
        pytest.skip("switching to uid nobody needs root")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 for uid nobody")
    site = runtime_copy()
    demo = site / "demo.py"
    shutil.copyfile(REPO / "scripts" / "demo.py", demo)
    demo.chmod(0o644)
    done = subprocess.run(
        [python, str(demo), "--duration", "8", "--tq", "1"],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "LANG": "C.UTF-8"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "not root: scheduling shown, nothing frozen" in out, out
    rows = re.findall(r"^\s+\d+\.\d+\s+(\S+)\s+(.+?)\s{2,}(\S+)$", out, re.MULTILINE)
    assert rows, out
    holders = {holder for holder, _, _ in rows} - {"-"}
    assert {"alice", "bob", "carol"} <= holders, out  # the rotation, shown
    assert all(frozen == "-" for _, _, frozen in rows), out  # nothing frozen
    assert "whole rotation" in out, out
    pid = int(re.search(r"kiwid \(pid (\d+)\)", out).group(1))  # type: ignore[union-attr]
    assert not Path(f"/proc/{pid}").exists(), "the demo left its kiwid running"
