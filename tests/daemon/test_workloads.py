"""Workloads remembered across runs: names, the file, what a new tenant is told."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kiwid.core.events import FootprintRemembered, TenantUnswappable
from kiwid.daemon.gating import checkpointable
from kiwid.daemon.tenants.tracker import Identity, TenantInfo
from kiwid.daemon.tenants.workloads import (
    MAX_WORKLOADS,
    WorkloadBook,
    pod_owner,
    program_name,
    workload_of,
)

GiB = 2**30
CID = "4f1c" * 16


@pytest.mark.parametrize(
    ("pod", "owner"),
    [
        ("trainer-7d4b9c6f5-x2x7q", "trainer"),  # Deployment
        ("trainer-x2x7q", "trainer"),  # ReplicaSet, Job, DaemonSet
        ("nightly-28890720-bq4zs", "nightly"),  # CronJob
        ("db-0", "db-0"),  # StatefulSet: the ordinal stays
        ("plain", "plain"),
        ("web-7d4b9c6f5", "web-7d4b9c6f5"),  # no random tail: nothing generated
    ],
)
def test_pod_owner_strips_what_controllers_generate(pod: str, owner: str) -> None:
    assert pod_owner(pod) == owner


def test_workloads_are_named_most_stable_first() -> None:
    pod = Identity(
        "containerd:4f1c4f1c4f1c",
        "containerd",
        "worker",
        container_id=CID,
        pod="trainer-7d4b9c6f5-x2x7q",
        namespace="ml",
        identity_source="annotations",
    )
    assert workload_of(pod, {1}) == "pod ml/trainer/worker"
    unit = Identity("systemd:train.service", "systemd", "train.service")
    assert workload_of(unit, {1}) == "unit train.service"
    named = Identity("podman:4f1c4f1c4f1c", "podman", "nightly-eval", container_id=CID)
    assert workload_of(named, {1}) == "container nightly-eval"


def test_a_bare_process_is_named_by_its_program_and_arguments() -> None:
    code = "print('ready', flush=True); import sys; sys.stdin.read()"
    with subprocess.Popen(
        [sys.executable, "-c", code, "--epochs", "3"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as p:
        try:
            # Popen returns once the child's execve has begun, before the kernel
            # has laid out its arguments: ask once it runs.
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            ident = Identity(f"pid:{p.pid}", "process", f"pid {p.pid}")
            name = workload_of(ident, {p.pid, p.pid + 100000})
        finally:
            p.kill()
    exe = str(Path(sys.executable).resolve())
    assert name == f"exe {exe} -c {shlex.quote(code)} --epochs 3"
    assert workload_of(Identity("pid:1", "process", "pid 1"), set()) is None


def test_a_process_without_arguments_yet_is_not_named_by_its_program_alone() -> None:
    # What /proc shows for a process in the middle of its execve: the new program,
    # no arguments yet. Named "exe python3" it would share one footprint with every
    # other python3 job.
    assert program_name(None, "/usr/bin/python3.11") is None
    assert program_name(("python3", "-c", "pass"), None) == "exe python3 -c pass"
    assert program_name(("x", "a b"), "/opt/x") == "exe /opt/x 'a b'"


def test_a_tenant_unnamed_at_first_is_named_once_it_can_be(tmp_path: Path) -> None:
    book = WorkloadBook(tmp_path)
    ident = Identity("pid:7", "process", "pid 7")
    early = {"pid:7": TenantInfo(ident, pids=set())}  # its processes not seen yet
    assert book.events(early) == []
    assert book.workload("pid:7") is None
    with subprocess.Popen(
        [sys.executable, "-c", "print('ready', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as p:
        try:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            book.events({"pid:7": TenantInfo(ident, pids={p.pid})})  # same identity
        finally:
            p.kill()
    assert book.workload("pid:7") == f"exe {Path(sys.executable).resolve()} -c " + shlex.quote(
        "print('ready', flush=True); input()"
    )


def info(key: str, peak: int, pids: set[int]) -> TenantInfo:
    i = TenantInfo(Identity(key, "systemd", key.removeprefix("systemd:")), pids=pids)
    i.footprint = {"0": peak}
    return i


def test_a_recurring_workload_is_sized_from_its_last_run(tmp_path: Path) -> None:
    first = WorkloadBook(tmp_path)
    a = {"systemd:train.service": info("systemd:train.service", 30 * GiB, {11})}
    assert first.events(a) == []  # never seen: a newcomer
    first.observe(a)
    a["systemd:train.service"].footprint = {"0": 47 * GiB}
    first.observe(a)
    assert first.events({}) == []  # it left: its run's peak is what counts
    assert first.save()
    mode = stat.S_IMODE(os.stat(first.path).st_mode)
    assert mode == 0o600
    # kiwid restarts; the job comes back under another tenant id.
    again = WorkloadBook(tmp_path)
    b = {"systemd:train.service": info("systemd:train.service", GiB, {22})}
    assert again.events(b) == [FootprintRemembered("systemd:train.service", 47 * GiB)]
    assert again.events(b) == []  # told once
    assert again.workload("systemd:train.service") == "unit train.service"


def test_a_run_that_needs_less_is_remembered_smaller(tmp_path: Path) -> None:
    book = WorkloadBook(tmp_path)
    t = {"systemd:x.service": info("systemd:x.service", 40 * GiB, {1})}
    book.events(t)
    book.observe(t)
    book.events({})
    t = {"systemd:x.service": info("systemd:x.service", 10 * GiB, {2})}
    book.events(t)
    book.observe(t)
    book.events({})
    book.save()
    assert WorkloadBook(tmp_path).get("unit x.service").peak_bytes == 10 * GiB  # type: ignore[union-attr]


def test_a_failed_checkpoint_keeps_its_workload_on_the_card_next_time(tmp_path: Path) -> None:
    book = WorkloadBook(tmp_path)
    t = {"systemd:nccl.service": info("systemd:nccl.service", 8 * GiB, {1})}
    book.events(t)
    book.observe(t)
    book.checkpoint_failed("systemd:nccl.service", "CUDA_ERROR_NOT_SUPPORTED")
    book.events({})
    again = WorkloadBook(tmp_path)
    events = again.events({"systemd:nccl.service": info("systemd:nccl.service", 0, {2})})
    assert (
        TenantUnswappable(
            "systemd:nccl.service",
            "a checkpoint of its workload failed before: CUDA_ERROR_NOT_SUPPORTED",
        )
        in events
    )


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[]",
        b'{"workloads": 3}',
        b"\xff\xfe",
        b'{"workloads": {"w": {"peak_bytes": -1}}}',
    ],
)
def test_a_damaged_file_is_ignored_and_replaced(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "workloads.json").write_bytes(content)
    book = WorkloadBook(tmp_path)
    assert len(book) == 0
    t = {"systemd:y.service": info("systemd:y.service", GiB, {1})}
    book.events(t)
    book.observe(t)
    assert book.save()
    assert json.loads((tmp_path / "workloads.json").read_text())["workloads"]["unit y.service"]


def test_good_entries_survive_a_bad_one(tmp_path: Path) -> None:
    doc = {
        "version": 1,
        "workloads": {
            "unit good.service": {"peak_bytes": 5, "seen_unix": 1.0, "checkpoint_failed": None},
            "unit bad.service": {"peak_bytes": "5", "seen_unix": 1.0},
        },
    }
    (tmp_path / "workloads.json").write_text(json.dumps(doc))
    book = WorkloadBook(tmp_path)
    assert book.get("unit good.service") is not None
    assert book.get("unit bad.service") is None


def test_the_file_keeps_the_most_recently_seen(tmp_path: Path) -> None:
    clock = [0.0]
    book = WorkloadBook(tmp_path, clock=lambda: clock[0])
    for i in range(MAX_WORKLOADS + 5):
        clock[0] = float(i)
        key = f"systemd:u{i}.service"
        t = {key: info(key, GiB, {1})}
        book.events(t)
        book.observe(t)
    book.save()
    again = WorkloadBook(tmp_path)
    assert len(again) == MAX_WORKLOADS
    assert again.get("unit u0.service") is None
    assert again.get(f"unit u{MAX_WORKLOADS + 4}.service") is not None


def test_nccl_between_processes_cannot_be_checkpointed(tmp_path: Path) -> None:
    shm = Path(f"/dev/shm/nccl-kiwitest-{os.getpid()}")
    lib = tmp_path / "libnccl.so.2"
    for path in (shm, lib):
        path.write_bytes(b"\0" * 4096)
    code = (
        "import mmap, sys\n"
        "fs = [open(p, 'r+b') for p in sys.argv[1:]]\n"
        "ms = [mmap.mmap(f.fileno(), 0) for f in fs]\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:

        def spawn(*paths: Path) -> int:
            p = subprocess.Popen(
                [sys.executable, "-c", code, *map(str, paths)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
            return p.pid

        plain = spawn()
        assert checkpointable.why_not([plain]) is None
        one_lib = spawn(lib)
        assert checkpointable.why_not([plain, one_lib]) is None  # one process: fine
        other_lib = spawn(lib)
        why = checkpointable.why_not([one_lib, other_lib])
        assert why is not None and "NCCL in 2 processes" in why
        shared = spawn(shm)
        why = checkpointable.why_not([plain, shared])
        assert why is not None and str(shm) in why
        assert checkpointable.why_not([999_999_999]) is None  # gone: no sign
    finally:
        for p in procs:
            p.kill()
            p.wait()
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    stream.close()
        shm.unlink()


# ---- what an operator sees and changes: expiry of a failed checkpoint, forget ----


class Clock:
    """A wall clock the test sets (unix seconds)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


