"""Safe restores, remembered workloads and tenants the driver cannot checkpoint,
end to end: a real kiwid, real processes in real cgroups, the simulated GPU.

The sim's own truth (which process is on the card, which in "host RAM") is its
persist file; memory that no process shows is set with ``sim-foreign``. A restore
the card cannot take fails in the sim as it would in the driver ("do not fit"),
so a log without "Swap failed" shows that none was tried.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

from tests.daemon.conftest import Kiwid, wait_for
from tests.daemon.test_swap_e2e import TENANT, GiB, holder, sim_memory, start, swapped


def tenant_status(k: Kiwid, key: str) -> dict:
    """The tenant's status (empty until kiwid has seen it)."""
    return next((t for t in k.status()["gpus"][0]["tenants"] if t["id"] == key), {})


def turns(k: Kiwid, seconds: float) -> list[str]:
    """The holders seen over ``seconds``, each change once."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        current = holder(k)
        if current and (not seen or seen[-1] != current):
            seen.append(current)
        time.sleep(0.05)
    return seen


def holder_and_idle(k: Kiwid, tenants) -> tuple:
    """A busy tenant that holds the GPU and an idle one on the card, 3 GiB each."""
    h, idle = tenants("holder"), tenants("idle", busy=False)
    k.attach(h.pid, memory=3 * GiB)
    wait_for(lambda: holder(k) == h.key, 5, "h to hold the GPU")
    k.attach(idle.pid, memory=3 * GiB, activity="idle")
    return h, idle


def test_a_restore_waits_for_free_memory_and_goes_once_there_is(
    start_kiwid, tenants, workdir
) -> None:
    k = start(start_kiwid, workdir, tq=2)
    a, b = tenants("a"), tenants("b")
    k.attach(a.pid, memory=TENANT)
    wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
    k.attach(b.pid, memory=TENANT)
    wait_for(lambda: swapped(workdir, b), 5, "b's memory in host RAM")
    # 6 GiB that no process shows: once a leaves the 10 GiB card, 4 GiB are free,
    # short of b's 4 GiB plus the 1 GiB reserve.
    k.call("sim-foreign", {"gpu": 0, "memory_bytes": 6 * GiB})
    waiting = wait_for(
        lambda: [
            t["waiting_for"]
            for t in k.status()["gpus"][0]["tenants"]
            if (t["waiting_for"] or "").startswith("waiting for free memory on GPU 0")
        ],
        15,
        "a restore waiting for free memory",
    )
    assert "memory.reserve_mib" in waiting[0]
    assert k.status()["gpus"][0]["free_bytes"] <= 4 * GiB
    assert "Swap failed" not in k.log_text()
    k.call("sim-foreign", {"gpu": 0, "memory_bytes": 0})
    seen = turns(k, 8)
    assert {a.key, b.key} <= set(seen), (seen, k.log_text())
    assert "Swap failed" not in k.log_text()


def test_a_recurring_job_is_sized_from_its_last_run_after_a_restart(
    start_kiwid, tenants, workdir
) -> None:
    k = start(start_kiwid, workdir, tq=2, swap="auto")
    first = tenants("job-1", workload="nightly-job")
    k.attach(first.pid, memory=6 * GiB)
    wait_for(lambda: holder(k) == first.key, 5, "the job to hold the GPU")
    workload = wait_for(lambda: tenant_status(k, first.key).get("workload"), 5, "its workload")
    assert workload.endswith("nightly-job")
    first.proc.kill()
    first.proc.wait()
    wait_for(lambda: first.key not in k.tenant_states(), 5, "the job to leave")
    assert k.stop() == 0
    book = workdir / "state" / "workloads.json"
    assert stat.S_IMODE(os.stat(book).st_mode) == 0o600
    assert json.loads(book.read_text())["workloads"][workload]["peak_bytes"] == 6 * GiB
    # A new kiwid: another tenant holds, an idle one sits on the card, and the job
    # comes back, small so far (its ballast not allocated yet).
    k = start_kiwid()
    h, idle = holder_and_idle(k, tenants)
    again = tenants("job-2", workload="nightly-job")
    k.attach(again.pid, memory=GiB)
    status = wait_for(
        lambda: (s := tenant_status(k, again.key)).get("remembered_bytes") and s, 5, "its memory"
    )
    assert status["workload"] == workload
    assert status["remembered_bytes"] == 6 * GiB
    wait_for(lambda: holder(k) == again.key and not again.frozen(), 10, "the job's first turn")
    memory = sim_memory(workdir)
    # Known, it needed 6 GiB beside the 6 on the card: one 3 GiB tenant left for
    # it (the idle one, least recently run); as a newcomer both would have.
    assert memory[idle.pid][1] is True
    assert memory[h.pid][1] is False, k.log_text()


def test_a_newcomer_gets_the_whole_card(start_kiwid, tenants, workdir) -> None:
    """The contrast to the test above: the same arrival, nothing remembered."""
    k = start(start_kiwid, workdir, tq=2, swap="auto")
    h, idle = holder_and_idle(k, tenants)
    job = tenants("job", workload="never-seen")
    k.attach(job.pid, memory=GiB)
    wait_for(lambda: holder(k) == job.key and not job.frozen(), 10, "the job's first turn")
    assert tenant_status(k, job.key)["remembered_bytes"] is None
    memory = sim_memory(workdir)
    assert memory[idle.pid][1] is True and memory[h.pid][1] is True, k.log_text()


def test_a_tenant_using_nccl_between_processes_is_never_swapped(
    start_kiwid, tenants, workdir
) -> None:
    shm = Path(f"/dev/shm/nccl-kiwitest-{os.getpid()}")
    shm.write_bytes(b"\0" * 4096)
    try:
        k = start(start_kiwid, workdir, tq=1)
        a = tenants("a")
        nccl = tenants("nccl", maps=shm)
        c = tenants("c")
        k.attach(a.pid, memory=3 * GiB)
        wait_for(lambda: holder(k) == a.key, 5, "a to hold the GPU")
        k.attach(nccl.pid, memory=3 * GiB)
        refusal = wait_for(
            lambda: tenant_status(k, nccl.key).get("swap_refusal"), 5, "its swap refusal"
        )
        assert "NCCL" in refusal and str(shm) in refusal
        k.attach(c.pid, memory=3 * GiB)
        seen = turns(k, 8)
        assert {a.key, nccl.key, c.key} <= set(seen), (seen, k.log_text())
        assert f"Swapped out {nccl.key}" not in k.log_text()
        assert not any(out for pid, (_, out) in sim_memory(workdir).items() if pid == nccl.pid)
        moved = [line for line in k.log_text().splitlines() if "Swapped out" in line]
        assert any(a.key in line for line in moved) and any(c.key in line for line in moved)
    finally:
        shm.unlink()
