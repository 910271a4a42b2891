"""Memory swapping, end to end: a real kiwid, real processes in real cgroups, and
the sim backend modelling the card's memory and the swap's cost (seconds = bytes /
rate). What the sim holds (which process is on the card, which in "host RAM") is
read from its persist file, the sim's own truth."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import KIWID, V2_ROOT, Kiwid, wait_for

GiB = 2**30
CARD_GIB = 10  # with the 1 GiB reserve, two 4 GiB tenants fit and three do not
TENANT = 4 * GiB


def swap_config(d: Path, **kw: Any) -> str:
    v = {
        "tq": 1,
        "idle_release": 0.5,
        "swap": "checkpoint",
        "out": 16,
        "in_": 32,
        "floor": 0,
        "devices": 1,
        "newcomer": "whole-card",
        **kw,
    }
    return f"""\
[scheduler]
tq = {v["tq"]}
idle_release = {v["idle_release"]}
[gpu]
backend = "sim"
poll_interval = 0.05
[gpu.sim]
devices = {v["devices"]}
memory_gib = {CARD_GIB}
swap_out_gbps = {v["out"]}
swap_in_gbps = {v["in_"]}
[memory]
swap = "{v["swap"]}"
reserve_mib = 1024
host_floor_mib = {v["floor"]}
newcomer = "{v["newcomer"]}"
[control]
socket = "{d / "kiwid.sock"}"
[daemon]
state_dir = "{d / "state"}"
shutdown_timeout = 10
[kubernetes]
cdi_dir = ""
"""


def start(start_kiwid, workdir: Path, **kw: Any) -> Kiwid:
    (workdir / "kiwi.toml").write_text(swap_config(workdir, **kw))
    return start_kiwid()


def sim_memory(workdir: Path) -> dict[int, tuple[int, bool]]:
    """pid -> (bytes, swapped) as the simulated GPU holds them."""
    try:
        doc = json.loads((workdir / "state" / "sim.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(e[0]): (int(e[2]), bool(e[5])) for e in doc["entries"]}


def swapped(workdir: Path, t) -> bool:
    return sim_memory(workdir).get(t.pid, (0, False))[1]


def holder(k: Kiwid) -> str | None:
    h = k.status()["gpus"][0]["holder"]
    return h["tenant"] if h else None


def swap_lines(k: Kiwid) -> list[tuple[str, str]]:
    """(direction, tenant key) of every 'Swapped' log line, in order."""
    return re.findall(r"Swapped (out|in) (?:\S+ \()?(cgroup:/\S+?)\)?: ", k.log_text())


def a_holds_b_waits(start_kiwid, tenants, workdir: Path, *, swapped_out: bool = True, **kw):
    """Start kiwid: tenant ``a`` (4 GiB) holds the GPU and ``b`` (4 GiB) is queued.

    By default it returns once b's memory is in host RAM.
    """
    k = start(start_kiwid, workdir, **kw)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=TENANT)
    if swapped_out:
        wait_for(lambda: swapped(workdir, b), 5, "b's memory in host RAM")
    return k, a, b


def test_three_tenants_larger_than_the_card_rotate_through_host_ram(
    start_kiwid, tenants, workdir
) -> None:
    k = start(start_kiwid, workdir)
    ts = [tenants(n) for n in ("a", "b", "c")]
    # They arrive one by one, each when the card has room for it (a third 4 GiB
    # allocation beside two would fail on a real card before kiwid saw it).
    k.attach(ts[0].pid, memory=TENANT)
    wait_for(lambda: holder(k) == ts[0].key, 5, "a to hold the GPU")
    for t in ts[1:]:
        k.attach(t.pid, memory=TENANT)
        wait_for(lambda t=t: swapped(workdir, t), 5, f"{t.name}'s memory in host RAM")
    keys = {t.key: t.name for t in ts}
    order: list[str] = [ts[0].key]
    worst = 0
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline and len(order) < 7:
        memory = sim_memory(workdir)
        resident = sum(n for n, out in memory.values() if not out)
        worst = max(worst, resident)
        # Whoever runs has its memory on the card; the swapped are gated.
        for t in ts:
            if memory.get(t.pid, (0, False))[1]:
                assert t.frozen() or not swapped(workdir, t), f"{t.name} runs from host RAM"
        current = holder(k)
        if current and (not order or order[-1] != current):
            order.append(current)
    names = [keys[o] for o in order]
    assert len(names) >= 6, f"too few turns in 12 s: {names}\n{k.log_text()}"
    assert worst <= CARD_GIB * GiB, f"{worst / GiB:.1f} GiB resident on a {CARD_GIB} GiB card"
    for i in range(len(names) - 3):
        assert sorted(names[i : i + 3]) == ["a", "b", "c"], f"not round-robin: {names}"
    moves = swap_lines(k)
    for t in ts:
        assert ("out", t.key) in moves and ("in", t.key) in moves, moves
    # Once everyone is known (a tenant's first turn evicts everyone else), the
    # next one fits beside the holder: it comes back BEFORE the holder goes out.
    later = moves[moves.index(("in", ts[2].key)) + 1 :]
    assert later[:2] and later[0][0] == "in" and later[1][0] == "out", moves
    status = k.status()
    ledgers = {t["id"]: t["ledger"] for t in status["gpus"][0]["tenants"]}
    assert all(ledgers[t.key]["swapped_out_bytes"] >= TENANT for t in ts)


@pytest.mark.serial
def test_status_answers_during_a_long_swap_and_shows_it(start_kiwid, tenants, workdir) -> None:
    # 4 GiB out at 1 GB/s: a swap of about 4.3 s.
    k, _a, b = a_holds_b_waits(start_kiwid, tenants, workdir, swapped_out=False, tq=30, out=1)
    swap = wait_for(lambda: k.status()["gpus"][0]["swap"], 5, "a swap in progress")
    assert (swap["tenant"], swap["direction"], swap["bytes"]) == (b.key, "out", TENANT)
    started = time.monotonic()
    out = k.ctl("status", "--json")
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 2, "status must not wait for the swap"
    assert json.loads(out.stdout)["gpus"][0]["swap"]["tenant"] == b.key
    assert k.call("ping")
    wait_for(lambda: swapped(workdir, b), 10, "b's memory in host RAM")
    wait_for(lambda: k.status()["gpus"][0]["swap"] is None, 5, "the swap to end")
    b_status = next(t for t in k.status()["gpus"][0]["tenants"] if t["id"] == b.key)
    assert b_status["resident"] is False, k.log_text()
    assert b.frozen()


def test_status_and_explain_name_a_hand_over_and_its_phase(start_kiwid, tenants, workdir) -> None:
    # The phase is held, not caught while it lasts: a's checkpoint hangs (sim-fault)
    # until the test has read status and explain, which on a loaded host can take
    # longer than a swap. Room is the phase that can be held: a restore that runs
    # late is passed over (the next one goes first), and its hand-over ends. A
    # generous driver_timeout keeps the hung checkpoint short of its deadline.
    held = swap_config(workdir, tq=1).replace("[gpu]\n", "[gpu]\ndriver_timeout = 120\n", 1)
    (workdir / "kiwi.toml").write_text(held)
    k = start_kiwid()
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.call("sim-fault", {"pid": a.pid, "op": "checkpoint", "fault": "hang"})
    k.attach(b.pid, memory=TENANT)

    def making_room() -> dict[str, Any] | None:
        h = k.status()["gpus"][0]["handover"]
        return h if h and h["phase"] == "making room" else None

    # a's quantum ends; b, whose size nobody knows yet, wants the whole card: a goes out.
    handover = wait_for(making_room, 15, "room being made for b (a's checkpoint, held)")
    assert (handover["from"], handover["to"]) == (a.key, b.key), handover
    assert handover["seconds"] >= 0 and handover["since_unix"] <= time.time()
    out = k.ctl("explain", b.key)
    assert f"is being handed over from {a.key} to {b.key} since " in out.stdout, out.stdout
    assert "making room: other tenants' memory is leaving the card" in out.stdout, out.stdout
    assert f"  handover {a.key} -> {b.key}, making room, " in k.ctl("status").stdout

    k.call("sim-fault", {"pid": a.pid, "op": "checkpoint", "fault": "none"})
    # The hand-over ends when kiwid hears that b's ungate took, after the thaw and
    # the state file's write: await kiwid's word first, not the cgroup, which thaws
    # a moment before (the cgroup is read after it: TQ 1 s, b may yield meanwhile).
    wait_for(
        lambda: k.status()["gpus"][0]["handover"] is None and holder(k) == b.key and not b.frozen(),
        20,
        "the hand-over to end with b running",
    )


def test_after_sigkill_a_restart_keeps_the_swapped_tenant_and_brings_it_back(
    start_kiwid, tenants, workdir
) -> None:
    k, _a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=3)
    record = json.loads((workdir / "state" / "state.json").read_text())["gated"][b.key]
    assert record["swapped"] == {"0": TENANT}
    k.proc.kill()
    k.proc.wait()
    assert b.frozen() and swapped(workdir, b)
    k2 = start_kiwid(wait_ready=False)
    k2.wait_log(f"Re-adopted {b.key}: its memory is in host RAM", 10)
    assert b.frozen(), "a swapped tenant must not run before its memory is back"
    k2.wait_answering()  # it re-adopts before it serves its socket (a slow host showed it)
    assert b.frozen()
    assert k2.tenant_states()[b.key] == "waiting"
    # Its turn comes: restored, then let go.
    wait_for(lambda: holder(k2) == b.key, 10, "b's turn")
    assert not swapped(workdir, b)
    wait_for(lambda: not b.frozen(), 5, "b to run")
    assert ("in", b.key) in swap_lines(k2)


def test_recover_restores_and_thaws_a_swapped_tenant(start_kiwid, tenants, workdir) -> None:
    k, _a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=30)
    k.proc.kill()
    k.proc.wait()
    out = subprocess.run(
        [*KIWID, "recover", "--state-dir", str(workdir / "state")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert f"Restored {b.key}" in out.stderr
    assert not swapped(workdir, b) and not b.frozen()
    assert not (workdir / "state" / "state.json").exists()


def test_sigterm_restores_what_fits_and_keeps_the_rest_for_recover(
    start_kiwid, tenants, workdir
) -> None:
    k = start(start_kiwid, workdir, tq=30)
    ts = [tenants(n) for n in ("a", "b", "c")]
    k.attach(ts[0].pid, memory=TENANT)
    wait_for(lambda: holder(k) == ts[0].key, 5, "a to hold the GPU")
    for t in ts[1:]:
        k.attach(t.pid, memory=TENANT)
    wait_for(lambda: swapped(workdir, ts[1]) and swapped(workdir, ts[2]), 5, "b, c swapped")
    assert k.stop(signal.SIGTERM) == 1, "a tenant left gated must show in the exit code"
    log = k.log_text()
    # a runs, one of b and c fits back beside it, the other stays in host RAM.
    back = [t for t in ts[1:] if not swapped(workdir, t)]
    kept = [t for t in ts[1:] if swapped(workdir, t)]
    assert len(back) == 1 and len(kept) == 1, log
    assert not back[0].frozen() and kept[0].frozen()
    assert f"Kept swapped: {kept[0].key}" in log
    # The manual path: recover fails while there is no room and says what to do...
    recover = [*KIWID, "recover", "--state-dir", str(workdir / "state")]
    out = subprocess.run(recover, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1
    assert "Free GPU memory" in out.stderr and kept[0].key in out.stderr
    assert kept[0].frozen()
    # ... and succeeds once a job made room.
    ts[0].proc.kill()
    ts[0].proc.wait()
    out = subprocess.run(recover, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert not kept[0].frozen() and not swapped(workdir, kept[0])


def test_no_swap_out_below_the_host_memory_floor(start_kiwid, tenants, workdir) -> None:
    k = start(start_kiwid, workdir, tq=30, floor=2**40 // 2**20)  # 1 TiB: never met
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=TENANT)
    k.wait_log("Swap out of", 5)
    assert "host RAM floor" in k.log_text()
    b_status = wait_for(
        lambda: next(
            (t for t in k.status()["gpus"][0]["tenants"] if t["id"] == b.key and t["swap_refusal"]),
            None,
        ),
        5,
        "status to say why b was not swapped",
    )
    assert "memory.host_floor_mib" in b_status["swap_refusal"]
    assert b_status["resident"] is True and b_status["gated"], "gated, its memory on the card"
    wait_for(b.frozen, 5, "b's freeze (a worker carries it out) to be done")
    assert not swapped(workdir, b)


def test_swap_needs_the_cuda_lock_on_a_real_gpu_and_says_so(caplog) -> None:
    # With the sim every gate can swap; with NVML it takes the CUDA lock gate.
    from kiwid.config import Settings  # noqa: PLC0415
    from kiwid.config.schema import MemorySettings  # noqa: PLC0415
    from kiwid.daemon.gating.gates import NullGate  # noqa: PLC0415
    from kiwid.daemon.main import make_swapper  # noqa: PLC0415

    class NotSim:
        name = "nvml"

    settings = Settings(memory=MemorySettings(swap="checkpoint"))
    assert make_swapper(settings, NotSim(), NullGate()) is None  # type: ignore[arg-type]
    assert "memory.swap = checkpoint is off: it needs the CUDA lock gate" in caplog.text


def test_a_long_swap_on_one_gpu_does_not_hold_up_a_hand_over_on_another(
    start_kiwid, tenants, workdir
) -> None:
    # GPU 0's swap-out: 4 GiB at 0.5 GB/s, about 8.6 s. GPU 1's: 0.25 GiB, 0.5 s.
    k = start(start_kiwid, workdir, tq=30, out=0.5, devices=2)
    a0, b0, a1, b1 = (tenants(n) for n in ("a0", "b0", "a1", "b1"))
    k.attach(a0.pid, gpu=0, memory=TENANT)
    k.attach(a1.pid, gpu=1, memory=GiB // 4)
    wait_for(lambda: holder(k) == a0.key, 5, "a0 to hold GPU 0")
    k.attach(b0.pid, gpu=0, memory=TENANT)
    wait_for(lambda: k.status()["gpus"][0]["swap"], 5, "b0's swap-out under way")
    k.attach(b1.pid, gpu=1, memory=GiB // 4)
    wait_for(lambda: swapped(workdir, b1), 5, "b1's memory in host RAM")
    assert k.status()["gpus"][0]["swap"] is not None, "GPU 1 waited for GPU 0's swap"
    assert b1.frozen() and not swapped(workdir, b0)
    wait_for(lambda: swapped(workdir, b0), 15, "b0's memory in host RAM")


def test_a_swapped_tenant_that_died_is_dropped_at_stop(start_kiwid, tenants, workdir) -> None:
    k, _a, b = a_holds_b_waits(start_kiwid, tenants, workdir, tq=30)
    b.proc.kill()
    b.proc.wait()
    assert k.stop(signal.SIGTERM) == 0, k.log_text()
    assert "Kept swapped" not in k.log_text()
    assert not (workdir / "state" / "state.json").exists()


def test_a_swapped_record_whose_pid_now_names_another_process_is_dropped_untouched(
    start_kiwid, tenants, workdir
) -> None:
    # The record's tenant died while kiwid was down, and its pid went to another
    # process (here: one in the same cgroup path, frozen by someone else, paused).
    other = tenants("other", busy=False)
    (other.v2 / "cgroup.freeze").write_text("1")
    wait_for(other.frozen, 5, "the other process to be paused")
    start_ticks = int(Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    record = {
        "method": "freeze",
        "cgroup_v2": "/" + str(other.v2.relative_to(V2_ROOT)),
        "cgroup_v1_freezer": None,
        "cgroup_ids": [other.v2.stat().st_ino, None],
        "pids": [[other.pid, start_ticks - 1]],  # the pid, but not that process
        "swapped": {"0": TENANT},
        "swap_method": "sim",
    }
    state = workdir / "state"
    state.mkdir(mode=0o700)
    (state / "state.json").write_text(json.dumps({"version": 2, "gated": {other.key: record}}))
    k = start(start_kiwid, workdir, tq=30)
    log = k.log_text()
    assert f"Dropped {other.key}" in log, log
    assert f"pid {other.pid} is another process now" in log, log
    assert other.key not in k.tenant_states()
    assert (
        not (state / "state.json").exists()
        or other.key not in json.loads((state / "state.json").read_text())["gated"]
    )
    for _ in range(10):  # polls pass: kiwid never takes it for the swapped tenant
        assert other.key not in k.tenant_states()
        time.sleep(0.05)  # what is checked is that nothing happens meanwhile
    assert other.frozen(), "kiwid must not touch a process it did not gate"
    assert k.stop(signal.SIGTERM) == 0
    assert other.frozen()
