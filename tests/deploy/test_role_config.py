"""The role's /etc/kiwi.toml, rendered on this machine (no host booted): valid for
kiwid, every table once, kiwid_extra_config deep-merged, and the drop-in recording
exactly the settings kiwid reads only at start."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "playbooks" / "roles" / "kiwid"
BIN = Path(sys.executable).parent
PLAY = """\
- name: Render the kiwid role's templates here.
  hosts: localhost
  connection: local
  gather_facts: false
  vars_files: [{defaults}, {vars}]
  tasks:
    - name: Render kiwi.toml and the unit's drop-in.
      ansible.builtin.template:
        src: "{{{{ item.src }}}}"
        dest: "{{{{ item.dest }}}}"
        mode: "0644"
      loop:
        - {{src: {templates}/kiwi.toml.j2, dest: {out}/kiwi.toml}}
        - {{src: {templates}/override.conf.j2, dest: {out}/override.conf}}
"""


def render(tmp_path: Path, **variables: Any) -> tuple[str, str]:
    playbook = BIN / "ansible-playbook"
    assert playbook.exists(), "ansible-playbook is missing: scripts/bootstrap --dev installs it"
    play = tmp_path / "render.yml"
    play.write_text(
        PLAY.format(
            defaults=ROLE / "defaults" / "main.yml",
            vars=ROLE / "vars" / "main.yml",
            templates=ROLE / "templates",
            out=tmp_path,
        )
    )
    done = subprocess.run(
        [
            str(playbook),
            "-i",
            "localhost,",
            str(play),
            "-e",
            json.dumps({"ansible_python_interpreter": sys.executable, **variables}),
        ],
        capture_output=True,
        text=True,
        env={
            "PATH": f"{BIN}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
            "LANG": "C.UTF-8",
        },
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return (tmp_path / "kiwi.toml").read_text(), (tmp_path / "override.conf").read_text()


def check_config(path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kiwid", "check-config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_defaults_render_a_valid_file_with_state_under_the_runtime_directory(
    tmp_path: Path,
) -> None:
    text, dropin = render(tmp_path)
    check_config(tmp_path / "kiwi.toml")
    doc = tomllib.loads(text)
    assert doc["daemon"]["state_dir"] == "/run/kiwi/state"
    assert doc["control"]["socket"] == "/run/kiwi/kiwid.sock"
    assert doc["memory"] == {"reserve_mib": 1024, "swap": "none", "host_floor_mib": 4096}
    assert "kubernetes" not in doc
    assert '#   daemon.state_dir = "/run/kiwi/state"' in dropin


@pytest.mark.timeout(180)
def test_extra_config_deep_merges_into_the_roles_tables(tmp_path: Path) -> None:
    text, dropin = render(
        tmp_path,
        kiwid_memory_swap="checkpoint",
        kiwid_memory_host_floor_mib=2048,
        kiwid_gpu_overrides={"0": {"tq": 10.0}},
        kiwid_extra_config={
            "memory": {"reserve_mib": 3072},
            "gpu": {"sim": {"swap_in_gbps": 9.0}},
            "scheduler": {"gpu": {"GPU-8f6a": {"mode": "auto"}}},
            "kubernetes": {"replicas": 8},
        },
    )
    check_config(tmp_path / "kiwi.toml")
    headers = [line for line in text.splitlines() if line.startswith("[")]
    assert len(headers) == len(set(headers)), headers  # never a table twice
    doc = tomllib.loads(text)
    assert doc["memory"] == {"reserve_mib": 3072, "swap": "checkpoint", "host_floor_mib": 2048}
    assert doc["gpu"]["sim"] == {"devices": 1, "memory_gib": 80.0, "swap_in_gbps": 9.0}
    assert doc["scheduler"]["gpu"] == {"0": {"tq": 10.0}, "GPU-8f6a": {"mode": "auto"}}
    assert doc["scheduler"]["tq"] == 30.0
    assert doc["kubernetes"] == {"replicas": 8}
    # gpu.sim is read at start: recorded in the drop-in; memory.* is reloaded: not there.
    assert '"swap_in_gbps": 9.0' in dropin
    assert "memory." not in dropin and "3072" not in dropin and "checkpoint" not in dropin
