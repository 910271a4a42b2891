"""Stuck and released tenants in kiwictl: retry, release, explain and status, from canned answers.

``kiwictl retry`` and ``release`` run against a real control server whose handler
answers as kiwid does (docs/control-protocol.md); explain and status read a status
object written by hand.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest

from kiwid.adapters.control import ControlError, Peer
from kiwid.cli.explain import analyse, explain_text, find_tenant
from kiwid.cli.fault_text import at_text
from kiwid.cli.kiwictl import main
from kiwid.cli.status_text import format_status
from tests.adapters.test_control import ServerThread, serve, sock_dir
from tests.cli.test_explain import STATUS

__all__ = ["serve", "sock_dir"]  # fixtures shared with the control socket tests

AT = time.time() - 60
FAULT = {
    "operation": "swap-in",
    "reason": "swap in: restore of pid 777 failed: CUDA_ERROR_OPERATING_SYSTEM (304)",
    "pid": 777,
    "answer": "CUDA_ERROR_OPERATING_SYSTEM (304)",
    "at_unix": AT,
    "contained": True,
    "mending": False,
}


def stuck_status(**fault: Any) -> dict[str, Any]:
    """STATUS with pid:777 stuck (and not waiting any more)."""
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu["waiters"] = [w for w in gpu["waiters"] if w["tenant"] != "pid:777"]
    gpu["waiters"][0]["position"] = 1
    gpu["stuck"] = ["pid:777"]
    gpu["held_back"] = [{"tenant": "pid:777", "waiting_for": "stuck (swap-in): ..."}]
    for t in gpu["tenants"]:
        if t["id"] == "pid:777":
            t.update(state="stuck", stuck_reason={**FAULT, **fault}, released=None)
    return status


def explain(query: str, status: dict[str, Any]) -> str:
    return explain_text(analyse(status, find_tenant(status, query)))


def test_a_stuck_tenant_is_explained_with_what_failed_when_and_what_to_do() -> None:
    text = explain("777", stuck_status())
    assert text.startswith(
        f"pid:777 is STUCK: its restore of pid 777 failed with CUDA_ERROR_OPERATING_SYSTEM "
        f"(304) at {at_text(AT)}; it stays gated and holds nothing while the others rotate. "
        "`kiwictl retry pid:777` tries again; `kiwictl release pid:777` lets it run ungated."
    ), text
    assert "WAITING" not in text and "is STUCK on GPU" not in text
    loose = explain("777", stuck_status(contained=False, mending=True, answer=None))
    assert f"its restore of pid 777 failed at {at_text(AT)}: swap in: restore" in loose
    assert "kiwid could not gate it, so it may still run and nobody else is let go" in loose
    assert loose.endswith("A retry or release of it is under way. " + loose.split(". ")[-1])


def test_a_released_tenant_and_a_waiter_held_up_by_a_stuck_one_are_explained() -> None:
    status = stuck_status(contained=False)
    gpu = status["gpus"][0]
    gpu["blocked_by"] = "pid:777"
    text = explain("podman:3f2a1b4c5d6e", status)
    assert (
        "Nobody is let go on GPU 0 while pid:777 may run there: it is stuck and kiwid could "
        "not gate it (its gate is tried again every TQ; `kiwictl release pid:777` lets it "
        "run outside the rotation)."
    ) in text
    for t in gpu["tenants"]:
        if t["id"] == "pid:777":
            t.update(state="released", stuck_reason=None, released="restored, unlocked and thawed")
    gpu["stuck"], gpu["blocked_by"] = [], None
    text = explain("777", status)
    assert text.startswith(
        "pid:777 is RELEASED: an operator let it run ungated (restored, unlocked and thawed). "
        "It runs outside the rotation, holds nothing and keeps nobody waiting, until it "
        "leaves or `kiwictl retry pid:777` brings it back."
    ), text


def test_status_shows_the_stuck_the_blocker_the_held_back_and_unbounded_waits() -> None:
    status = stuck_status()
    gpu = status["gpus"][0]
    gpu["blocked_by"] = "pid:777"
    gpu["held_back"].append({"tenant": "pid:300", "waiting_for": "its memory is not back"})
    gpu["waiters"][0].update(wait_bound_s=None, wait_bound_reason="pid:777 is stuck")
    status["state_file"] = {
        "path": "/run/kiwi/state/state.json",
        "unusable_records": {"pid:9": "pid 9: not an integer"},
        "trouble": None,
    }
    text = format_status(status)
    assert (
        f"  stuck    pid:777: its restore of pid 777 failed with CUDA_ERROR_OPERATING_SYSTEM "
        f"(304) at {at_text(AT)} (kiwictl retry pid:777, or kiwictl release pid:777)"
    ) in text
    assert "  blocked  by pid:777: stuck and not gated, it may run" in text
    assert "  held     pid:300, gated: its memory is not back" in text
    assert "held     pid:777" not in text, "the stuck are listed once"
    assert "podman:3f2a1b4c5d6e waiting 12.3 s (no wait bound: pid:777 is stuck)" in text
    assert "state    record pid:9 kept for you, unusable: pid 9: not an integer" in text
    status["state_file"]["trouble"] = "state.json: not JSON; set aside as state.json.unusable-1"
    assert "UNUSABLE at start: state.json: not JSON" in format_status(status)


class Operator:
    """Answers status, retry and release as kiwid would, from ``outcomes``."""

    def __init__(self, status: dict[str, Any], outcomes: dict[str, dict[str, Any]]) -> None:
        self.status = status
        self.outcomes = outcomes
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, cmd: str, args: dict[str, Any], peer: Peer) -> dict[str, Any]:
        self.calls.append((cmd, args))
        if cmd == "status":
            return self.status
        answer = self.outcomes.get(cmd)
        if answer is None:
            raise ControlError("invalid-value", f"{args['tenant']} is waiting, not stuck: ...")
        return {"tenant": args["tenant"], "asked": cmd, "pending": False, **answer}


Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def kiwictl(serve: Callable[..., ServerThread], capsys: pytest.CaptureFixture[str]) -> Run:
    def run(outcomes: dict[str, dict[str, Any]], *argv: str) -> tuple[int, str, str]:
        server = serve(Operator(stuck_status(), outcomes))
        rc = main(["--socket", str(server.path), *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


MENDED = {"state": "waiting", "residency": "host", "stuck_reason": None, "released": None}
STILL = {"state": "stuck", "residency": "host", "stuck_reason": FAULT, "released": None}


@pytest.mark.parametrize(
    ("argv", "outcomes", "expected"),
    [
        (
            ("retry", "777"),
            {"retry": MENDED},
            (0, "[INFO] pid:777: mended; it waits for its turn, its memory in host RAM.\n", ""),
        ),
        (
            ("retry", "777"),
            {"retry": {**MENDED, "state": "holder", "residency": "resident"}},
            (0, "[INFO] pid:777: mended; it is holder now, its memory on the card.\n", ""),
        ),
        (
            ("retry", "777"),
            {"retry": {**MENDED, "state": "idle", "residency": "resident"}},
            (0, "[INFO] pid:777: back in the rotation; it queues at its next GPU work.\n", ""),
        ),
        (
            ("release", "pid:777"),
            {"release": {**MENDED, "state": "released", "released": "restored, unlocked"}},
            (
                0,
                "[INFO] pid:777: released (restored, unlocked); it runs ungated, outside the "
                "rotation, until it leaves or `kiwictl retry pid:777`.\n",
                "",
            ),
        ),
        (
            ("retry", "777"),
            {"retry": STILL},
            (
                1,
                "",
                "[ERROR] pid:777 is still stuck: its restore of pid 777 failed with "
                f"CUDA_ERROR_OPERATING_SYSTEM (304) at {at_text(AT)}.\n"
                "[ERROR] `kiwictl explain pid:777` says more; `kiwictl release pid:777` is the "
                "other way.\n",
            ),
        ),
        (
            ("release", "777"),
            {"release": {**STILL, "pending": True, "seconds": 25.2}},
            (
                1,
                "",
                "[WARNING] pid:777: the release is still under way after 25 s; kiwictl status "
                "shows how it ends.\n",
            ),
        ),
        (
            ("retry", "3f2a"),
            {},
            (1, "", "[ERROR] podman:3f2a1b4c5d6e is waiting, not stuck: ...\n"),
        ),
        (
            ("retry", "nope"),
            {},
            (
                1,
                "",
                "[ERROR] no tenant matches 'nope' (by id, container id, name, pod or PID); "
                "see kiwictl tenants\n",
            ),
        ),
        (
            ("release", "web-7f"),
            {},
            (1, "", "[ERROR] 'web-7f' matches 2 tenants; say which (see kiwictl tenants)\n"),
        ),
    ],
)
def test_retry_and_release_say_what_happened(
    kiwictl: Run, argv: tuple[str, ...], outcomes: dict[str, Any], expected: tuple[int, str, str]
) -> None:
    assert kiwictl(outcomes, *argv) == expected


def test_retry_and_release_are_explained_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "kiwictl retry 4f2a" in out and "kiwictl release 4f2a" in out
    assert "A tenant is stuck when" in out
    assert main(["retry", "--help"]) == 0
    assert "gates it whole" in capsys.readouterr().out
    assert main(["release"]) == 2
