"""README.md is true: its ``sh test`` blocks run, its links stay inside the
repository, and its layout names every package.

Each block marked with the info string ``sh test`` runs on its own in bash (``-e``,
``-u``, ``pipefail``) from the repository root, as a reader would paste it, on the
simulated GPU. A block must clean up after itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

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


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs(index: int) -> None:
    block = blocks()[index]
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, f"{block}\n--- exit {done.returncode}\n{done.stdout}{done.stderr}"
    if "scripts/demo" in block:
        assert "whole rotation" in done.stdout, done.stdout
    if "kiwictl -T 20" in block:
        assert "Successfully set the scheduler TQ to 20 seconds" in done.stdout, done.stdout
        assert "GPU 0" in done.stdout and "20" in done.stdout, done.stdout


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
