"""kiwid's command line as an operator meets it: the console script's usage, and
what it says when it cannot start.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.conftest import config_text
from tests.stand_ins import DIRECTORY, NVML_MACHINE, write_machine

# The console script that `pip install` made next to this interpreter (.venv/bin/kiwid).
KIWID = Path(sys.executable).with_name("kiwid")
USAGE = [
    "usage: kiwid [--config PATH]",
    "       kiwid check-config [PATH]",
    "       kiwid recover [--config PATH]",
]


def _usage(said: str) -> list[str]:
    """The usage at the start of argparse's output: the ``usage:`` line and those under it."""
    first, *rest = said.splitlines() or [""]
    assert first.startswith("usage: "), said
    return [first, *itertools.takewhile(lambda line: line.startswith(" " * 7), rest)]


def kiwid(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert KIWID.exists(), f"{KIWID} is missing: scripts/bootstrap installs it"
    return subprocess.run(
        [str(KIWID), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )


def test_the_usage_line_shows_every_form_of_the_command() -> None:
    helped = kiwid("--help")
    assert (helped.returncode, helped.stderr) == (0, ""), helped.stderr
    assert _usage(helped.stdout) == USAGE
    assert "--config PATH" in helped.stdout.split("options:", 1)[1]

    wrong = kiwid("--bogus")
    assert wrong.returncode == 2, wrong.stderr
    assert _usage(wrong.stderr) == USAGE
    assert wrong.stderr.endswith("kiwid: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize("driver", ["no library", "DRIVER_NOT_LOADED"])
def test_without_a_gpu_the_hint_names_the_config_file_in_use(workdir: Path, driver: str) -> None:
    config = workdir / "node.toml"  # not /etc/kiwi.toml
    config.write_text(config_text(workdir).replace('backend = "sim"', 'backend = "nvml"'))
    # The stand-in pynvml: no libnvidia-ml.so.1 without a machine file, else what it says.
    path = os.pathsep.join(filter(None, [str(DIRECTORY), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop(NVML_MACHINE, None)
    if driver != "no library":
        machine = workdir / "nvml.json"
        write_machine(machine, {"init": driver, "devices": []})
        env[NVML_MACHINE] = str(machine)

    out = kiwid("--config", str(config), env=env)

    assert out.returncode == 3, out.stderr
    assert f'set [gpu] backend = "sim" in {config}\n' in out.stderr
    assert "/etc/kiwi.toml" not in out.stderr
