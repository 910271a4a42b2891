"""scripts/test, which CI runs: the limits the suite runs under."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.readable import REPO

SCRIPT = REPO / "scripts" / "test"


def _stock_open_files_after(limit: str) -> str:
    """The soft open-file limit after scripts/test's own step, from soft ``limit``."""
    text = SCRIPT.read_text()
    match = re.search(r"^stock_open_files\(\) \{\n.*?^\}\n", text, re.MULTILINE | re.DOTALL)
    assert match is not None, "scripts/test has no stock_open_files()"
    # Up to its first pytest run (it runs pytest twice: in parallel, then serially).
    before_pytest = re.split(r"^pytest ", text[match.end() :], maxsplit=1, flags=re.MULTILINE)[0]
    assert before_pytest != text[match.end() :], "scripts/test runs no pytest"
    assert re.search(r"^stock_open_files$", before_pytest, re.MULTILINE), (
        "scripts/test does not call stock_open_files() before pytest"
    )
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; ulimit -Sn {limit}\n{match.group(0)}"
         "stock_open_files; ulimit -Sn"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("4096", "1024"),  # a machine's higher limit is lowered to Debian 12's stock one
        ("1024", "1024"),
        ("256", "256"),  # a lower one is kept, never raised
    ],
)
def test_the_suite_runs_at_debians_stock_open_file_limit(before: str, after: str) -> None:
    assert _stock_open_files_after(before) == after
