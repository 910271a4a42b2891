"""Every process of a gated tenant stays off the GPU; a hung call idles nobody (issue 25).

A real kiwid over the driver double (``gate = "cuda-lock"``, ``swap =
"checkpoint"``), as in test_driver_faults_e2e.py. A sampler reads the double's
truth every 50 ms, one consistent snapshot: which tenants have a process that is
RUNNING (unlocked) in a cgroup that is not frozen. Each test is one finding of the
issue, reproduced on kiwid before the fix:

1. a container held at admission before its first CUDA call ran beside the holder
   once it made its context (the lock had nothing to hold when it was gated);
2. a waiting tenant's new process ran beside the holder while its tenant's own
   checkpoint was slow or hung (the follow waited behind it);
3. a checkpoint that hung left the GPU idle until its deadline (its tenant was
   granted its turn, and the turn waited for the checkpoint);
4. a checkpoint that returned late, after an operator's release, let its tenant
   run beside the next holder.

kiwid cannot see a process before the driver lists it, at its first CUDA call:
such a process is locked within one poll (50 ms here), and the sampler allows it
that and no more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.daemon.conftest import Card, Kiwid
from tests.daemon.test_driver_double_e2e import TENANT, holder
from tests.daemon.test_driver_faults_e2e import start
from tests.stand_ins import cudadir
from tests.stand_ins.cudadouble import CudaTenant

# Each test samples, every 50 ms, that a process is locked within one poll: a busy
# neighbour on the other xdist worker could delay a poll past that, so they run alone.
pytestmark = pytest.mark.serial

SAMPLE_S = 0.05
ONE_POLL_S = 0.25
"""A process kiwid could not see before (no context): one poll, its lock, a sample's
slack. Anything seen running longer runs beside the holder."""


def frozen(tenant: CudaTenant) -> bool:
    assert tenant.cgroup is not None
    try:
        return "frozen 1" in (tenant.cgroup / "cgroup.events").read_text()
    except OSError:
        return False


@dataclass
class Sampler:
    """Who runs on the card, every 50 ms, by the double's truth."""

    card: Card
    tenants: dict[str, CudaTenant]
    samples: list[tuple[float, dict[str, frozenset[int]]]] = field(default_factory=list)
    """Per sample: when, and each tenant that runs with its running processes."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            procs = self.card.double.processes()
            runs: dict[str, frozenset[int]] = {}
            for name, tenant in list(self.tenants.items()):
                mine = [p for p in procs if p == tenant.pid or _child(p, tenant.pid)]
                running = frozenset(p for p in mine if procs[p].state == cudadir.RUNNING)
                if running and not frozen(tenant):
                    runs[name] = running
            self.samples.append((time.monotonic(), runs))

    def mark(self) -> int:
        """The next sample's index (the samples of a phase come after it)."""
        return len(self.samples)

    def beside(self, since: int, holder: str) -> list[tuple[float, str, list[int]]]:
        """Samples since ``since`` where another runs beside ``holder`` past a poll.

        A process is seen first when it makes its context (kiwid cannot see it
        before): it may run one poll, until its lock; never longer.
        """
        first_seen: dict[int, float] = {}
        bad = []
        for at, runs in self.samples[since:]:
            for name, pids in runs.items():
                for pid in pids:
                    first_seen.setdefault(pid, at)
                late = sorted(p for p in pids if at - first_seen[p] > ONE_POLL_S)
                if name != holder and late:
                    bad.append((at, name, late))
        return bad

    def idle(self, since: int) -> float:
        """The share of samples since ``since`` in which nobody ran."""
        phase = self.samples[since:]
        return sum(1 for _, runs in phase if not runs) / max(1, len(phase))


