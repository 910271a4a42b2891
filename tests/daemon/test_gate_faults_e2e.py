"""Gate and state faults against a real kiwid on the sim, real cgroups (issue 17).

Each test is one finding of the issue's fault run; on kiwid before the fix, it
fails. What kiwid is refused here is refused by the kernel for real: a state
directory remounted read-only, a ``cgroup.freeze`` with a read-only file bound
over it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.conftest import KIWID, Kiwid, wait_for
from tests.daemon.test_swap_e2e import TENANT, holder, swap_config, swapped

GiB = 2**30


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` (a directory or a file) read-only for everyone, root too, until the end."""
    if subprocess.run(["mount", "--bind", str(path), str(path)], check=False).returncode:
        pytest.skip("cannot bind-mount here (no CAP_SYS_ADMIN)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def recorded_in_host_ram(workdir: Path) -> bool:
    """Whether the state file records a tenant's memory in host RAM."""
    try:
        doc = json.loads((workdir / "state" / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return any(r.get("swapped") for r in doc["gated"].values())


def config(workdir: Path, **kw: object) -> str:
    text = swap_config(workdir, **{"swap": "none", **kw})
    return text.replace("[gpu]\n", '[gpu]\ndriver_timeout = 1\ngate = "freeze"\n')


def start(start_kiwid, workdir: Path, **kw: object) -> Kiwid:
    (workdir / "kiwi.toml").write_text(config(workdir, **kw))
    return start_kiwid()


def test_a_gate_whose_record_cannot_be_written_is_a_failure_never_two_at_once(
    start_kiwid, tenants, workdir
) -> None:
    # Item 3: an OSError writing the state file (a full or read-only /run) counted as
    # a gate that took: the next holder was let go while the first ran on.
    k = start(start_kiwid, workdir)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=GiB)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=GiB)
    wait_for(b.frozen, 5, "b to wait, frozen")
    with read_only(workdir / "state"):
        # a's quantum ends: its gate cannot be recorded, so it is not gated, and b,
        # which waits frozen, is not let go beside it.
        k.until(lambda: k.tenant(a.key).get("state") == "stuck", 30, "a's gate to fail")
        stuck = k.tenant(a.key)
        assert stuck["gate_failure"] and "state" in stuck["stuck_reason"]["reason"], stuck
        assert stuck["stuck_reason"]["contained"] is False
        assert k.status()["gpus"][0]["blocked_by"] == a.key
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert b.frozen(), "b was let go while a runs ungated"
            assert not a.frozen()
            time.sleep(0.05)
    # /run is writable again: a's gate is tried again, and the rotation resumes.
    wait_for(lambda: k.tenant(a.key).get("state") != "stuck", 10, "a's gate to take")
    wait_for(lambda: not b.frozen() and a.frozen(), 10, "b's turn")
    wait_for(lambda: not a.frozen() and b.frozen(), 10, "a's turn")


def test_a_thaw_the_kernel_refuses_makes_the_tenant_stuck_not_a_frozen_holder(
    start_kiwid, tenants, workdir
) -> None:
    # Item 2: a failed ungate was dropped; status showed the tenant holding while it
    # stayed frozen, and its quantum was counted.
    k = start(start_kiwid, workdir)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=GiB)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=GiB)
    wait_for(b.frozen, 5, "b to wait, frozen")
    with read_only(b.v2 / "cgroup.freeze"):
        wait_for(lambda: k.tenant(b.key).get("state") == "stuck", 10, "b's thaw to fail")
        stuck = k.tenant(b.key)
        assert stuck["stuck_reason"]["operation"] == "ungate", stuck
        assert stuck["gated"] and b.frozen()
        assert holder(k) != b.key
        wait_for(lambda: holder(k) == a.key, 10, "a to hold again, b stuck aside")
    done = k.ctl("retry", b.key)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for(lambda: not b.frozen(), 15, "b to get its turn after the retry")


