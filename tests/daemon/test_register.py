"""Containers announced by kiwi-hook: names, admission hold, unregister."""

from __future__ import annotations

import subprocess
import time

import pytest

from kiwid.adapters.control import ControlError
from tests.daemon.conftest import V2_ROOT, wait_for


def cgroup_of(t) -> str:
    return "/" + str(t.v2.relative_to(V2_ROOT))


def test_a_container_registered_while_the_gpu_is_busy_starts_frozen(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, poll=0.05)
    busy = tenants("busy")
    k.attach(busy.pid)
    wait_for(lambda: k.tenant_states().get(busy.key) == "holder", 5, "busy to hold the GPU")
    newcomer = tenants("newcomer", busy=False)
    answer = k.call(
        "register",
        {
            "id": "c0ffee" * 10 + "abcd",
            "cgroup_v2": cgroup_of(newcomer),
            "cgroup_v1_freezer": None,
            "pid": newcomer.pid,
            "name": "trainer",
            "pod": "train-7f9",
            "namespace": "ml",
            "gpus": ["0"],
            "hold": True,
        },
    )
    assert answer == {"tenant": newcomer.key, "held": True}
    assert newcomer.frozen()
    entry = next(t for t in k.call("tenants")["tenants"] if t["id"] == newcomer.key)
    assert (entry["name"], entry["pod"], entry["namespace"]) == ("trainer", "train-7f9", "ml")
    assert entry["state"] == "waiting"
    assert k.call("unregister", {"id": "c0ffee" * 10 + "abcd"}) == {"removed": True}
    wait_for(lambda: not newcomer.frozen(), 5, "the unregistered container to be thawed")
    wait_for(lambda: newcomer.key not in k.tenant_states(), 5, "it to be forgotten")


def test_a_container_registered_on_a_free_gpu_starts_at_once(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, poll=0.05)
    c = tenants("c", busy=False)
    answer = k.call("register", {"id": "c1", "cgroup_v2": cgroup_of(c), "pid": c.pid, "hold": True})
    assert answer["held"] is False
    assert not c.frozen()
    assert k.call("unregister", {"id": "c1"}) == {"removed": True}
    assert k.call("unregister", {"id": "c1"}) == {"removed": False}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({}, "a process id is needed"),
        ({"cgroup_v2": "/a/b", "pid": "PID"}, "is not the cgroup of pid"),
        ({"cgroup_v2": "CGROUP", "pid": "PID", "gpus": ["9"]}, "no GPU '9'"),
    ],
)
def test_bad_registrations_are_refused_and_change_nothing(
    start_kiwid, tenants, args, words
) -> None:
    k = start_kiwid()
    c = tenants("c", busy=False)
    given = {"CGROUP": cgroup_of(c), "PID": c.pid}
    args = {
        "id": "x",
        **{key: given.get(v, v) if isinstance(v, str) else v for key, v in args.items()},
    }
    with pytest.raises(ControlError, match=words) as info:
        k.call("register", args)
    assert info.value.code == "invalid-value"
    assert not c.frozen()
    assert k.tenant_states() == {}


def test_a_container_whose_poststop_was_missed_expires_by_itself(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, poll=0.05)
    c, other = tenants("c", busy=False), tenants("other", busy=False)
    for cid, t in (("gone", c), ("stays", other)):
        args = {"id": cid, "cgroup_v2": cgroup_of(t), "pid": t.pid, "hold": False}
        k.call("register", args)
    wait_for(lambda: {c.key, other.key} <= set(k.tenant_states()), 5, "both to be registered")
    c.proc.kill()  # the container stops, and the runtime never runs kiwi-hook poststop
    c.proc.wait()
    wait_for(lambda: c.key not in k.tenant_states(), 5, "the dead container to expire")
    out = k.ctl("tenants")
    assert out.returncode == 0, out.stderr
    assert c.key not in out.stdout and other.key in out.stdout
    expired = [line for line in k.log_text().splitlines() if "poststop" in line]
    assert len(expired) == 1, expired
    assert c.key in expired[0] and "gone" in expired[0]
    assert k.call("unregister", {"id": "gone"}) == {"removed": False}  # forgotten already
    assert k.call("unregister", {"id": "stays"}) == {"removed": True}


def test_a_container_lives_on_while_its_cgroup_holds_a_process(start_kiwid, tenants) -> None:
    k = start_kiwid(tq=30, poll=0.05)
    c = tenants("c", busy=False)
    k.call("register", {"id": "c", "cgroup_v2": cgroup_of(c), "pid": c.pid, "hold": False})
    wait_for(lambda: c.key in k.tenant_states(), 5, "c to be registered")
    # A second process in the container's cgroup outlives the one that was registered.
    child = subprocess.Popen(["sleep", "3600"])
    try:
        (c.v2 / "cgroup.procs").write_text(str(child.pid))
        c.proc.kill()
        c.proc.wait()
        for _ in range(20):  # 20 polls or more: it stays all along
            assert c.key in k.tenant_states()
            time.sleep(0.05)  # what is checked is that nothing happens meanwhile
        child.kill()
        child.wait()
        wait_for(lambda: c.key not in k.tenant_states(), 5, "the emptied container to expire")
    finally:
        child.kill()
        child.wait()


def test_the_daemon_handles_exactly_the_protocols_commands() -> None:
    from kiwid.adapters.control import COMMANDS  # noqa: PLC0415
    from kiwid.daemon.control.commands import HANDLERS  # noqa: PLC0415

    assert set(HANDLERS) == set(COMMANDS)
