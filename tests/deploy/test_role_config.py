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
    assert doc["memory"] == {
        "reserve_mib": 1024,
        "swap": "none",
        "park": "idle",
        "host_floor_mib": 4096,
    }
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
    assert doc["memory"] == {
        "reserve_mib": 3072,
        "swap": "checkpoint",
        "park": "idle",
        "host_floor_mib": 2048,
    }
    assert doc["gpu"]["sim"] == {"devices": 1, "memory_gib": 80.0, "swap_in_gbps": 9.0}
    assert doc["scheduler"]["gpu"] == {"0": {"tq": 10.0}, "GPU-8f6a": {"mode": "auto"}}
    assert doc["scheduler"]["tq"] == 30.0
    assert doc["kubernetes"] == {"replicas": 8}
    # gpu.sim is read at start: recorded in the drop-in; memory.* is reloaded: not there.
    assert '"swap_in_gbps": 9.0' in dropin
    assert "memory." not in dropin and "3072" not in dropin and "checkpoint" not in dropin


def check_config_fails(path: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kiwid", "check-config", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


RULES = [
    {"match": {"namespace": "research", "pod": "train-*"}, "weight": 3},
    {"match": {"name": "inference-*"}, "priority": 10, "swap": "never"},
    {
        "match": {"unit": "batch-*.service", "cgroup": '/odd/"quoted"\\path*'},
        "weight": 0.5,
        "priority": -1,
        "tq": 12.5,
        "swap": "allow",
        "max_weight": 2,
        "max_priority": 0,
    },
    {"match": {}, "weight": 1.0, "max_priority": None},  # null: not written
]


@pytest.mark.timeout(180)
def test_tenant_rules_render_as_an_array_of_tables_in_order(tmp_path: Path) -> None:
    text, dropin = render(
        tmp_path,
        kiwid_tenants=RULES,
        kiwid_scheduler_preempt_after=1.5,
        kiwid_scheduler_max_wait=600,
    )
    check_config(tmp_path / "kiwi.toml")
    doc = tomllib.loads(text)
    assert doc["scheduler"]["preempt_after"] == 1.5
    assert doc["scheduler"]["max_wait"] == 600.0
    assert doc["tenants"] == [
        {"match": {"namespace": "research", "pod": "train-*"}, "weight": 3},
        {"match": {"name": "inference-*"}, "priority": 10, "swap": "never"},
        RULES[2],
        {"match": {}, "weight": 1.0},
    ]
    assert text.count("\n[[tenants]]\n") == len(RULES)
    # Reloaded settings: the drop-in (whose change restarts kiwid) is what it was.
    plain = tmp_path / "plain"
    plain.mkdir()
    assert dropin == render(plain)[1]


MEMORY_RULES = [
    {"match": {"namespace": "research"}, "memory": "40Gi", "max_memory": "64Gi"},
    {"match": {"name": "infer-*"}, "weight": 2, "memory": 8 * 2**30},
]


@pytest.mark.timeout(180)
def test_tenant_rules_declare_memory_as_quantities_or_bytes(tmp_path: Path) -> None:
    assert validate_arguments(tmp_path, kiwid_tenants=MEMORY_RULES) == []
    text, _ = render(tmp_path, kiwid_tenants=MEMORY_RULES)
    check_config(tmp_path / "kiwi.toml")
    assert tomllib.loads(text)["tenants"] == MEMORY_RULES
    assert 'memory = "40Gi"\nmax_memory = "64Gi"\n' in text  # after the rule's other keys


@pytest.mark.timeout(180)
def test_a_memory_that_is_no_size_reaches_check_config_and_is_named(tmp_path: Path) -> None:
    rules = [{"match": {}, "memory": "40GB"}]
    assert validate_arguments(tmp_path, kiwid_tenants=rules) == []  # its judge is kiwid
    render(tmp_path, kiwid_tenants=rules)
    problems = check_config_fails(tmp_path / "kiwi.toml")
    assert 'tenants[0].memory = "40GB": must be a GPU memory size' in problems, problems


@pytest.mark.timeout(180)
def test_defaults_write_no_tenant_rules_and_the_scheduler_defaults(tmp_path: Path) -> None:
    text, _ = render(tmp_path)
    doc = tomllib.loads(text)
    assert "tenants" not in doc and "[[tenants]]" not in text
    assert doc["scheduler"]["preempt_after"] == 0.0
    assert doc["scheduler"]["max_wait"] == 0.0


@pytest.mark.timeout(180)
def test_a_bad_rule_reaches_check_config_instead_of_being_dropped(tmp_path: Path) -> None:
    """A misspelt key is written, not left out; a rule without match is not made
    to match every tenant: kiwid check-config (the template task's validate:)
    refuses both, naming the rule."""
    text, _ = render(
        tmp_path,
        kiwid_tenants=[{"match": {"pod": "a-*"}, "wieght": 2}, {"priority": 5}],
    )
    assert "wieght = 2" in text
    problems = check_config_fails(tmp_path / "kiwi.toml")
    assert "tenants[0].wieght" in problems, problems
    assert "tenants[1]: needs a match table" in problems, problems


SPEC_PLAY = """\
- name: Check variables against the kiwid role's argument specs.
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Validate them as a run of the role would.
      ansible.builtin.validate_argument_spec:
        argument_spec: "{{{{ specs.argument_specs.main.options }}}}"
        provided_arguments: "{{{{ given }}}}"
      vars:
        specs: "{{{{ lookup('file', '{specs}') | from_yaml }}}}"
"""


def validate_arguments(tmp_path: Path, **given: Any) -> list[str]:
    """The role's argument validation of ``given``: its errors (none: valid)."""
    play = tmp_path / "validate.yml"
    play.write_text(SPEC_PLAY.format(specs=ROLE / "meta" / "argument_specs.yml"))
    done = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            str(play),
            "-e",
            json.dumps({"ansible_python_interpreter": sys.executable, "given": given}),
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
    if done.returncode == 0:
        return []
    failed = [line for line in done.stdout.splitlines() if line.startswith("fatal: ")]
    assert failed, done.stdout + done.stderr
    return list(json.loads(failed[0].split(" => ", 1)[1])["argument_errors"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("rules", "why"),
    [
        (RULES, None),
        ([{"match": {"pod": "a-*"}, "wieght": 2}], "kiwid_tenants.wieght. Supported"),
        ([{"match": {"pods": "a-*"}}], "kiwid_tenants.match.pods. Supported"),
        ([{"weight": 2}], "missing required arguments: match"),
        ([{"match": {}, "swap": "sometimes"}], "sometimes"),
        ([{"match": {}, "priority": "high"}], "'high'"),
    ],
    ids=["good", "misspelt key", "misspelt match key", "no match", "bad swap", "bad priority"],
)
def test_argument_specs_type_the_tenant_rules(
    tmp_path: Path, rules: list[dict[str, Any]], why: str | None
) -> None:
    errors = validate_arguments(
        tmp_path,
        kiwid_tenants=rules,
        kiwid_scheduler_preempt_after=2.0,
        kiwid_scheduler_max_wait=0.0,
    )
    if why is None:
        assert errors == []
    else:
        assert len(errors) == 1 and why in errors[0], errors
