"""Containers announced by kiwi-hook: names, admission hold, unregister."""

from __future__ import annotations

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


def test_the_daemon_handles_exactly_the_protocols_commands() -> None:
    from kiwid.adapters.control import COMMANDS  # noqa: PLC0415
    from kiwid.daemon.control.commands import HANDLERS  # noqa: PLC0415

    assert set(HANDLERS) == set(COMMANDS)
