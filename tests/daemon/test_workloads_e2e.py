"""Remembered workloads through the real socket: kiwictl workloads and forget."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import Kiwid, config_text, wait_for
from tests.daemon.test_faults import as_uid

GiB = 2**30
DAY_S = 86400


def remembered(workdir: Path, marked_unix: float) -> None:
    """What earlier runs left in the state directory's workloads.json."""
    state = workdir / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    doc = {
        "version": 1,
        "workloads": {
            "unit train.service": {"peak_bytes": 47 * GiB, "seen_unix": marked_unix},
            "exe /usr/bin/python3 ipc.py": {
                "peak_bytes": 3 * GiB,
                "seen_unix": marked_unix,
                "checkpoint_failed": "CUDA_ERROR_NOT_SUPPORTED",
                "checkpoint_failed_unix": marked_unix,
            },
        },
    }
    (state / "workloads.json").write_text(json.dumps(doc))


def saved(workdir: Path) -> dict[str, dict[str, object]]:
    return json.loads((workdir / "state" / "workloads.json").read_text())["workloads"]


@pytest.fixture
def k(start_kiwid, workdir: Path) -> Kiwid:
    marked = time.time() - 3600  # an hour ago
    remembered(workdir, marked)
    text = config_text(workdir).replace("[kubernetes]", "[memory]\n[kubernetes]")
    (workdir / "kiwi.toml").write_text(text)
    kiwid = start_kiwid()
    kiwid.extra["marked"] = marked
    return kiwid


def test_kiwictl_workloads_lists_footprints_and_unswappable_marks(k: Kiwid) -> None:
    out = k.ctl("workloads", "--json")
    assert out.returncode == 0, out.stderr
    listed = {w["workload"]: w for w in json.loads(out.stdout)["workloads"]}
    train, ipc = listed["unit train.service"], listed["exe /usr/bin/python3 ipc.py"]
    assert (train["peak_bytes"], train["unswappable"], train["why"]) == (47 * GiB, False, None)
    assert train["seen_unix"] == pytest.approx(k.extra["marked"], abs=0.01)
    assert (ipc["unswappable"], ipc["why"]) == (True, "CUDA_ERROR_NOT_SUPPORTED")
    assert ipc["until_unix"] == pytest.approx(k.extra["marked"] + DAY_S, abs=0.01)
    text = k.ctl("workloads")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    (train_line,) = [line for line in lines if line.startswith("unit train.service")]
    assert "47.0 GiB" in train_line and "1 h ago" in train_line
    (ipc_line,) = [line for line in lines if line.startswith("exe /usr/bin/python3 ipc.py")]
    assert "unswappable for 23 h more: CUDA_ERROR_NOT_SUPPORTED" in ipc_line


def test_the_retry_delay_is_reloadable(k: Kiwid) -> None:
    k.write_config(
        k.config.read_text().replace("[memory]\n", "[memory]\ncheckpoint_retry_after = 7200\n")
    )

    def until() -> float:
        (ipc,) = [w for w in k.call("workloads")["workloads"] if w["unswappable"]]
        return float(ipc["until_unix"])

    wait_for(lambda: until() == pytest.approx(k.extra["marked"] + 7200, abs=0.01), 5, "reload")
    k.write_config(
        k.config.read_text().replace("checkpoint_retry_after = 7200", "checkpoint_retry_after = 60")
    )
    wait_for(
        lambda: not any(w["unswappable"] for w in k.call("workloads")["workloads"]),
        5,
        "the mark to have expired at 60 s",
    )


def test_kiwictl_forget_clears_one_workload_and_saves_at_once(k: Kiwid, workdir: Path) -> None:
    out = k.ctl("forget", "exe /usr/bin/python3 ipc.py")
    assert out.returncode == 0, out.stderr
    assert "Forgot workload 'exe /usr/bin/python3 ipc.py'" in out.stdout
    assert set(saved(workdir)) == {"unit train.service"}  # on disk already
    listed = [w["workload"] for w in k.call("workloads")["workloads"]]
    assert listed == ["unit train.service"]
    k.wait_log("Forgot workload exe /usr/bin/python3 ipc.py (uid 0)")
    unknown = k.ctl("forget", "unit nothing.service")
    assert unknown.returncode == 1
    assert unknown.stderr == (
        "[ERROR] no remembered workload 'unit nothing.service' (kiwictl workloads lists them)\n"
    )
    assert set(saved(workdir)) == {"unit train.service"}


def test_only_an_admin_may_forget_and_everyone_may_list(k: Kiwid, workdir: Path) -> None:
    request = {
        "v": 1,
        "id": 1,
        "cmd": "forget-workload",
        "args": {"workload": "unit train.service"},
    }
    answer = as_uid(65534, 65534, k.socket, request)
    assert answer["ok"] is False and answer["error"]["code"] == "forbidden", answer
    assert "unit train.service" in saved(workdir)
    listing = as_uid(65534, 65534, k.socket, {"v": 1, "id": 2, "cmd": "workloads"})
    assert listing["ok"] is True, listing
    assert len(listing["result"]["workloads"]) == 2
