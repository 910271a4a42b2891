"""The Ansible rollout and the systemd unit, on real systemd hosts (issue #5).

One fleet of two booted hosts (one pure cgroup2, one hybrid where this machine
has the hybrid layout) is shared by the tests of this module, which run in file
order, each leaving the fleet deployed and running for the next:

1. site.yml: the first run changes things, the second nothing; kiwid reached READY;
   ``kiwictl`` and ``kiwid`` are on the default PATH of root and of other users
   (links the role makes, and removes again with kiwid_commands_on_path false,
   never replacing or removing a file of someone else's).
2. A TQ change in the inventory is a reload (same MainPID), logged ``New TQ = ...``;
   --check --diff shows it first and changes nothing; tq.yml -e does the same.
   Swapping turned on through the role (kiwid_memory_swap, with kiwid_extra_config
   deep-merged into [memory]) is a reload; a gpu.sim key in kiwid_extra_config is
   read at start only, and restarts kiwid. Tenant rules (kiwid_tenants, as
   [[tenants]]) added, changed and removed: each a reload, applied to a running
   tenant's policy.
3. A hand edit plus ``systemctl reload`` applies; a broken hand edit is refused
   with the unit still active; a broken template is refused by ``validate``, and
   the serial rollout stops at the first host.
4. The watchdog restarts a SIGSTOPped kiwid; after SIGKILL the unit restarts and
   ExecStopPost= has thawed a real tenant that kiwid had frozen.
5. ``kiwid_kubernetes: true`` writes ``[kubernetes]`` and runs the device plugin,
   which waits for a kubelet without crashing; a second run changes nothing;
   ``kiwid_kubernetes: false`` stops and removes it again.
6. upgrade.yml restarts one host at a time into a new version (the device plugin
   too); uninstall.yml thaws everything and removes what the role installed (its
   links on the PATH too, and nothing else by their names).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.hosts import Fleet, Host, jsonish, wait_for
from tests.deploy.playbook import (
    Ansible,
    Run,
    build_wheels,
    next_version,
    project_version,
    source_copy,
)

# One xdist worker runs them all, in file order: they share the module's fleet.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("rollout")]

KIWICTL = "/opt/kiwi/bin/kiwictl"
LINKS = {name: f"/usr/local/bin/{name}" for name in ("kiwictl", "kiwid")}
FOREIGN = "#!/bin/sh\n"  # a program of someone else's, which the role must leave be
PLUGIN = "kiwi-device-plugin"
KIWI_PYTHON = "/opt/kiwi/bin/python"
SCRAPE = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())\n"
)
ATTACH = (
    "import sys\n"
    "from kiwid.adapters.control import request\n"
    "for pid in sys.argv[1:]:\n"
    "    request('/run/kiwi/kiwid.sock', 'sim-attach',\n"
    "            {'pid': int(pid), 'gpu': 0, 'memory_bytes': 1 << 30, 'activity': 'active'})\n"
)


# ---------------------------------------------------------------- helpers


def status(host: Host) -> dict[str, Any]:
    return jsonish(host.run(KIWICTL, "status", "--json").stdout)


def tq(host: Host) -> tuple[float, float]:
    gpu = status(host)["gpus"][0]
    return gpu["tq"], gpu["tq_configured"]


def unit(host: Host) -> dict[str, str]:
    return host.show(
        "kiwid",
        "ActiveState",
        "SubState",
        "MainPID",
        "NRestarts",
        "StatusText",
        "WatchdogUSec",
        "LoadState",
    )


def plugin(host: Host) -> dict[str, str]:
    return host.show(
        PLUGIN, "ActiveState", "SubState", "MainPID", "NRestarts", "LoadState", "UnitFileState"
    )


def now(host: Host) -> str:
    """A mark in the host's clock for ``journal(since=...)``."""
    return host.sh("date +%s.%N").strip()


def journal(host: Host, since: str | None = None, service: str = "kiwid") -> str:
    argv = ["journalctl", "-u", service, "-o", "cat", "--no-pager"]
    if since:
        argv += ["--since", f"@{since}"]
    return host.run(*argv).stdout


