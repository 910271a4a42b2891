"""The cgroup freezer adapter against real cgroups and real processes (needs root)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kiwid.adapters.cgroups import (
    CgroupError,
    CgroupGone,
    CgroupLayout,
    CgroupRef,
    FreezeError,
    Freezer,
    FreezeTimeout,
    IsolationError,
    cgroup_of,
    isolate_process,
    populated,
    remove_isolation,
)
from tests.adapters.conftest import BUSY, Sandbox, cpu_seconds, wait_until

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
PURE_V2_MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/root rw
26 23 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw
"""
NO_V1_FREEZER = "needs a mounted cgroup v1 freezer hierarchy (this host has cgroup2 only)"
ESCAPED_V1_MOUNTINFO = """\
37 31 0:34 / /mnt/my\\040cgroups rw,relatime - cgroup cgroup rw,freezer,devices
"""


@pytest.mark.parametrize(
    ("text", "v2", "v1"),
    [
        (HYBRID_MOUNTINFO, "/sys/fs/cgroup/unified", "/sys/fs/cgroup/freezer"),
        (PURE_V2_MOUNTINFO, "/sys/fs/cgroup", None),
        (ESCAPED_V1_MOUNTINFO, None, "/mnt/my cgroups"),
        ("garbage\n\n1 2 - x\n", None, None),
    ],
)
def test_layout_from_mountinfo(text: str, v2: str | None, v1: str | None) -> None:
    layout = CgroupLayout.from_mountinfo(text)
    assert layout.v2_root == (Path(v2) if v2 else None)
    assert layout.v1_freezer_root == (Path(v1) if v1 else None)


def test_layout_detect_finds_this_hosts_mounts(layout: CgroupLayout) -> None:
    assert layout.v2_root is not None
    assert (layout.v2_root / "cgroup.procs").exists()
    if layout.v1_freezer_root is not None:  # hybrid, as on the CI machines
        assert layout.v2_root == Path("/sys/fs/cgroup/unified")
        assert (layout.v1_freezer_root / "tasks").exists()


def test_layout_rejects_paths_that_escape() -> None:
    layout = CgroupLayout(Path("/sys/fs/cgroup/unified"), None)
    with pytest.raises(FreezeError, match="bad cgroup path"):
        layout.dirs(CgroupRef("/kiwi/../../etc", None))
    with pytest.raises(FreezeError, match="bad cgroup path"):
        layout.dirs(CgroupRef("relative", None))
    assert layout.dirs(CgroupRef("/", "/a")) == (None, None)


def v2_frozen(sandbox: Sandbox, ref: CgroupRef) -> bool:
    v2, _ = sandbox.layout.dirs(ref)
    assert v2 is not None
    return "frozen 1" in (v2 / "cgroup.events").read_text().splitlines()


def v1_state(sandbox: Sandbox, ref: CgroupRef) -> str:
    _, v1 = sandbox.layout.dirs(ref)
    assert v1 is not None
    return (v1 / "freezer.state").read_text().strip()


def busy_child_in(sandbox: Sandbox, ref: CgroupRef) -> int:
    child = sandbox.spawn(BUSY)
    sandbox.move(child.pid, ref)
    start = cpu_seconds(child.pid)
    wait_until(lambda: cpu_seconds(child.pid) > start, what="the busy child to run")
    return child.pid


def assert_cpu_stopped(pid: int) -> None:
    before = cpu_seconds(pid)
    time.sleep(0.3)  # the observation itself: a frozen task gains no CPU time
    assert cpu_seconds(pid) - before <= 0.011  # at most one clock tick of slack


def assert_cpu_runs(pid: int) -> None:
    before = cpu_seconds(pid)
    wait_until(lambda: cpu_seconds(pid) > before + 0.02, what=f"process {pid} to run")


