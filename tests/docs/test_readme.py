"""README.md is true: its ``sh test`` blocks run, its links stay inside the
repository, and its layout names every package.

Each block marked with the info string ``sh test`` runs on its own from the
repository root, as a reader would paste it, on the simulated GPU: in bash (``-e``,
``-u``, ``pipefail``) and in dash (``-e``, ``-u``), Debian's ``sh``. A block must
clean up after itself: nothing it started may be left running.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import IO

import pytest

from kiwid.daemon.control.reload import RESTART_ONLY

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```sh test\n(.*?)^```$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def test_the_readme_has_blocks_to_run() -> None:
    assert len(blocks()) >= 2


# How a reader runs a block. Debian's sh is dash, which runs a script without job
# control: a block that stops its kiwid with `kill %1` works in bash only.
SHELLS = {
    "bash": ["bash", "-euo", "pipefail", "-c"],
    "dash": ["dash", "-eu", "-c"],
}


def _session_members(session: int) -> list[str]:
    """The live processes of a session (zombies aside), as ``pid: command line``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").strip()
        except OSError:
            continue  # it ended while we looked
        # After the command's name: state, ppid, process group, session.
        if fields[0] != "Z" and int(fields[3]) == session:
            members.append(f"{stat.parent.name}: {command.decode(errors='replace')}")
    return members


def run_block(argv: list[str], output: IO[str]) -> tuple[int, list[str]]:
    """Run a block as a reader's shell would, and see what it leaves running.

    The shell leads a session of its own, so every process the block starts is in
    that session unless it leaves it on purpose; a background job of a shell
    without job control also stays in the shell's process group.

    Args:
        argv: The shell's command line, the block last.
        output: Where the block's stdout and stderr go: a file, not a pipe, which a
            process left behind would hold open.

    Returns:
        The shell's exit status, and the processes the block left running
        (``pid: command line``), which are killed now.
    """
    shell = subprocess.Popen(
        argv, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        returncode = shell.wait(timeout=280)
    finally:
        shell.poll()  # reaped if it ended: a live shell would count as left running
        left = _session_members(shell.pid)
        if left:
            # The group outlives its leader while members remain: its id is not reused.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    return returncode, left


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs(index: int, shell: str, tmp_path: Path) -> None:
    argv = SHELLS[shell]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed")
    block = blocks()[index]
    with (tmp_path / "output").open("w+") as output:
        returncode, left = run_block([*argv, block], output)
        output.seek(0)
        said = output.read()
    assert returncode == 0, f"{block}\n--- exit {returncode}\n{said}"
    assert not left, f"{block}\n--- left running in {shell}: {left}\n{said}"
    if "scripts/demo" in block:
        assert "whole rotation" in said, said
    if "kiwictl -T 20" in block:
        assert "Successfully set the scheduler TQ to 20 seconds" in said, said
        assert "GPU 0" in said and "20" in said, said


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_stay_inside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    # The project's design brief lives outside the repository: users never see it.
    assert not re.search(r"(?<![\w-])shared/", text), f"{doc.name} points outside"
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+://", target):
            continue  # a web page, not a file
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc.name}: {target} leaves the repository"
        assert path.exists(), f"{doc.name}: {target} does not exist"


def test_the_layout_names_every_package() -> None:
    layout = README.read_text().split("## Layout", 1)[1]
    for package in sorted((REPO / "kiwid").iterdir()):
        if (package / "__init__.py").exists():
            assert f"kiwid/{package.name}/" in layout, package.name
    for sub in sorted((REPO / "kiwid" / "adapters").iterdir()):
        if (sub / "__init__.py").exists():
            assert f"{sub.name}/" in layout, sub.name
        elif sub.suffix == ".py" and sub.stem != "__init__":
            assert re.search(rf"\b{sub.stem}\b", layout), sub.stem
    for folder in ("bench", "etc", "systemd", "playbooks", "scripts", "docs", "proto"):
        assert f"\n{folder}/" in layout, folder


def test_the_restart_only_settings_are_listed() -> None:
    text = " ".join(README.read_text().split())
    found = re.search(r"These settings are read at start only: (.*?)\. ", text)
    assert found, "the README's list of restart-only settings"
    listed = re.findall(r"`([^`]+)`", found.group(1))
    # A table of settings is listed as `table.*`, e.g. `gpu.sim.*`.
    names = [name.removesuffix(".*") for name in listed]
    assert sorted(names) == sorted(name for name, _ in RESTART_ONLY)
    assert len(set(names)) == len(names), listed