def _child(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent


@pytest.fixture
def sampled(card: Card) -> Iterator[Sampler]:
    sampler = Sampler(card, {})
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        yield sampler
    finally:
        sampler._stop.set()
        thread.join(5)


def a_holds(start_kiwid, workdir: Path, card: Card, sampled: Sampler, **kw: float) -> Kiwid:
    card.double.set_foreign(0)
    k = start(start_kiwid, workdir, card, **kw)
    sampled.tenants["a"] = card.arrive("a")
    k.until(lambda: holder(k) == card.key(sampled.tenants["a"]), 10, "a to hold the GPU")
    return k


def test_a_container_held_before_its_first_cuda_call_never_runs_beside_the_holder(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    k = a_holds(start_kiwid, workdir, card, sampled, tq=30)
    first_call = workdir / "b-first-cuda-call"
    (card.parent / "b").mkdir()
    b = card.double.spawn_tenant(TENANT, cgroup=card.parent / "b", context_when=first_call)
    sampled.tenants["b"] = b
    key = card.key(b)
    answer = k.call(
        "register",
        {"id": "b0" * 32, "cgroup_v2": key.removeprefix("cgroup:"), "pid": b.pid, "hold": True},
    )
    assert answer == {"tenant": key, "held": True}, answer
    since = sampled.mark()
    first_call.touch()  # it would make its first CUDA call now
    time.sleep(3)  # a stretch of a's turn, sampled: b never runs beside a
    assert k.tenant(key)["state"] == "waiting", k.tenant(key)
    assert not sampled.beside(since, "a"), sampled.beside(since, "a")[:5]
    assert len(sampled.samples) - since > 40, "the sampler kept up"
    # At its turn it is let go, makes its context and works.
    assert k.ctl("-T", "1").returncode == 0
    k.until(lambda: holder(k) == key, 20, "b's turn")
    k.until(lambda: b.progress() > 0, 10, "b to work at its turn")


@pytest.mark.parametrize("hang", [2.0, None], ids=["slow", "hung"])
def test_a_waiting_tenants_new_process_is_locked_during_its_own_checkpoint(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler, hang: float | None
) -> None:
    # b waits; its checkpoint is slow (2 s) or hangs past its deadline; meanwhile
    # it starts a new process that makes a context.
    k = a_holds(start_kiwid, workdir, card, sampled, tq=30, timeout=1)
    b = card.arrive("b", TENANT // 2, spawn_later=1.5)
    sampled.tenants["b"] = b
    (first,) = b.pids()
    card.double.fault(first, "checkpoint", "hang", hang)
    since = sampled.mark()
    k.until(lambda: len(b.pids()) == 2, 10, "b's new process")
    (newcomer,) = set(b.pids()) - {first}
    k.until(lambda: card.double.state(newcomer) != cudadir.RUNNING, 5, "it locked")
    time.sleep(2)  # the rest of the checkpoint (or of its hang), sampled
    assert holder(k) == card.key(sampled.tenants["a"])
    assert not sampled.beside(since, "a"), sampled.beside(since, "a")[:5]
    if hang is None:
        card.double.clear(first, "checkpoint")


def test_a_waiting_tenants_new_process_is_locked_while_its_checkpoint_moves(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    # The driver serialises the calls on one process: a state asked while that
    # process is being checkpointed waits for the checkpoint (seen on an H200). The
    # follow asked the state of b's process under checkpoint first, and waited
    # there: b's new process ran beside the holder until the checkpoint ended. (On
    # the H200 the follow then ran past its deadline, and its fence froze the
    # process mid-checkpoint.)
    card.double.configure(checkpoint_rate=TENANT // 12)  # b's half GiB: 6 s, due at 9
    k = a_holds(start_kiwid, workdir, card, sampled, tq=30, timeout=8)
    b = card.arrive("b", TENANT // 2, spawn_later=3)
    sampled.tenants["b"] = b
    (first,) = b.pids()
    since = sampled.mark()
    k.until(lambda: len(b.pids()) == 2, 10, "b's new process")
    moving = card.double.processes()[first].moving
    assert moving == cudadir.CHECKPOINTING, "b's checkpoint was to be under way by now"
    (newcomer,) = set(b.pids()) - {first}
    k.until(lambda: card.double.state(newcomer) != cudadir.RUNNING, 5, "it locked")
    k.until(lambda: card.double.state(first) == cudadir.CHECKPOINTED, 15, "the checkpoint's end")
    assert holder(k) == card.key(sampled.tenants["a"])
    assert k.tenant(card.key(b))["state"] == "waiting", k.tenant(card.key(b))
    assert not sampled.beside(since, "a"), sampled.beside(since, "a")[:5]


def test_a_hung_checkpoint_does_not_idle_the_gpu(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    # Three busy tenants, TQ 1 s; c's checkpoint hangs. At its next turn c was
    # granted, and the turn waited for its checkpoint: nobody ran for most of the
    # time until its deadline.
    card.double.configure(checkpoint_rate=0, restore_rate=0)  # swaps at once: no idle of theirs
    k = a_holds(start_kiwid, workdir, card, sampled, tq=1, timeout=10)
    for name in ("b", "c"):
        sampled.tenants[name] = card.arrive(name, TENANT // 2)
    c = sampled.tenants["c"]
    (c_pid,) = c.pids()
    k.until(lambda: card.double.state(c_pid) == cudadir.CHECKPOINTED, 20, "c in host RAM")
    k.until(lambda: holder(k) == card.key(c), 20, "c's turn")
    card.double.fault(c_pid, "checkpoint", "hang")  # its next checkpoint hangs
    k.until(lambda: holder(k) != card.key(c), 20, "c's turn over")
    since = sampled.mark()
    time.sleep(15)
    share = sampled.idle(since)
    assert share < 0.20, f"nobody ran in {share:.0%} of the samples\n{k.log_text()[-4000:]}"
    for name in ("a", "b"):
        assert sampled.tenants[name].progress() > 0
    card.double.clear(c_pid, "checkpoint")


def test_a_checkpoint_returning_after_a_release_lets_nobody_run_beside_the_holder(
    start_kiwid, workdir: Path, card: Card, sampled: Sampler
) -> None:
    # b's checkpoint hangs past its deadline: b is stuck. The operator releases it,
    # and retries it once released: a new burst, a new gate. The checkpoint, back
    # late, restored and unlocked b behind the new gate's back: two tenants ran.
    k = a_holds(start_kiwid, workdir, card, sampled, tq=30, timeout=1)
    b = card.arrive("b", TENANT // 2)
    sampled.tenants["b"] = b
    (b_pid,) = b.pids()
    card.double.fault(b_pid, "checkpoint", "hang")
    key = card.key(b)
    k.until(lambda: k.tenant(key).get("state") == "stuck", 30, "b stuck")
    release = k.ctl("release", key)
    assert "waits behind its swap-out" in release.stderr, release
    card.double.clear(b_pid, "checkpoint")  # back late: it moved b's memory out
    k.until(lambda: k.tenant(key).get("state") == "released", 20, "b released")
    retried = k.ctl("retry", key)  # back into the rotation: gated at its next burst
    assert retried.returncode == 0, retried.stdout + retried.stderr
    k.until(lambda: k.tenant(key).get("state") == "waiting", 20, "b waiting, gated")
    since = sampled.mark()
    time.sleep(3)
    assert holder(k) == card.key(sampled.tenants["a"])
    assert not sampled.beside(since, "a"), sampled.beside(since, "a")[:5]
