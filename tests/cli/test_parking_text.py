"""What kiwictl status, top and explain say of a parked tenant, from canned status objects."""

from __future__ import annotations

import copy
import time
from typing import Any

from kiwid.cli.status_text import format_status
from tests.cli.test_explain import STATUS, explain
from tests.cli.test_top import frame

PARKED_SINCE = 1_700_000_000.0
CLOCK = time.strftime("%H:%M:%S", time.localtime(PARKED_SINCE))


def parked_status(**kw: Any) -> dict[str, Any]:
    status = copy.deepcopy(STATUS)
    server = status["gpus"][0]["tenants"][3]  # pid:300, idle in STATUS
    parked = {"state": "parked", "parked_since": PARKED_SINCE, "wakes_on": ["tcp 0.0.0.0:8000"]}
    server.update({"footprint_bytes": 3 * 2**30, **parked, **kw})
    return status


def test_explain_says_since_when_how_much_and_what_wakes_it() -> None:
    text = explain("pid:300", parked_status())
    assert (
        f"pid:300 is PARKED since {CLOCK}: idle, its 3 GiB in host RAM; wakes on a "
        "connection to tcp 0.0.0.0:8000 or on `kiwictl wake`."
    ) in text
    assert "It holds no turns and costs no swaps meanwhile" in text


def test_a_parked_tenant_without_sockets_wakes_only_on_kiwictl_wake() -> None:
    text = explain("pid:300", parked_status(wakes_on=[]))
    assert "wakes on `kiwictl wake` (it listens on no socket kiwid can watch)" in text


def test_its_last_wake_is_told() -> None:
    woken = {"ago_s": 42.0, "reason": "request", "detail": "tcp 0.0.0.0:8000: 1 waits"}
    text = explain("pid:300", parked_status(state="waiting", last_wake=woken))
    assert "Last woken 42 s ago by a request (tcp 0.0.0.0:8000: 1 waits)." in text


def test_status_and_top_name_it_parked() -> None:
    status = parked_status()
    clause = (
        f"since {CLOCK}: idle, its 3 GiB in host RAM; wakes on a connection to tcp 0.0.0.0:8000"
    )
    assert f"pid:300 (300): parked, pids 300, 3.0 GiB; parked {clause}" in format_status(status)
    assert f"  parked   pid:300: {clause}" in frame(status)
