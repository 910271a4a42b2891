"""Run the project's playbooks against a :class:`~tests.deploy.hosts.Fleet`.

The wheelhouse is built here, on the controller, from a copy of the checkout
(``pip wheel``: kiwi-gpu and every dependency), and the hosts install from it
offline (``kiwid_pip_offline``): they have no route to any package index.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.deploy.hosts import Fleet

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"
BIN = Path(sys.executable).parent
RECAP = re.compile(
    r"^(?P<host>\S+)\s+: ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)",
    re.MULTILINE,
)
VERSION_LINE = re.compile(r'^(version = |__version__ = )"(?P<v>[^"]+)"', re.MULTILINE)


def source_copy(dest: Path, version: str | None = None, source: Path = REPO) -> Path:
    """Copy what a wheel is built from into ``dest``; optionally change its version.

    ``source`` is the checkout, or an earlier copy (so that a second wheel is built
    from the very same tree as the first, whatever changed in the checkout since).
    """
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(source / name, dest / name)
    shutil.copytree(source / "kiwid", dest / "kiwid", ignore=shutil.ignore_patterns("__pycache__"))
    if version is not None:
        for file in (dest / "pyproject.toml", dest / "kiwid" / "__init__.py"):
            text = file.read_text()
            file.write_text(VERSION_LINE.sub(lambda m: f'{m.group(1)}"{version}"', text, count=1))
    return dest


def project_version(source: Path = REPO) -> str:
    match = VERSION_LINE.search((source / "kiwid" / "__init__.py").read_text())
    assert match is not None, "no __version__ in kiwid/__init__.py"
    return match.group("v")


def next_version(version: str) -> str:
    """The version after ``version``: its third number plus one (0.1.0 -> 0.1.1)."""
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    assert match is not None, f"cannot bump version {version!r}"
    major, minor, micro = (int(x) for x in match.groups())
    return f"{major}.{minor}.{micro + 1}"


def build_wheels(src: Path, wheelhouse: Path, *, deps: bool = True) -> None:
    """``pip wheel`` the source (and, with ``deps``, every dependency) into ``wheelhouse``."""
    argv = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheelhouse), str(src)]
    if not deps:
        argv.insert(4, "--no-deps")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip wheel failed:\n{done.stdout}{done.stderr}")


@dataclass
class Run:
    """One ansible-playbook run: exit status, output and the PLAY RECAP per host."""

    argv: list[str]
    returncode: int
    output: str
    recap: dict[str, dict[str, int]]
    seconds: float

    def changed(self, host: str) -> int:
        return self.recap[host]["changed"]

    def explain(self) -> str:
        return f"$ {' '.join(self.argv)}  (exit {self.returncode})\n{self.output[-6000:]}"


class Ansible:
    """ansible-playbook with an inventory of the fleet and a private Ansible home."""

    def __init__(self, fleet: Fleet, wheelhouse: Path) -> None:
        self.fleet = fleet
        self.dir = fleet.workdir / "ansible"
        self.dir.mkdir()
        self.wheelhouse = wheelhouse
        # The inventory's group variables; tests change them as an operator would.
        self.vars: dict[str, Any] = {
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(fleet.key),
            "ansible_python_interpreter": "/usr/bin/python3",
            "kiwid_gpu_backend": "sim",
            "kiwid_sim_devices": 1,
            "kiwid_poll_interval": 0.2,
            "kiwid_wheelhouse": str(wheelhouse),
            "kiwid_build_wheel": False,
            "kiwid_pip_offline": True,
        }
        self.cfg = self.dir / "ansible.cfg"
        self.cfg.write_text(
            "[defaults]\n"
            f"home = {self.dir / 'home'}\n"
            f"local_tmp = {self.dir / 'tmp'}\n"
            "host_key_checking = False\n"
            "forks = 10\n"
            "nocolor = True\n"
            "[ssh_connection]\n"
            "pipelining = True\n"
            f"control_path_dir = {self.dir / 'cp'}\n"
            "control_path = %(directory)s/%%C\n"
            "ssh_args = -o ControlMaster=auto -o ControlPersist=120s"
            " -o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no -o LogLevel=ERROR\n"
        )

    def write_inventory(self) -> Path:
        inventory = {
            "kiwi_nodes": {
                "vars": self.vars,
                "hosts": {h.name: {"ansible_host": h.address} for h in self.fleet.hosts},
            }
        }
        path = self.dir / "inventory.json"  # JSON is YAML: Ansible's yaml plugin reads it
        path.write_text(json.dumps(inventory, indent=1))
        return path

    def play(
        self, playbook: str, *args: str, extra: dict[str, Any] | None = None, timeout: float = 400
    ) -> Run:
        """Run ``playbooks/<playbook>`` against every host of the fleet."""
        argv = [
            str(BIN / "ansible-playbook"),
            "-i",
            str(self.write_inventory()),
            str(PLAYBOOKS / playbook),
            *args,
        ]
        # serial is a play keyword: only extra vars reach it. All hosts at once,
        # unless a test asks for batches.
        argv += ["-e", json.dumps({"kiwid_serial": "100%", **(extra or {})})]
        env = {
            "PATH": f"{BIN}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.dir),
            "LANG": "C.UTF-8",
            "ANSIBLE_CONFIG": str(self.cfg),
            "ANSIBLE_FORCE_COLOR": "0",
            "PYTHONWARNINGS": "ignore",
        }
        started = time.monotonic()
        done = subprocess.run(
            argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
        output = done.stdout + done.stderr
        (self.dir / "last-run.log").write_text(output)
        recap = {
            m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in RECAP.finditer(output)
        }
        return Run(argv, done.returncode, output, recap, time.monotonic() - started)

    def close(self) -> None:
        """End the SSH master connections that Ansible left open to the hosts."""
        for host in self.fleet.hosts:
            subprocess.run(
                [
                    "ssh",
                    "-o",
                    f"ControlPath={self.dir / 'cp'}/%C",
                    "-O",
                    "exit",
                    f"root@{host.address}",
                ],
                capture_output=True,
                timeout=10,
                check=False,
            )