def journal_entries(host: Host, since: str) -> list[dict[str, Any]]:
    """The unit's journal since ``since`` as journalctl's JSON records."""
    out = host.run("journalctl", "-u", "kiwid", "-o", "json", "--since", f"@{since}").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wait_running(host: Host, other_than: str | None = None, timeout: float = 40) -> dict[str, str]:
    """Wait until kiwid is active (running), with a MainPID other than ``other_than``."""

    def ready() -> dict[str, str] | None:
        u = unit(host)
        fresh = other_than is None or u["MainPID"] not in (other_than, "0")
        return u if fresh and (u["ActiveState"], u["SubState"]) == ("active", "running") else None

    return wait_for(ready, timeout, f"kiwid on {host.name} to be active (running)")


def wait_tq(host: Host, want: float, timeout: float = 20) -> None:
    wait_for(lambda: tq(host) == (want, want), timeout, f"TQ {want} on {host.name}")


def login(host: Host, script: str, user: str = "root") -> subprocess.CompletedProcess[str]:
    """``script`` in a login shell with an empty environment, as ``user``.

    The PATH is then the host's default, which its own /etc/profile sets (Debian's
    differs for root and for other users): no PATH of this test's making.
    """
    argv = ["env", "-i", "/bin/sh", "-lc", script]
    if user != "root":
        argv = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", *argv]
    return host.run(*argv, check=False)


def on_path(host: Host) -> dict[str, str]:
    """Where root's login shell finds kiwictl and kiwid (absent: not on the PATH)."""
    found = {}
    for name in LINKS:
        where = login(host, f"command -v {name}").stdout.strip()
        if where:
            found[name] = where
    return found


def write_foreign(host: Host, path: str) -> None:
    host.run("sh", "-c", 'cat > "$1" && chmod 755 "$1"', "sh", path, input=FOREIGN)


def assert_ok(run: Run) -> None:
    assert run.returncode == 0, run.explain()


def cgroup_dir(host: Host, service: str) -> str:
    group = host.show(service, "ControlGroup")["ControlGroup"]
    root = "/sys/fs/cgroup/unified" if host.layout == "hybrid" else "/sys/fs/cgroup"
    return f"{root}{group}"


def frozen(host: Host, service: str) -> bool:
    events = host.run("cat", f"{cgroup_dir(host, service)}/cgroup.events").stdout
    return "frozen 1" in events.splitlines()


def cpu_ticks(host: Host, pid: str) -> int:
    fields = host.run("cat", f"/proc/{pid}/stat").stdout.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@contextlib.contextmanager
def frozen_tenant(hosts: list[Host]) -> Iterator[dict[str, tuple[str, str]]]:
    """On each host, two busy tenants (transient services) on kiwid's sim GPU.

    Yields ``{host: (waiting service, its PID)}`` once kiwid has frozen the waiter;
    the tenants are stopped afterwards whatever happened.
    """
    services = ("kiwi-tenant-a.service", "kiwi-tenant-b.service")
    try:
        for host in hosts:
            pids = []
            for service in services:
                host.run(
                    "systemd-run", "--quiet", "--collect", f"--unit={service}",
                    "/usr/bin/python3", "-c", "while True: pass",
                )  # fmt: skip
                pids.append(host.show(service, "MainPID")["MainPID"])
            host.run(KIWI_PYTHON, "-c", ATTACH, *pids)
        waiting: dict[str, tuple[str, str]] = {}
        for host in hosts:

            def one_frozen(host: Host = host) -> tuple[str, str] | None:
                for service in services:
                    if frozen(host, service):
                        return service, host.show(service, "MainPID")["MainPID"]
                return None

            waiting[host.name] = wait_for(one_frozen, 20, f"a frozen tenant on {host.name}")
            assert sum(frozen(host, s) for s in services) == 1, "exactly one waits"
        yield waiting
    finally:
        for host in hosts:
            with contextlib.suppress(Exception):
                for service in services:
                    host.run("sh", "-c", f"echo 0 > {cgroup_dir(host, service)}/cgroup.freeze")
                host.run("systemctl", "stop", *services, check=False)


@pytest.fixture(scope="module")
def deployed(ansible: Ansible, fleet: Fleet) -> tuple[Run, Run]:
    """site.yml run twice against the fresh fleet, after a --check --diff run.

    The check-mode run also builds the wheel on the controller, as the role does by
    default (the real runs install from the prebuilt wheelhouse instead).
    """
    built = ansible.dir / "built-by-the-role"
    dry = ansible.play(
        "site.yml",
        "--check",
        "--diff",
        extra={
            "kiwid_build_wheel": True,
            "kiwid_source_dir": str(ansible.wheelhouse.parent / "src"),
            "kiwid_wheelhouse": str(built),
        },
    )
    assert_ok(dry)
    assert [w.name for w in built.iterdir()] == [
        w.name for w in ansible.wheelhouse.glob("kiwi_gpu-*.whl")
    ], dry.explain()
    for host in fleet.hosts:
        assert dry.changed(host.name) > 0, dry.explain()
        # Check mode installed nothing.
        assert host.sh("ls /opt /etc /etc/systemd/system /usr/local/bin | grep kiwi; true") == ""
        assert host.run("getent", "group", "kiwi", check=False).returncode == 2
    first = ansible.play("site.yml")
    assert_ok(first)
    second = ansible.play("site.yml")
    return first, second


