"""``kiwictl explain``: the lookup and the plain-words answer, from canned status objects."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from kiwid.cli.explain import (
    AmbiguousTenant,
    TenantNotFound,
    analyse,
    explain_text,
    find_tenant,
    format_bytes,
    format_duration,
    ledger_text,
    waiter_eta,
)
from kiwid.cli.kiwictl import main
from kiwid.cli.status_text import format_status
from tests.adapters.test_control import FakeDaemon, ServerThread, serve, sock_dir

__all__ = ["serve", "sock_dir"]  # fixtures shared with the control socket tests

HOLDER_CID = "ab12cd34ef56" + "0" * 52
WAITER_CID = "3f2a1b4c5d6e" + "1" * 52


def ledger(**kw: Any) -> dict[str, Any]:
    return {
        "holding_s": 310.0,
        "waiting_s": 242.0,
        "idle_s": 0.0,
        "corunning_s": 0.0,
        "quanta": 11,
        "preempted": 3,
        "early_releases": 2,
        "swapped_out_bytes": 0,
        "swapped_in_bytes": 0,
        "swap_s": 0.0,
        **kw,
    }


def tenant(tid: str, state: str, pids: list[int], **kw: Any) -> dict[str, Any]:
    return {
        "id": tid,
        "name": tid.split(":", 1)[1],
        "kind": tid.split(":", 1)[0],
        "container_id": None,
        "pod": None,
        "namespace": None,
        "state": state,
        "pids": pids,
        "gpus": ["0"],
        "footprint_bytes": 2**30,
        "gate_failure": None,
        "ledger": ledger(),
        **kw,
    }


STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "pid": 1,
    "scheduling": "on",
    "uptime_s": 3725.0,
    "gpus": [
        {
            "id": "0",
            "healthy": True,
            "tq": 30.0,
            "idle_release": 5.0,
            "mode": "exclusive",
            "holder": {"tenant": "docker:ab12cd34ef56", "since_s": 12.3, "remaining_s": 17.7},
            "waiters": [
                {"tenant": "pid:777", "waiting_s": 20.0, "position": 1, "eta_s": 17.7},
                {"tenant": "podman:3f2a1b4c5d6e", "waiting_s": 12.3, "position": 2, "eta_s": 47.7},
            ],
            "tenants": [
                tenant("docker:ab12cd34ef56", "holder", [100], container_id=HOLDER_CID),
                tenant("pid:777", "waiting", [777]),
                tenant(
                    "podman:3f2a1b4c5d6e",
                    "waiting",
                    [200, 201],
                    container_id=WAITER_CID,
                    pod="web-7f",
                    namespace="shop",
                    ledger=ledger(swapped_out_bytes=3 * 2**30, swapped_in_bytes=2**30, swap_s=4),
                ),
                tenant("pid:300", "idle", [300]),
                tenant("cgroup:/kiwi-test/abcd", "idle", [400], pod="web-7f", namespace="shop"),
            ],
        }
    ],
    "departed": [
        {
            "id": "pid:555",
            "name": "pid 555",
            "kind": "process",
            "pod": None,
            "namespace": None,
            "gpus": ["0"],
            "ledger": ledger(quanta=1),
            "gone_for_s": 42.0,
        }
    ],
}


def explain(query: str, status: dict[str, Any] | None = None) -> str:
    status = status or STATUS
    return explain_text(analyse(status, find_tenant(status, query)))


def test_a_waiting_tenant_hears_who_holds_who_is_ahead_the_eta_and_its_ledger() -> None:
    text = explain("podman:3f2a1b4c5d6e")
    assert text.startswith(
        "podman:3f2a1b4c5d6e (pod shop/web-7f) is WAITING for GPU 0 since 12.3 s: "
        "the GPU is held by docker:ab12cd34ef56 whose quantum ends in 17.7 s; "
        "1 tenant is ahead of it (pid:777). Estimated turn in 47.7 s."
    )
    assert (
        "Ledger (since kiwid started 1h02m ago): held 5m10s in 11 quanta "
        "(3 preempted, 2 early releases), waited 4m02s; "
        "swapped 3.0 GiB out and 1.0 GiB in, taking 4.0 s."
    ) in text


def test_first_in_line_and_an_older_daemon_without_eta_is_estimated() -> None:
    assert "it is next in line. Estimated turn in 17.7 s." in explain("777")
    old = copy.deepcopy(STATUS)
    for w in old["gpus"][0]["waiters"]:
        del w["eta_s"]
    for t in old["gpus"][0]["tenants"]:
        del t["ledger"]
    del old["uptime_s"]
    text = explain("podman:3f2a1b4c5d6e", old)
    assert text.endswith("Estimated turn in about 47.7 s.")  # 17.7 + one TQ of 30
    assert "Ledger" not in text


def test_the_holder_idle_corunning_and_gone_cases() -> None:
    assert explain("docker:ab12cd34ef56").startswith(
        "docker:ab12cd34ef56 HOLDS GPU 0 (for 12.3 s now); 2 tenants wait "
        "(pid:777, podman:3f2a1b4c5d6e), so its quantum ends in 17.7 s, "
        "then it goes to the back of the queue."
    )
    idle = explain("300")
    assert idle.startswith("pid:300 is IDLE on GPU 0: it has had no GPU work for at least 5.0 s")
    assert "it is queued (holder docker:ab12cd34ef56, 2 tenants waiting): turn in about" in idle
    assert "1m17s" in idle  # the last waiter's ETA plus one TQ
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu.update(holder=None, waiters=[], mode="auto")
    assert "At its next GPU work it gets the GPU at once (it is free)." in explain("300", status)
    gpu["tenants"][1]["state"] = "corunning"
    assert "RUNS UN-GATED on GPU 0" in explain("777", status)
    assert "in auto mode the busy tenants' memory fits" in explain("777", status)
    status["scheduling"] = "off"
    assert "the scheduler is off (kiwictl -S off)" in explain("777", status)
    gone = explain("555")
    assert gone.startswith("pid:555 is GONE: it left 42.0 s ago")
    assert "in 1 quantum " in gone


def test_a_lone_holder_keeps_the_gpu_and_gate_failures_are_told() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu["waiters"] = []
    gpu["holder"]["remaining_s"] = None
    gpu["tenants"][0]["gate_failure"] = "cgroup.freeze: permission denied"
    text = explain("docker:ab12cd34ef56", status)
    assert "nobody waits, so it keeps it until it has no GPU work for 5.0 s." in text
    assert "kiwid could not gate it (cgroup.freeze: permission denied)" in text


def test_lookup_by_pid_container_prefix_pod_and_name() -> None:
    assert find_tenant(STATUS, "201")["id"] == "podman:3f2a1b4c5d6e"
    assert find_tenant(STATUS, "3f2a")["id"] == "podman:3f2a1b4c5d6e"
    assert find_tenant(STATUS, WAITER_CID)["id"] == "podman:3f2a1b4c5d6e"
    assert find_tenant(STATUS, "podman:3f2a1")["id"] == "podman:3f2a1b4c5d6e"
    assert find_tenant(STATUS, "ab12cd34ef56")["id"] == "docker:ab12cd34ef56"  # the name
    assert find_tenant(STATUS, "pid:555")["departed"] is True


def test_ambiguous_and_not_found() -> None:
    with pytest.raises(AmbiguousTenant) as info:
        find_tenant(STATUS, "shop/web-7f")  # two containers of one pod
    assert {t["id"] for t in info.value.candidates} == {
        "podman:3f2a1b4c5d6e",
        "cgroup:/kiwi-test/abcd",
    }
    with pytest.raises(TenantNotFound):
        find_tenant(STATUS, "3f2")  # too short a prefix
    with pytest.raises(TenantNotFound):
        find_tenant(STATUS, "424242")


def test_the_json_facts() -> None:
    facts = analyse(STATUS, find_tenant(STATUS, "200"))
    (gpu,) = facts["gpus"]
    assert facts["tenant"]["id"] == "podman:3f2a1b4c5d6e"
    assert (gpu["position"], gpu["ahead"], gpu["eta_s"]) == (2, ["pid:777"], 47.7)
    assert gpu["holder"]["tenant"] == "docker:ab12cd34ef56"
    assert facts["ledger"]["quanta"] == 11
    json.dumps(facts)  # serialisable as is


def test_helpers() -> None:
    assert [format_duration(s) for s in (None, 0.04, 59.94, 310, 7385)] == [
        "?",
        "0.0 s",
        "59.9 s",
        "5m10s",
        "2h03m",
    ]
    assert [format_bytes(n) for n in (None, 512, 1536, 3 * 2**30, 2**41)] == [
        "?",
        "512 B",
        "1.5 KiB",
        "3.0 GiB",
        "2.0 TiB",
    ]
    assert ledger_text(None) == ""
    assert ", ran un-gated 1m00s, idle 10.0 s." in ledger_text(ledger(corunning_s=60, idle_s=10))
    gpu = {"tq": 10.0, "holder": None}
    assert waiter_eta(gpu, {"position": 3}) == (20.0, True)


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def kiwictl(serve: Callable[..., ServerThread], capsys: pytest.CaptureFixture[str]) -> Run:
    server = serve(FakeDaemon(STATUS))

    def run(*argv: str) -> tuple[int, str, str]:
        rc = main(["--socket", str(server.path), *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_kiwictl_explain_exit_codes_and_messages(kiwictl: Run) -> None:
    rc, out, err = kiwictl("explain", "3f2a")
    assert (rc, err) == (0, "")
    assert "is WAITING for GPU 0" in out
    rc, out, _ = kiwictl("explain", "201", "--json")
    assert rc == 0
    assert json.loads(out)["explanation"].startswith("podman:3f2a1b4c5d6e (pod shop/web-7f)")
    rc, out, err = kiwictl("explain", "web-7f")
    assert (rc, out) == (1, "")
    assert "'web-7f' matches several tenants; say which:" in err
    assert "  cgroup:/kiwi-test/abcd (pod shop/web-7f)  idle  pids 400" in err
    rc, out, err = kiwictl("explain", "nope")
    assert (rc, out) == (1, "")
    assert "no tenant matches 'nope'" in err
    assert "kiwictl tenants" in err
    assert kiwictl("explain")[0] == 2


def test_kiwictl_explain_without_a_daemon_exits_3(tmp_path) -> None:
    assert main(["--socket", str(tmp_path / "none.sock"), "explain", "1"]) == 3


def test_memory_moves_are_told_in_words() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu["handover_waits_for"] = "pid:777"
    gpu["holder"]["remaining_s"] = 0.0
    text = explain("docker:ab12cd34ef56", status)
    assert (
        "its quantum is over, but it keeps the GPU while the memory of pid:777, next in "
        "line, comes back from host RAM (at most one more TQ)"
    ) in text
    gpu["handover_waits_for"] = None
    gpu["holder"]["remaining_s"] = None  # the waiters are of a lower priority
    text = explain("docker:ab12cd34ef56", status)
    assert "2 tenants of a lower priority wait (pid:777, podman:3f2a1b4c5d6e)" in text
    assert "nobody waits" not in text
    tenants = gpu["tenants"]
    tenants[0].update(state="holder", waiting_for="waiting for free memory on GPU 0: 3.0 GiB")
    assert "It is not let go yet: waiting for free memory on GPU 0: 3.0 GiB." in explain(
        "docker:ab12cd34ef56", status
    )
    tenants[1].update(
        swap_refusal="it uses NCCL between processes",
        workload="exe /usr/bin/python3 train.py",
        remembered_bytes=47 * 2**30,
    )
    text = explain("777", status)
    assert "Its memory stays on the card: it uses NCCL between processes." in text
    assert (
        "Its workload ran here before (exe /usr/bin/python3 train.py): it is sized from "
        "that run's 47.0 GiB, not given the whole card as a newcomer."
    ) in text


def test_a_hand_over_is_told_in_a_sentence_to_both_tenants() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    since = 1_700_000_000.0
    gpu["handover"] = {
        "to": "docker:ab12cd34ef56",
        "from": "pid:777",
        "since_unix": since,
        "seconds": 3.25,
        "phase": "restoring",
    }
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    told = (
        f"GPU 0 is being handed over from pid:777 to docker:ab12cd34ef56 since {clock} "
        "(3.2 s): restoring: docker:ab12cd34ef56's memory is coming back from host RAM."
    )
    assert told in explain("docker:ab12cd34ef56", status)
    assert told in explain("777", status)  # the one it is from
    assert "handed over" not in explain("podman:3f2a1b4c5d6e", status)  # a bystander
    gpu["handover"].update(phase="gating the holder")
    assert "gating the holder: pid:777, the holder before, is being gated (it may still run)" in (
        explain("777", status)
    )
    assert "  handover pid:777 -> docker:ab12cd34ef56, gating the holder, 3.2 s" in (
        format_status(status)
    )