def test_v2_freeze_stops_a_busy_child_and_thaw_resumes_it(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("tenant")
    pid = busy_child_in(sandbox, ref)
    freezer = Freezer(sandbox.layout)

    freezer.freeze(ref)

    assert v2_frozen(sandbox, ref)
    if sandbox.layout.v1_freezer_root is not None:  # hybrid: v2 was enough, v1 untouched
        assert v1_state(sandbox, ref) == "THAWED"
    assert freezer.is_frozen(ref)
    assert_cpu_stopped(pid)

    freezer.thaw(ref)

    assert not v2_frozen(sandbox, ref)
    assert not freezer.is_frozen(ref)
    assert_cpu_runs(pid)


def test_v1_freeze_when_the_tenant_has_no_v2_cgroup(sandbox: Sandbox) -> None:
    if sandbox.layout.v1_freezer_root is None:
        pytest.skip(NO_V1_FREEZER)
    ref = sandbox.cgroup("tenant", v2=False)
    pid = busy_child_in(sandbox, ref)
    freezer = Freezer(sandbox.layout)

    freezer.freeze(ref)

    assert v1_state(sandbox, ref) == "FROZEN"
    assert freezer.is_frozen(ref)
    assert_cpu_stopped(pid)

    freezer.thaw(ref)

    assert v1_state(sandbox, ref) == "THAWED"
    assert_cpu_runs(pid)


def test_v2_root_falls_back_to_the_v1_freezer(sandbox: Sandbox) -> None:
    if sandbox.layout.v1_freezer_root is None:
        pytest.skip(NO_V1_FREEZER)
    v1_only = sandbox.cgroup("tenant", v2=False)
    ref = CgroupRef(v2="/", v1_freezer=v1_only.v1_freezer)
    pid = busy_child_in(sandbox, v1_only)

    Freezer(sandbox.layout).freeze(ref)

    assert v1_state(sandbox, v1_only) == "FROZEN"
    assert_cpu_stopped(pid)
    Freezer(sandbox.layout).thaw(ref)
    assert_cpu_runs(pid)


def test_thaw_undoes_a_freeze_in_either_hierarchy(sandbox: Sandbox) -> None:
    if sandbox.layout.v1_freezer_root is None:
        pytest.skip(NO_V1_FREEZER)
    ref = sandbox.cgroup("tenant")
    pid = busy_child_in(sandbox, ref)
    v2, v1 = sandbox.layout.dirs(ref)
    assert v2 is not None
    assert v1 is not None
    (v1 / "freezer.state").write_text("FROZEN")  # as `runc pause` would
    (v2 / "cgroup.freeze").write_text("1")
    wait_until(lambda: v1_state(sandbox, ref) == "FROZEN", what="v1 FROZEN")

    Freezer(sandbox.layout).thaw(ref)

    assert v1_state(sandbox, ref) == "THAWED"
    assert (v2 / "cgroup.freeze").read_text().strip() == "0"
    assert_cpu_runs(pid)


def test_a_vanished_cgroup_thaws_quietly_and_does_not_freeze(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("gone")
    dirs = [d for d in sandbox.layout.dirs(ref) if d is not None]
    assert dirs  # cgroup2, and the v1 freezer where it is mounted
    for directory in dirs:
        directory.rmdir()
    freezer = Freezer(sandbox.layout)

    freezer.thaw(ref)

    assert not freezer.is_frozen(ref)
    with pytest.raises(CgroupGone):
        freezer.freeze(ref)
    if ref.v1_freezer is not None:  # hybrid: the v1 path alone is gone too
        with pytest.raises(CgroupGone):
            freezer.freeze(CgroupRef(v2=None, v1_freezer=ref.v1_freezer))


def test_refuses_the_root_cgroup_and_a_tenant_without_cgroups(layout: CgroupLayout) -> None:
    freezer = Freezer(layout)
    with pytest.raises(FreezeError, match="root cgroup"):
        freezer.freeze(CgroupRef(v2="/", v1_freezer="/"))
    with pytest.raises(FreezeError, match="no usable freezer"):
        freezer.freeze(CgroupRef(v2=None, v1_freezer=None))
    freezer.thaw(CgroupRef(v2="/", v1_freezer="/"))  # nothing to thaw, no error
    assert not freezer.is_frozen(CgroupRef(v2="/", v1_freezer="/"))


def test_refuses_a_cgroup_that_holds_kiwid_itself(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("daemon/inner")
    parent = CgroupRef(
        v2=sandbox.top + "/daemon" if ref.v2 else None,
        v1_freezer=sandbox.top + "/daemon" if ref.v1_freezer else None,
    )
    # A real "kiwid" that runs inside the cgroup and tries to freeze it and its parent.
    script = textwrap.dedent(f"""
        import os
        from kiwid.adapters.cgroups import CgroupLayout, CgroupRef, FreezeError, Freezer
        layout = CgroupLayout.detect()
        ref = CgroupRef({ref.v2!r}, {ref.v1_freezer!r})
        for d in layout.dirs(ref):
            if d is not None:
                (d / "cgroup.procs").write_text(str(os.getpid()))
        for target in (ref, CgroupRef({parent.v2!r}, {parent.v1_freezer!r})):
            try:
                Freezer(layout, timeout_s=0.5).freeze(target)
                print("FROZE")
            except FreezeError as err:
                print("REFUSED", err)
    """)
    child = sandbox.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=20)

    lines = out.decode().splitlines()
    assert len(lines) == 2, lines
    assert all(line.startswith("REFUSED") and "kiwid would freeze itself" in line for line in lines)


def test_refuses_an_ancestor_of_an_injected_own_cgroup(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("a")
    own = CgroupRef(v2=f"{ref.v2}/kiwid", v1_freezer=None)
    with pytest.raises(FreezeError, match="kiwid would freeze itself"):
        Freezer(sandbox.layout, own=own).freeze(ref)
    assert not v2_frozen(sandbox, ref)


def test_zero_timeout_raises_and_leaves_the_v2_cgroup_thawed(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("tenant")
    pid = busy_child_in(sandbox, ref)
    v2, _ = sandbox.layout.dirs(ref)
    assert v2 is not None

    with pytest.raises(FreezeTimeout, match=str(v2)) as caught:
        Freezer(sandbox.layout, timeout_s=0).freeze(ref)

    assert caught.value.cgroup == v2
    assert (v2 / "cgroup.freeze").read_text().strip() == "0"
    wait_until(lambda: not v2_frozen(sandbox, ref), what="frozen 0")
    assert_cpu_runs(pid)


def test_zero_timeout_raises_and_leaves_the_v1_cgroup_thawed(sandbox: Sandbox) -> None:
    if sandbox.layout.v1_freezer_root is None:
        pytest.skip(NO_V1_FREEZER)
    ref = sandbox.cgroup("tenant", v2=False)
    pid = busy_child_in(sandbox, ref)

    with pytest.raises(FreezeTimeout):
        Freezer(sandbox.layout, timeout_s=0).freeze(ref)

    assert v1_state(sandbox, ref) == "THAWED"
    assert_cpu_runs(pid)


def test_v2_cannot_confirm_a_freeze_while_v1_holds_the_task(sandbox: Sandbox) -> None:
    """On a hybrid host a v1-frozen task never reaches the v2 freezer: a real timeout."""
    if sandbox.layout.v1_freezer_root is None:
        pytest.skip(NO_V1_FREEZER)
    ref = sandbox.cgroup("tenant")
    busy_child_in(sandbox, ref)
    v2, v1 = sandbox.layout.dirs(ref)
    assert v2 is not None
    assert v1 is not None
    (v1 / "freezer.state").write_text("FROZEN")
    wait_until(lambda: v1_state(sandbox, ref) == "FROZEN", what="v1 FROZEN")

    with pytest.raises(FreezeTimeout):
        Freezer(sandbox.layout, timeout_s=0.2).freeze(ref)

    assert (v2 / "cgroup.freeze").read_text().strip() == "0"  # our v2 freeze undone
    assert v1_state(sandbox, ref) == "FROZEN"  # someone else's v1 freeze left alone


def test_cgroup_of_reads_a_process_cgroups(sandbox: Sandbox) -> None:
    ref = sandbox.cgroup("tenant")
    child = sandbox.spawn()
    sandbox.move(child.pid, ref)
    found = cgroup_of(child.pid)
    assert found.v2 == ref.v2
    # /proc/PID/cgroup names every hierarchy the kernel has, mounted here or not (a
    # pure-cgroup2 container on a hybrid machine still sees a v1 freezer line).
    if sandbox.layout.v1_freezer_root is not None:
        assert found.v1_freezer == ref.v1_freezer
    with pytest.raises(CgroupError, match="cannot read"):
        cgroup_of(2**22 + 1)


def test_isolate_process_freezes_a_bare_process_alone(sandbox: Sandbox) -> None:
    bare = sandbox.spawn(BUSY)
    neighbour = sandbox.spawn(BUSY)  # shares the root cgroup with bare and with us
    before = cgroup_of(bare.pid)

    ref = isolate_process(bare.pid, sandbox.layout, parent=sandbox.parent)

    expected = f"{sandbox.top}/pid-{bare.pid}"
    assert ref.v2 == expected
    assert cgroup_of(bare.pid).v2 == expected
    if sandbox.layout.v1_freezer_root is not None:
        assert cgroup_of(bare.pid).v1_freezer == expected
    assert cgroup_of(neighbour.pid) == before
    freezer = Freezer(sandbox.layout)

    freezer.freeze(ref)

    assert freezer.is_frozen(ref)
    assert_cpu_stopped(bare.pid)
    assert_cpu_runs(neighbour.pid)
    assert cgroup_of("self") != ref  # the test process (kiwid's seat) stayed outside

    freezer.thaw(ref)
    assert_cpu_runs(bare.pid)
    remove_isolation(ref, sandbox.layout)  # still busy: left alone, no error
    kept = [d for d in sandbox.layout.dirs(ref) if d is not None]
    assert kept and all(d.is_dir() for d in kept)

    bare.kill()
    bare.wait(timeout=5)
    wait_until(lambda: not _populated(sandbox, ref), what="the cgroup to empty")
    remove_isolation(ref, sandbox.layout)
    assert not any(d is not None and d.exists() for d in sandbox.layout.dirs(ref))
    remove_isolation(ref, sandbox.layout)  # already gone: fine


def _populated(sandbox: Sandbox, ref: CgroupRef) -> bool:
    return any(
        d is not None and d.exists() and (d / "cgroup.procs").read_text().strip()
        for d in sandbox.layout.dirs(ref)
    )


def test_isolate_process_refuses_itself_and_a_vanished_process(sandbox: Sandbox) -> None:
    with pytest.raises(IsolationError, match="kiwid itself"):
        isolate_process(os.getpid(), sandbox.layout, parent=sandbox.parent)
    child = sandbox.spawn(["true"])
    child.wait(timeout=5)

    with pytest.raises(IsolationError, match="is gone"):
        isolate_process(child.pid, sandbox.layout, parent=sandbox.parent)

    v2, _ = sandbox.layout.dirs(CgroupRef(f"{sandbox.top}/pid-{child.pid}", None))
    assert v2 is not None
    assert not v2.exists()  # nothing left behind


def test_isolate_process_does_without_an_unwritable_v1_freezer(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    """Hybrid systemd-nspawn hosts mount the v1 freezer read-only; cgroup2 still freezes."""
    if sandbox.layout.v2_root is None:
        pytest.skip("no cgroup2 hierarchy")
    not_a_hierarchy = tmp_path / "file"
    not_a_hierarchy.write_text("")  # mkdir below a file fails, as on a read-only mount
    layout = CgroupLayout(v2_root=sandbox.layout.v2_root, v1_freezer_root=not_a_hierarchy)
    bare = sandbox.spawn(BUSY)

    ref = isolate_process(bare.pid, layout, parent=sandbox.parent)

    assert ref == CgroupRef(v2=f"{sandbox.top}/pid-{bare.pid}", v1_freezer=None)
    freezer = Freezer(layout)
    freezer.freeze(ref)
    assert freezer.is_frozen(ref)
    assert_cpu_stopped(bare.pid)
    freezer.thaw(ref)
    bare.kill()
    bare.wait(timeout=5)
    wait_until(lambda: not _populated(sandbox, ref), what="the cgroup to empty")
    remove_isolation(ref, layout)


def test_populated_says_whether_a_cgroup_or_one_below_it_holds_a_process(
    sandbox: Sandbox,
) -> None:
    ref, below = sandbox.cgroup("c"), sandbox.cgroup("c/inner")
    only_v1 = CgroupRef(None, ref.v1_freezer)
    assert not populated(sandbox.layout, ref)
    child = sandbox.spawn()
    sandbox.move(child.pid, below)
    assert populated(sandbox.layout, ref)  # a process in a cgroup below counts
    if only_v1.v1_freezer is not None:
        assert populated(sandbox.layout, only_v1)
    child.kill()
    child.wait()
    wait_until(lambda: not populated(sandbox.layout, ref), what="the cgroup to empty")
    if only_v1.v1_freezer is not None:
        assert not populated(sandbox.layout, only_v1)
    gone = CgroupRef(f"{sandbox.top}/never-made", None)
    assert not populated(sandbox.layout, gone)