# ---------------------------------------------------------------- 1. converge


def test_first_run_changes_things_and_the_second_nothing(
    deployed: tuple[Run, Run], fleet: Fleet
) -> None:
    first, second = deployed
    assert_ok(second)
    for host in fleet.hosts:
        assert first.changed(host.name) > 0, first.explain()
        assert second.changed(host.name) == 0, second.explain()
        u = unit(host)
        # Type=notify: "active (running)" only after READY=1.
        assert (u["ActiveState"], u["SubState"]) == ("active", "running"), u
        assert u["StatusText"].startswith("GPU 0: TQ 30 s"), u
        log = journal(host)
        assert "Started kiwid.service" in log, log
        assert "ready: 1 GPU(s), TQ 30 s" in log, log
        # The unit as installed verifies, with its real paths.
        verify = host.run(
            "systemd-analyze", "verify", "/etc/systemd/system/kiwid.service", check=False
        )
        assert verify.returncode == 0 and verify.stdout + verify.stderr == "", verify
        assert host.run("getent", "group", "kiwi", check=False).returncode == 0
        print(f"{host.name} ({host.layout}): first run {first.seconds:.0f} s")


def test_check_mode_on_a_converged_fleet_changes_nothing(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    run = ansible.play("site.yml", "--check", "--diff")
    assert_ok(run)
    for host in fleet.hosts:
        assert run.changed(host.name) == 0, run.explain()


def test_kiwictl_and_kiwid_are_on_the_default_path(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    for host in fleet.hosts:
        for user in ("root", "nobody"):
            shell = login(host, 'echo "$PATH"; command -v kiwictl; kiwictl status', user)
            assert shell.returncode == 0, shell
            path, where, *status = shell.stdout.splitlines()
            assert where == LINKS["kiwictl"], f"{user}'s PATH {path}: {shell.stdout}"
            assert status[0].startswith("kiwid "), shell.stdout  # kiwid's own answer
            assert any(line.startswith("GPU 0: ") for line in status), shell.stdout
        check = login(host, "kiwid check-config /etc/kiwi.toml")
        assert check.returncode == 0, check
        targets = host.run("readlink", *LINKS.values()).stdout.split()
        assert targets == ["/opt/kiwi/bin/kiwictl", "/opt/kiwi/bin/kiwid"]

    # Turned off: the role's links go, and a file of someone else's by that name
    # stays (on the first host, kiwid is one).
    first, other = fleet.hosts[0], fleet.hosts[-1]
    first.run("rm", LINKS["kiwid"])
    write_foreign(first, LINKS["kiwid"])
    install = ("site.yml", "--tags", "kiwid_install")
    off = ansible.play(*install, extra={"kiwid_commands_on_path": False})
    assert_ok(off)
    assert on_path(first) == {"kiwid": LINKS["kiwid"]}, "only the role's link is gone"
    assert first.run("cat", LINKS["kiwid"]).stdout == FOREIGN
    if other is not first:
        assert on_path(other) == {}
    assert unit(first)["ActiveState"] == "active", "kiwid itself runs on"

    # Turned on again: a file of someone else's in the way fails its host (the other
    # goes on), and stays as it was.
    refused = ansible.play(*install, extra={"kiwid_max_fail_percentage": 100})
    assert refused.returncode != 0 and refused.recap[first.name]["failed"] == 1, refused.explain()
    assert f"{LINKS['kiwid']} exists and is not the role's link" in refused.output
    assert first.run("cat", LINKS["kiwid"]).stdout == FOREIGN
    if other is not first:
        assert refused.recap[other.name]["failed"] == 0, refused.explain()
        assert on_path(other) == LINKS
    first.run("rm", LINKS["kiwid"])
    again = ansible.play(*install)
    assert_ok(again)
    assert all(on_path(h) == LINKS for h in fleet.hosts)
    if other is not first:
        assert again.changed(other.name) == 0, again.explain()


# ---------------------------------------------------------------- 2. TQ


def test_tq_change_in_the_inventory_is_a_reload(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    before = {h.name: unit(h) for h in fleet.hosts}
    ansible.vars["kiwid_tq"] = 20

    dry = ansible.play("site.yml", "--check", "--diff")
    assert_ok(dry)
    assert "-tq = 30.0" in dry.output and "+tq = 20.0" in dry.output, dry.explain()
    for host in fleet.hosts:
        assert dry.changed(host.name) > 0, dry.explain()
        assert tq(host) == (30.0, 30.0), "check mode changed nothing"

    marks = {h.name: now(h) for h in fleet.hosts}
    run = ansible.play("site.yml")
    assert_ok(run)
    for host in fleet.hosts:
        assert tq(host) == (20.0, 20.0)
        after = unit(host)
        assert after["MainPID"] == before[host.name]["MainPID"], "a reload, not a restart"
        assert after["NRestarts"] == before[host.name]["NRestarts"]
        log = journal(host, marks[host.name])
        assert "[INFO] New TQ = 20" in log, log
        assert "Stopped kiwid.service" not in log, log


def test_tq_playbook_changes_tq_fleet_wide(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    before = {h.name: unit(h)["MainPID"] for h in fleet.hosts}
    marks = {h.name: now(h) for h in fleet.hosts}
    run = ansible.play("tq.yml", extra={"kiwid_tq": 25})
    assert_ok(run)
    ansible.vars["kiwid_tq"] = 25  # as an operator would, to make it stick
    for host in fleet.hosts:
        assert run.changed(host.name) > 0, run.explain()
        assert tq(host) == (25.0, 25.0)
        assert unit(host)["MainPID"] == before[host.name]
        assert "[INFO] New TQ = 25" in journal(host, marks[host.name])
    again = ansible.play("tq.yml")
    assert_ok(again)
    assert all(again.changed(h.name) == 0 for h in fleet.hosts), again.explain()


def test_swapping_through_the_role_is_a_reload_and_a_start_time_setting_a_restart(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    """memory.swap is reloaded; gpu.sim.* (through kiwid_extra_config) restarts kiwid."""
    before = {h.name: unit(h) for h in fleet.hosts}
    marks = {h.name: now(h) for h in fleet.hosts}
    ansible.vars["kiwid_memory_swap"] = "checkpoint"
    ansible.vars["kiwid_memory_host_floor_mib"] = 0
    ansible.vars["kiwid_extra_config"] = {"memory": {"reserve_mib": 2048}}
    run = ansible.play("site.yml")
    assert_ok(run)
    for host in fleet.hosts:
        config = host.sh("cat /etc/kiwi.toml")
        assert config.count("[memory]") == 1, config  # merged, never a second table
        memory = config.split("[memory]", 1)[1].split("\n\n", 1)[0]
        for line in ('swap = "checkpoint"', "host_floor_mib = 0", "reserve_mib = 2048"):
            assert line in memory.splitlines(), config
        wait_for(
            lambda h=host: status(h)["gpus"][0]["swap_mode"] == "checkpoint",
            20,
            f"swapping on {host.name}",
        )
        after = unit(host)
        assert after["MainPID"] == before[host.name]["MainPID"], "a reload, not a restart"
        assert after["NRestarts"] == before[host.name]["NRestarts"]
        log = journal(host, marks[host.name])
        assert "Stopped kiwid.service" not in log, log
        assert "next restart" not in log, log  # nothing restart-only changed

    reloaded = {h.name: unit(h)["MainPID"] for h in fleet.hosts}
    ansible.vars["kiwid_extra_config"] = {
        "memory": {"reserve_mib": 2048},
        "gpu": {"sim": {"swap_in_gbps": 9.0}},
    }
    run = ansible.play("site.yml")
    assert_ok(run)
    for host in fleet.hosts:
        config = host.sh("cat /etc/kiwi.toml")
        assert config.count("[gpu.sim]") == 1 and "swap_in_gbps = 9.0" in config, config
        assert "gpu.sim" in host.sh("cat /etc/systemd/system/kiwid.service.d/50-ansible.conf")
        after = wait_running(host, other_than=reloaded[host.name])
        assert after["MainPID"] != reloaded[host.name], "gpu.sim is read at start: a restart"

    for name in ("kiwid_memory_swap", "kiwid_memory_host_floor_mib", "kiwid_extra_config"):
        del ansible.vars[name]
    restarted = {h.name: unit(h)["MainPID"] for h in fleet.hosts}
    run = ansible.play("site.yml")  # back to the defaults for the tests below
    assert_ok(run)
    for host in fleet.hosts:
        wait_running(host, other_than=restarted[host.name])
        assert status(host)["gpus"][0]["swap_mode"] == "none"


def tenant_policy(host: Host, tenant: str) -> dict[str, Any] | None:
    """The policy in force for ``tenant``, as ``kiwictl status`` shows it."""
    for entry in status(host)["gpus"][0]["tenants"]:
        if entry["id"] == tenant:
            return dict(entry["policy"])
    return None


def test_tenant_rules_through_the_role_are_a_reload(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    """kiwid_tenants added, then one rule changed, then all removed: each run writes
    [[tenants]] and reloads kiwid (same MainPID, logged), never restarts it, and the
    running tenant's policy follows the rules."""
    service = "kiwi-policy-a.service"
    tenant = f"systemd:{service}"

    def run_and_see(want: dict[str, Any]) -> None:
        before = {h.name: unit(h) for h in fleet.hosts}
        marks = {h.name: now(h) for h in fleet.hosts}
        run = ansible.play("site.yml")
        assert_ok(run)
        for host in fleet.hosts:
            assert run.changed(host.name) > 0, run.explain()
            wait_for(
                lambda h=host: (tenant_policy(h, tenant) or {}).items() >= want.items(),
                20,
                f"{tenant}'s policy {want} on {host.name}",
            )
            after = unit(host)
            assert after["MainPID"] == before[host.name]["MainPID"], "a reload, not a restart"
            assert after["NRestarts"] == before[host.name]["NRestarts"]
            assert (after["ActiveState"], after["SubState"]) == ("active", "running"), after
            assert status(host)["config"]["last_reload"]["ok"]
            log = journal(host, marks[host.name])
            assert "Reloading /etc/kiwi.toml" in log, log
            assert "Stopped kiwid.service" not in log, log

    try:
        for host in fleet.hosts:
            host.run(
                "systemd-run", "--quiet", "--collect", f"--unit={service}",
                "/usr/bin/python3", "-c", "import time; time.sleep(3600)",
            )  # fmt: skip
            host.run(KIWI_PYTHON, "-c", ATTACH, host.show(service, "MainPID")["MainPID"])
            wait_for(lambda h=host: tenant_policy(h, tenant), 20, f"{tenant} on {host.name}")
            assert tenant_policy(host, tenant) == {
                "weight": 1.0,
                "priority": 0,
                "tq": None,
                "swap": "allow",
                "park": True,
                "rule": None,
                "sources": dict.fromkeys(("weight", "priority", "tq", "swap", "park"), "default"),
                "capped": [],
                "runtime": False,
            }

        # Rules added (the first matches someone else), and the scheduler's two keys.
        ansible.vars["kiwid_tenants"] = [
            {"match": {"unit": "other-*.service"}, "weight": 5},
            {"match": {"unit": "kiwi-policy-*.service"}, "weight": 3, "priority": 5},
        ]
        ansible.vars["kiwid_scheduler_preempt_after"] = 1.5
        ansible.vars["kiwid_scheduler_max_wait"] = 600
        run_and_see({"weight": 3.0, "priority": 5, "rule": 1})
        for host in fleet.hosts:
            config = host.sh("cat /etc/kiwi.toml")
            assert config.count("\n[[tenants]]\n") == 2, config
            assert 'match = { unit = "kiwi-policy-*.service" }' in config, config
            scheduler = config.split("[scheduler]", 1)[1].split("\n\n", 1)[0]
            for line in ("preempt_after = 1.5", "max_wait = 600.0"):
                assert line in scheduler.splitlines(), config

        # One rule changed, nothing else.
        ansible.vars["kiwid_tenants"][1]["weight"] = 2
        run_and_see({"weight": 2.0, "priority": 5, "rule": 1})
        sources = tenant_policy(fleet.hosts[0], tenant) or {}
        assert sources["sources"]["weight"] == "rule 1", sources

        # All removed: the defaults again.
        for name in ("kiwid_tenants", "kiwid_scheduler_preempt_after", "kiwid_scheduler_max_wait"):
            del ansible.vars[name]
        run_and_see({"weight": 1.0, "priority": 0, "rule": None})
        for host in fleet.hosts:
            assert "[[tenants]]" not in host.sh("cat /etc/kiwi.toml")
    finally:
        for host in fleet.hosts:
            host.run("systemctl", "stop", service, check=False)


# ---------------------------------------------------------------- 3. reload by hand, validate


def test_hand_edit_and_systemctl_reload(deployed: tuple[Run, Run], fleet: Fleet) -> None:
    for host in fleet.hosts:
        pid = unit(host)["MainPID"]
        mark = now(host)
        host.sh("sed -i 's/^tq = .*/tq = 40.0/' /etc/kiwi.toml && systemctl reload kiwid")
        wait_tq(host, 40.0)  # systemctl reload returns before kiwid's READY=1
        log = journal(host, mark)
        assert "(SIGHUP" in log and "[INFO] New TQ = 40" in log, log
        assert unit(host)["MainPID"] == pid

        # A broken file written by hand: refused, old config in force, unit active.
        mark = now(host)
        host.sh("echo '[scheduler' >> /etc/kiwi.toml && systemctl reload kiwid")
        wait_for(
            lambda host=host: not status(host)["config"]["last_reload"]["ok"],
            20,
            f"the broken file to be refused on {host.name}",
        )
        u = unit(host)
        assert (u["ActiveState"], u["SubState"], u["MainPID"]) == ("active", "running", pid)
        assert tq(host) == (40.0, 40.0)
        assert "reload failed" in u["StatusText"], u
        assert "Reload failed; the running configuration stays in force" in journal(host, mark)


def test_broken_template_is_refused_and_the_rollout_stops(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    def snapshot(host: Host) -> tuple[str, str, tuple[float, float]]:
        return host.sh("sha256sum /etc/kiwi.toml"), unit(host)["MainPID"], tq(host)

    before = {h.name: snapshot(h) for h in fleet.hosts}
    run = ansible.play("site.yml", extra={"kiwid_tq": -1, "kiwid_serial": 1})
    assert run.returncode != 0, run.explain()
    assert "failed to validate" in run.output, run.explain()
    # serial: 1 and max_fail_percentage: 0 -> the first host failed, nobody else ran.
    assert len(run.recap) == 1 and next(iter(run.recap.values()))["failed"] == 1, run.explain()
    for host in fleet.hosts:
        assert snapshot(host) == before[host.name], "nothing changed on any host"
        assert unit(host)["ActiveState"] == "active"

    # The next good run puts the inventory's file back: a reload, no restart.
    fixed = ansible.play("site.yml")
    assert_ok(fixed)
    for host in fleet.hosts:
        assert tq(host) == (25.0, 25.0)
        assert status(host)["config"]["last_reload"]["ok"]
        assert unit(host)["MainPID"] == before[host.name][1]


# ---------------------------------------------------------------- 4. watchdog, SIGKILL


def test_watchdog_restarts_a_hung_kiwid(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    before = {h.name: unit(h) for h in fleet.hosts}
    marks = {h.name: now(h) for h in fleet.hosts}
    # A short watchdog, and the metrics endpoint (a start-time setting, which
    # also needs the network that the unit denies by default). kiwid refuses to
    # start with a gate timeout above half the watchdog (1.5 s here).
    ansible.vars["kiwid_systemd_overrides"] = {"WatchdogSec": "3s"}
    ansible.vars["kiwid_gate_timeout"] = 1.0
    ansible.vars["kiwid_metrics_listen"] = "127.0.0.1:9417"
    run = ansible.play("site.yml")
    assert_ok(run)
    for host in fleet.hosts:
        u = unit(host)
        assert u["WatchdogUSec"] == "3s", u
        # A unit change restarts (after daemon-reload) and does not also reload,
        # even though /etc/kiwi.toml changed too.
        assert u["MainPID"] != before[host.name]["MainPID"]
        assert "(SIGHUP" not in journal(host, marks[host.name])
        metrics = host.run("python3", "-c", SCRAPE, "http://127.0.0.1:9417/metrics").stdout
        assert "kiwi_gpu_tq_seconds" in metrics, metrics

    hung = {h.name: unit(h) for h in fleet.hosts}
    marks = {h.name: now(h) for h in fleet.hosts}
    for host in fleet.hosts:
        host.run("systemctl", "kill", "--kill-who=main", "--signal=SIGSTOP", "kiwid")
    for host in fleet.hosts:
        after = wait_running(host, other_than=hung[host.name]["MainPID"], timeout=40)
        assert int(after["NRestarts"]) == int(hung[host.name]["NRestarts"]) + 1, after
        log = journal(host, marks[host.name])
        assert "Watchdog timeout" in log and "Failed with result 'watchdog'" in log, log
        assert tq(host) == (25.0, 25.0)


def test_sigkill_restarts_and_execstoppost_thaws_the_frozen_tenant(
    deployed: tuple[Run, Run], fleet: Fleet
) -> None:
    with frozen_tenant(fleet.hosts) as waiting:
        old = {h.name: unit(h) for h in fleet.hosts}
        marks = {h.name: now(h) for h in fleet.hosts}
        for host in fleet.hosts:
            host.run("systemctl", "kill", "--signal=SIGKILL", "kiwid")
        # ExecStopPost= thaws the waiter at once; RestartSec=2s later the new kiwid
        # finds both tenants still attached to the (sim) GPU and gates one again,
        # as it would on a real GPU. So look inside that window first, on every host.
        for host in fleet.hosts:
            service, _pid = waiting[host.name]
            wait_for(
                lambda host=host, service=service: not frozen(host, service),
                10,
                f"ExecStopPost= to thaw {service} on {host.name}",
            )
        for host in fleet.hosts:
            service, _pid = waiting[host.name]
            after = wait_running(host, other_than=old[host.name]["MainPID"])
            assert int(after["NRestarts"]) == int(old[host.name]["NRestarts"]) + 1
            entries = journal_entries(host, marks[host.name])
            messages = [e["MESSAGE"] for e in entries]
            assert any("status=9/KILL" in m for m in messages), messages
            # The thaw came from `kiwid recover` (ExecStopPost=): neither the killed
            # kiwid nor the new one, which found nothing left gated.
            recover = {
                e["_PID"]
                for e in entries
                if e["MESSAGE"] == "[INFO] Nothing is gated (1 tenant(s) let go)"
            }
            assert len(recover) == 1, messages
            assert recover.isdisjoint({old[host.name]["MainPID"], after["MainPID"]}), messages
            assert {
                "_PID": next(iter(recover)),
                "MESSAGE": f"[INFO] Ungated systemd:{service}",
            } in [{"_PID": e["_PID"], "MESSAGE": e["MESSAGE"]} for e in entries], messages
            assert not any("left gated by a previous kiwid" in m for m in messages), messages


# ---------------------------------------------------------------- 5. Kubernetes nodes


def test_kubernetes_nodes_run_the_device_plugin(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    before = {h.name: unit(h)["MainPID"] for h in fleet.hosts}
    ansible.vars["kiwid_kubernetes"] = True
    ansible.vars["kiwid_kubernetes_replicas"] = 8
    run = ansible.play("site.yml")
    assert_ok(run)
    for host in fleet.hosts:
        assert run.changed(host.name) > 0, run.explain()
        config = host.run("cat", "/etc/kiwi.toml").stdout
        assert "\n[kubernetes]\n" in config and "\nreplicas = 8\n" in config, config
        # The CDI directory is kiwid's default, so kiwid only reloads.
        assert unit(host)["MainPID"] == before[host.name]
        assert status(host)["config"]["last_reload"]["ok"]
    # These hosts have no kubelet: the plugin waits for kubelet.sock, and runs on.
    for host in fleet.hosts:

        def waiting(host: Host = host) -> str | None:
            log = journal(host, None, PLUGIN)
            return log if "waiting for the kubelet's socket" in log else None

        log = wait_for(waiting, 20, f"{PLUGIN} on {host.name} to wait for the kubelet")
        assert "1 GPUs (sim backend), 8 replicas each, resource kiwi.io/gpu" in log, log
    started = {h.name: plugin(h) for h in fleet.hosts}
    for host in fleet.hosts:
        p = started[host.name]
        assert (p["ActiveState"], p["SubState"], p["UnitFileState"]) == (
            "active", "running", "enabled"
        ), p  # fmt: skip

    again = ansible.play("site.yml")
    assert_ok(again)
    for host in fleet.hosts:
        assert again.changed(host.name) == 0, again.explain()
        # Still the same process, some 10 s later: no crash loop, no restart.
        p = plugin(host)
        assert (p["ActiveState"], p["MainPID"], p["NRestarts"]) == (
            "active", started[host.name]["MainPID"], "0"
        ), p  # fmt: skip


def test_kubernetes_false_removes_the_device_plugin(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    # On the first host only: the other keeps its plugin for the upgrade and
    # uninstall tests below (the inventory still says true).
    first, other = fleet.hosts[0], fleet.hosts[-1]
    kiwid_pid = unit(first)["MainPID"]
    other_plugin = plugin(other)["MainPID"]
    run = ansible.play("site.yml", "--limit", first.name, extra={"kiwid_kubernetes": False})
    assert_ok(run)
    assert list(run.recap) == [first.name], run.explain()
    assert run.changed(first.name) > 0, run.explain()
    assert plugin(first)["LoadState"] == "not-found"
    left = first.sh("ls /etc/systemd/system | grep kiwi-device-plugin; true")
    assert left == "", left
    assert "[kubernetes]" not in first.run("cat", "/etc/kiwi.toml").stdout
    assert unit(first)["MainPID"] == kiwid_pid, "kiwid only reloaded"
    if other is not first:
        assert plugin(other)["MainPID"] == other_plugin

    again = ansible.play("site.yml", "--limit", first.name, extra={"kiwid_kubernetes": False})
    assert_ok(again)
    assert again.changed(first.name) == 0, again.explain()


# ---------------------------------------------------------------- 6. upgrade, uninstall


def test_rolling_upgrade_restarts_one_host_at_a_time(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet, tmp_path: Path
) -> None:
    built_from = ansible.wheelhouse.parent / "src"  # the tree of the first wheel
    new = next_version(project_version(built_from))
    house = tmp_path / "wheelhouse"
    shutil.copytree(ansible.wheelhouse, house)
    build_wheels(source_copy(tmp_path / "src", new, source=built_from), house, deps=False)
    ansible.vars["kiwid_wheelhouse"] = str(house)
    ansible.vars["kiwid_systemd_overrides"] = {}
    before = {h.name: unit(h) for h in fleet.hosts}
    plugin_before = {h.name: plugin(h)["MainPID"] for h in fleet.hosts}

    run = ansible.play("upgrade.yml", extra={"kiwid_serial": 1})
    assert_ok(run)
    assert run.output.count("TASK [Gathering Facts]") == len(fleet.hosts), "one batch per host"
    for host in fleet.hosts:
        u = unit(host)
        assert u["MainPID"] != before[host.name]["MainPID"]
        assert u["WatchdogUSec"] == "30s", "the override is gone from the drop-in"
        st = status(host)
        assert st["version"] == new and st["gpus"][0]["tq"] == 25.0, st
        # The device plugin runs the new version too: restarted by the package
        # change, or installed again where the previous test had removed it.
        p = plugin(host)
        assert p["ActiveState"] == "active", p
        assert p["MainPID"] not in (plugin_before[host.name], "0"), p
        assert f"[INFO] {PLUGIN} {new}: " in journal(host, None, PLUGIN)
    again = ansible.play("upgrade.yml")
    assert_ok(again)
    assert all(again.changed(h.name) == 0 for h in fleet.hosts), again.explain()


def test_uninstall_thaws_tenants_and_removes_everything(
    deployed: tuple[Run, Run], ansible: Ansible, fleet: Fleet
) -> None:
    with frozen_tenant(fleet.hosts) as waiting:
        run = ansible.play("uninstall.yml")
        assert_ok(run)
        for host in fleet.hosts:
            service, _pid = waiting[host.name]
            assert not frozen(host, service), f"{service} on {host.name} is still frozen"
            assert unit(host)["LoadState"] == "not-found"
            assert plugin(host)["LoadState"] == "not-found"
            left = host.sh(
                "for p in /opt/kiwi /etc/kiwi.toml /run/kiwi /var/cache/kiwi"
                " /etc/systemd/system/kiwid.service /etc/systemd/system/kiwi-device-plugin.service"
                f" /var/run/cdi/kiwi.io-gpu.json {' '.join(LINKS.values())};"
                " do [ -e $p ] || [ -L $p ] && echo $p; done; true"
            )
            assert left == "", left
            assert on_path(host) == {}, "kiwictl and kiwid are off the PATH"
            assert host.run("getent", "group", "kiwi", check=False).returncode == 2
    # A kiwictl of someone else's, where the role's link was, is left alone.
    for host in fleet.hosts:
        write_foreign(host, LINKS["kiwictl"])
    again = ansible.play("uninstall.yml")
    assert_ok(again)
    assert all(again.changed(h.name) == 0 for h in fleet.hosts), again.explain()
    for host in fleet.hosts:
        assert host.run("cat", LINKS["kiwictl"]).stdout == FOREIGN
        host.run("rm", LINKS["kiwictl"])
    print(json.dumps({h.name: h.layout for h in fleet.hosts}))