def test_an_unreadable_state_file_is_set_aside_and_its_frozen_tenants_get_turns(
    start_kiwid, tenants, workdir
) -> None:
    # Item 11: the file was set aside and kiwid went on; the tenants it listed stayed
    # frozen for good (they show no activity, so they were never granted).
    a = tenants("a")
    (workdir / "kiwi.toml").write_text(config(workdir))
    first = start_kiwid()
    first.attach(a.pid, memory=GiB)
    assert first.stop() == 0
    (a.v2 / "cgroup.freeze").write_text("1")  # as a previous kiwid left it
    wait_for(a.frozen, 5, "a frozen")
    state = workdir / "state" / "state.json"
    state.write_text('{"version": 3, "gated": {"cgroup:/x": ')  # cut short by a crash
    k = start_kiwid()
    k.wait_log("Cannot use the state file")
    assert k.status()["state_file"]["trouble"], k.status()["state_file"]
    k.wait_log(f"Adopted {a.key}")
    wait_for(lambda: not a.frozen(), 15, "a, adopted, to get its turn")
    assert list(workdir.glob("state/state.json.unusable-*")), "the file is kept aside"


def test_malformed_records_stay_in_the_state_file_for_the_operator(tenants, workdir) -> None:
    # Item 11: malformed records were dropped from the file; only the log kept them.
    state = workdir / "state"
    state.mkdir(mode=0o700)
    bad = {"method": "freeze", "cgroup_v2": "relative/path", "pids": []}
    (state / "state.json").write_text(json.dumps({"version": 3, "gated": {"cgroup:/x": bad}}))
    out = subprocess.run(
        [*KIWID, "recover", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 1, out.stderr
    assert "cgroup:/x" in out.stderr
    doc = json.loads((state / "state.json").read_text())
    assert doc["unusable"]["cgroup:/x"]["record"] == bad, doc


def test_a_kiwid_killed_during_a_swap_out_finds_the_memory_on_the_card(
    start_kiwid, tenants, workdir
) -> None:
    # Item 14: a kill -9 in the middle of a swap-out left a tenant marked "in host
    # RAM" while its memory was on the card; under memory pressure its restore then
    # waited for room its own memory filled, and nobody ran for 22 s.
    (workdir / "kiwi.toml").write_text(
        swap_config(workdir, swap="checkpoint", out=0.5, tq=1)  # 4 GiB out: 8.6 s
    )
    k = start_kiwid()
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=TENANT)

    def swapping_out() -> bool:
        swap = k.status()["gpus"][0]["swap"]
        return bool(swap and swap["direction"] == "out")

    wait_for(swapping_out, 10, "a swap-out under way")
    wait_for(lambda: recorded_in_host_ram(workdir), 10, "the swap-out's write-ahead record")
    k.proc.kill()
    k.proc.wait()
    # The sim did not finish the swap: both tenants' memory is on the card.
    assert not swapped(workdir, a) and not swapped(workdir, b)
    # Restart, with swaps fast enough for turns to come within the test's time.
    (workdir / "kiwi.toml").write_text(swap_config(workdir, swap="checkpoint", tq=1))
    k = start_kiwid()
    k.wait_log("yet all of it is on the card")
    runs = {a.key: False, b.key: False}
    deadline = time.monotonic() + 15
    while not all(runs.values()) and time.monotonic() < deadline:
        for t in (a, b):
            runs[t.key] |= not t.frozen()
        time.sleep(0.05)
    assert all(runs.values()), f"not everyone ran after the restart: {runs}\n{k.log_text()}"


def test_an_out_of_memory_checkpoint_is_not_remembered_of_the_workload(
    start_kiwid, tenants, workdir
) -> None:
    # Item 7: after one out-of-memory checkpoint, a new tenant of the same workload
    # was never swapped ("a checkpoint of its workload failed before").
    k = start(start_kiwid, workdir, swap="checkpoint")
    a = tenants("a")
    first = tenants("w1", workload="job")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(first.pid, memory=TENANT, activity="idle")  # known to the sim, no burst yet
    k.call("sim-fault", {"pid": first.pid, "op": "checkpoint", "fault": "fail"})
    k.attach(first.pid, memory=TENANT)  # it bursts: gated, and its checkpoint fails
    k.wait_log("Swap failed: out of")
    first.proc.kill()
    first.proc.wait()
    wait_for(lambda: first.key not in k.tenant_states(), 10, "the first run to be gone")
    again = tenants("w2", workload="job")
    k.attach(again.pid, memory=TENANT)
    wait_for(lambda: swapped(workdir, again), 15, "the workload's next run swapped out")
    assert "failed before" not in k.log_text()