NCCL = "systemd:nccl.service"
NOT_SUPPORTED = TenantUnswappable(
    NCCL, "a checkpoint of its workload failed before: CUDA_ERROR_NOT_SUPPORTED"
)


def book_at(tmp_path: Path, clock: Clock, retry_s: list[float]) -> WorkloadBook:
    return WorkloadBook(tmp_path, clock=clock, retry_after_s=lambda: retry_s[0])


def a_failed_checkpoint(tmp_path: Path, clock: Clock, retry_s: list[float]) -> None:
    book = book_at(tmp_path, clock, retry_s)
    t = {NCCL: info(NCCL, 8 * GiB, {1})}
    book.events(t)
    book.observe(t)
    book.checkpoint_failed(NCCL, "CUDA_ERROR_NOT_SUPPORTED")  # saved at once


def test_a_failed_checkpoint_is_tried_again_after_checkpoint_retry_after(
    tmp_path: Path,
) -> None:
    clock, retry = Clock(1000.0), [100.0]
    a_failed_checkpoint(tmp_path, clock, retry)
    clock.now = 1099.0
    before = book_at(tmp_path, clock, retry)
    (entry,) = before.listing()
    assert entry["workload"] == "unit nccl.service"
    assert (entry["unswappable"], entry["why"]) == (True, "CUDA_ERROR_NOT_SUPPORTED")
    assert (entry["marked_unix"], entry["until_unix"]) == (1000.0, 1100.0)
    assert NOT_SUPPORTED in before.events({NCCL: info(NCCL, 0, {2})})
    clock.now = 1100.0  # the mark has expired: the next run may be swapped
    after = book_at(tmp_path, clock, retry)
    assert after.events({NCCL: info(NCCL, 0, {3})}) == [FootprintRemembered(NCCL, 8 * GiB)]
    (entry,) = after.listing()
    assert (entry["unswappable"], entry["why"], entry["until_unix"]) == (False, None, None)
    assert entry["peak_bytes"] == 8 * GiB  # only the mark goes
    after.save()
    saved = json.loads(after.path.read_text())["workloads"]["unit nccl.service"]
    assert saved["checkpoint_failed"] is None


def test_the_retry_delay_is_read_when_needed_so_a_reload_changes_it(tmp_path: Path) -> None:
    clock, retry = Clock(1000.0), [100.0]
    a_failed_checkpoint(tmp_path, clock, retry)
    book = book_at(tmp_path, clock, retry)
    retry[0] = 7200.0  # memory.checkpoint_retry_after reloaded
    clock.now = 2000.0
    (entry,) = book.listing()
    assert (entry["unswappable"], entry["until_unix"]) == (True, 8200.0)
    assert NOT_SUPPORTED in book.events({NCCL: info(NCCL, 0, {2})})


def test_a_mark_saved_without_its_time_counts_from_when_it_was_read(tmp_path: Path) -> None:
    entry = {"peak_bytes": 5, "seen_unix": 1.0, "checkpoint_failed": "CUDA_ERROR_UNKNOWN"}
    doc = {"version": 1, "workloads": {"unit old.service": entry}}
    (tmp_path / "workloads.json").write_text(json.dumps(doc))
    book = book_at(tmp_path, Clock(5000.0), [100.0])
    (listed,) = book.listing()
    assert (listed["unswappable"], listed["marked_unix"], listed["until_unix"]) == (
        True,
        5000.0,
        5100.0,
    )
    book.save()
    saved = json.loads(book.path.read_text())["workloads"]["unit old.service"]
    assert saved["checkpoint_failed_unix"] == 5000.0


def test_a_passing_checkpoint_failure_is_not_remembered(tmp_path: Path) -> None:
    book = WorkloadBook(tmp_path)
    t = {NCCL: info(NCCL, 8 * GiB, {1})}
    book.events(t)
    book.observe(t)
    book.checkpoint_failed(NCCL, "out of host memory", permanent=False)
    assert book.get("unit nccl.service").checkpoint_failed is None  # type: ignore[union-attr]
    book.events({})
    book.save()
    again = WorkloadBook(tmp_path)
    assert NOT_SUPPORTED not in again.events({NCCL: info(NCCL, 0, {2})})
    assert again.listing()[0]["unswappable"] is False


def test_forget_drops_one_workload_and_saves_at_once(tmp_path: Path) -> None:
    clock, retry = Clock(1000.0), [100.0]
    a_failed_checkpoint(tmp_path, clock, retry)
    book = book_at(tmp_path, clock, retry)
    other = {"systemd:x.service": info("systemd:x.service", GiB, {4})}
    book.events(other)
    book.observe(other)
    assert book.forget("unit nccl.service") is True  # saved
    saved = json.loads(book.path.read_text())["workloads"]
    assert set(saved) == {"unit x.service"}
    assert [e["workload"] for e in book.listing()] == ["unit x.service"]
    with pytest.raises(KeyError):
        book.forget("unit nccl.service")
    assert book_at(tmp_path, clock, retry).events({NCCL: info(NCCL, 0, {5})}) == []
