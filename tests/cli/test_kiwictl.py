"""kiwictl against a real control server, in process and as installed commands."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiwid.cli.kiwictl import (
    build_parser,
    format_number,
    format_status,
    format_tenants,
    main,
    parse_tq,
)
from tests.adapters.test_control import (
    NOBODY,
    FakeDaemon,
    ServerThread,
    needs_root,
    nobody_python,
    serve,
    sock_dir,
)
from tests.readable import kiwid_copy

__all__ = ["serve", "sock_dir"]  # fixtures shared with the control socket tests

STATUS: dict[str, Any] = {
    "version": "0.1.0",
    "pid": 123,
    "config": {
        "path": "/etc/kiwi.toml",
        "loaded_at_unix": 1.0,
        "last_reload": {"ok": True, "at_unix": 1.0, "error": None},
    },
    "scheduling": "on",
    "gpus": [
        {
            "id": "0",
            "index": 0,
            "uuid": "GPU-5a1c",
            "name": "NVIDIA H200",
            "memory_total_bytes": 85899345920,
            "healthy": True,
            "tq": 20.0,
            "tq_configured": 30.0,
            "idle_release": 5.0,
            "mode": "exclusive",
            "mode_configured": "exclusive",
            "contended": True,
            "holder": {"tenant": "pid:123", "since_s": 3.2, "remaining_s": 16.8},
            "waiters": [{"tenant": "pid:456", "waiting_s": 3.1, "position": 1}],
            "tenants": [
                {
                    "id": "pid:123",
                    "name": "pid 123",
                    "state": "holder",
                    "pids": [123],
                    "footprint_bytes": 1000,
                    "gpus": ["0"],
                },
                {
                    "id": "pid:456",
                    "name": "pid 456",
                    "state": "waiting",
                    "pids": [456],
                    "footprint_bytes": 3 * 2**30,
                    "gpus": ["0"],
                },
            ],
        }
    ],
}

INFO_20 = "[INFO] Successfully set the scheduler TQ to 20 seconds.\n"
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon(STATUS)


@pytest.fixture
def server(serve: Callable[..., ServerThread], daemon: FakeDaemon) -> ServerThread:
    return serve(daemon)


@pytest.fixture
def kiwictl(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> Run:
    """Run ``main`` against a live server; returns (exit status, stdout, stderr)."""

    def run(*argv: str, socket: Path | None = server.path) -> tuple[int, str, str]:
        rc = main([*(["--socket", str(socket)] if socket else []), *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_set_tq_prints_the_exact_line(kiwictl: Run, daemon: FakeDaemon) -> None:
    assert kiwictl("-T", "20") == (0, INFO_20, "")
    assert daemon.calls[-1][:2] == ("set-tq", {"tq": 20.0})


def test_set_tq_keeps_fractions_and_passes_the_gpu(kiwictl: Run, daemon: FakeDaemon) -> None:
    rc, out, _ = kiwictl("--tq", "2.5", "--gpu", "GPU-5a1c")
    assert (rc, out) == (0, "[INFO] Successfully set the scheduler TQ to 2.5 seconds.\n")
    assert daemon.calls[-1][:2] == ("set-tq", {"tq": 2.5, "gpu": "GPU-5a1c"})


def test_small_tq_also_prints_the_daemons_warning(kiwictl: Run) -> None:
    rc, out, err = kiwictl("-T", "5")
    assert (rc, out) == (0, "[INFO] Successfully set the scheduler TQ to 5 seconds.\n")
    assert err == "[WARNING] a TQ of 5 s or less is discouraged: hand-overs eat it\n"


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf", "nan", "", "20s"])
def test_invalid_tq_exits_1_without_contacting_the_daemon(
    kiwictl: Run, daemon: FakeDaemon, value: str
) -> None:
    rc, out, err = kiwictl(f"--tq={value}")
    assert (rc, out) == (1, "")
    assert err.startswith("[ERROR] TQ must be a")
    assert repr(value) in err
    assert daemon.calls == []


def test_daemon_refusing_a_tq_exits_1_with_its_message(kiwictl: Run) -> None:
    assert kiwictl("-T", "5000") == (
        1,
        "",
        "[ERROR] TQ must be in (0, 3600] seconds, not 5000\n",
    )


def test_scheduler_on_and_off(kiwictl: Run, daemon: FakeDaemon) -> None:
    rc, out, _ = kiwictl("-S", "off")
    assert (rc, out) == (
        0,
        "[INFO] Anti-thrashing scheduler is now off (no gating: the driver time-slices the GPU).\n",
    )
    rc, out, _ = kiwictl("-S", "on")
    assert (rc, out) == (0, "[INFO] Anti-thrashing scheduler is now on (mode exclusive).\n")
    assert [c[1] for c in daemon.calls] == [{"mode": "off"}, {"mode": "on"}]


def test_status_json_round_trips(kiwictl: Run) -> None:
    rc, out, _ = kiwictl("status", "--json")
    assert rc == 0
    assert json.loads(out) == STATUS
    assert out == json.dumps(STATUS, indent=2, sort_keys=True) + "\n"


def test_status_for_people(kiwictl: Run) -> None:
    rc, out, _ = kiwictl("status")
    assert rc == 0
    assert "GPU 0: NVIDIA H200 (GPU-5a1c), 80.0 GiB" in out
    assert "TQ       20 s (runtime override; file says 30)" in out
    assert "mode     exclusive, contended\n" in out
    assert "holder   pid:123 for 3.2 s, 16.8 s left" in out
    assert "waiters  1. pid:456 waiting 3.1 s" in out
    assert "pid:456 (pid 456): waiting, pids 456, 3.0 GiB" in out


def test_tenants(kiwictl: Run) -> None:
    rc, out, _ = kiwictl("tenants")
    assert rc == 0
    assert out.splitlines()[0].split() == ["TENANT", "NAME", "STATE", "GPUS", "FOOTPRINT", "PIDS"]
    assert out.splitlines()[1].split() == [
        "pid:123",
        "pid",
        "123",
        "holder",
        "0",
        "1000",
        "B",
        "123",
    ]
    rc, out, _ = kiwictl("tenants", "--json")
    assert json.loads(out) == {"tenants": STATUS["gpus"][0]["tenants"]}


def test_pods_are_shown_where_tenants_have_them() -> None:
    pod = {
        "id": "cgroup:/kubepods/pod1/c1",
        "name": "train",
        "pod": "train-7f9",
        "namespace": "ml",
        "identity_source": "podresources",
        "state": "waiting",
        "pids": [7],
        "gpus": ["0"],
        "footprint_bytes": 0,
    }
    bare = {"id": "pid:8", "name": "pid 8", "state": "idle", "pids": [8], "gpus": ["0"]}
    gpu = {**STATUS["gpus"][0], "tenants": [pod, bare]}

    text = format_status({**STATUS, "gpus": [gpu]})
    assert "cgroup:/kubepods/pod1/c1 (train, pod ml/train-7f9): waiting, pids 7" in text
    assert "pid:8 (pid 8): idle, pids 8" in text
    lines = format_tenants([pod, bare]).splitlines()
    assert lines[0].split() == ["TENANT", "NAME", "POD", "STATE", "GPUS", "FOOTPRINT", "PIDS"]
    assert lines[1].split()[:4] == ["cgroup:/kubepods/pod1/c1", "train", "ml/train-7f9", "waiting"]
    assert lines[2].split()[:5] == ["pid:8", "pid", "8", "-", "idle"]


def test_socket_from_environment_or_after_the_command(
    kiwictl: Run, server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(server.path)
    monkeypatch.setenv("KIWI_SOCKET", path)
    assert kiwictl("-T", "20", socket=None) == (0, INFO_20, "")
    monkeypatch.setenv("KIWI_SOCKET", "/nonexistent/kiwid.sock")
    assert kiwictl("status", "--socket", path, "--json", socket=None)[0] == 0


def test_unreachable_daemon_exits_3_and_says_why(
    sock_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = sock_dir / "kiwid.sock"
    assert main(["--socket", str(missing), "status"]) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"[ERROR] control socket {missing} does not exist")
    assert "is kiwid running? (systemctl status kiwid)" in err


@pytest.mark.parametrize(
    "argv",
    [[], ["-T", "20", "-S", "on"], ["-T", "20", "status"], ["--gpu", "0", "status"], ["-S", "x"]],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage: kiwictl" in capsys.readouterr().err


def test_help_explains_examples_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "kiwictl -T 20" in out
    assert "4  permission denied" in out


# ---- as commands, the way people run it ----------------------------------------------


def test_installed_kiwictl_command(serve: Any) -> None:
    st = serve()
    exe = Path(sys.executable).parent / "kiwictl"
    if not exe.exists():
        pytest.skip("kiwictl is not installed next to this interpreter")
    proc = subprocess.run(
        [exe, "--socket", st.path, "-T", "20"], capture_output=True, text=True, check=False
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, INFO_20, "")


@needs_root
def test_nobody_is_told_it_may_not_change_the_scheduler(serve: Any) -> None:
    st = serve()
    readable = str(kiwid_copy())  # not the checkout: uid nobody may not read it
    code = f"import sys; sys.path.insert(0, {readable!r}); from kiwid.cli.kiwictl import main; "
    code += "sys.exit(main(sys.argv[1:]))"

    def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [nobody_python(), "-I", "-c", code, "--socket", str(st.path), *argv],
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    refused = as_nobody("-T", "20")
    assert refused.returncode == 4
    assert refused.stderr == (
        "[ERROR] changing the scheduler needs root or membership of group 'kiwi' "
        "(you are uid 65534)\n"
    )
    assert as_nobody("status").returncode == 0


# ---- formatting, from hand-written status objects ------------------------------------


def test_format_number() -> None:
    assert [format_number(x) for x in (20, 20.0, 2.5, 0.1, 3600)] == [
        "20",
        "20",
        "2.5",
        "0.1",
        "3600",
    ]


def test_parse_tq() -> None:
    assert parse_tq(" 1e1 ") == 10.0
    with pytest.raises(ValueError, match="greater than 0"):
        parse_tq("-inf")


def test_status_shows_idle_gpus_failed_reloads_and_mode_overrides() -> None:
    status = copy.deepcopy(STATUS)
    status["config"]["last_reload"] = {"ok": False, "at_unix": 2.0, "error": "tq: must be > 0"}
    gpu = status["gpus"][0]
    gpu.update(
        tq=30.0, mode="off", holder=None, waiters=[], tenants=[], healthy=False, contended=False
    )
    text = format_status(status)
    assert "last reload FAILED, previous settings kept: tq: must be > 0" in text
    assert "TQ       30 s\n" in text
    assert "UNHEALTHY" in text
    assert "mode     off (runtime override; file says exclusive)" in text
    assert "holder   none" in text
    assert "waiters  none" in text
    assert "tenants  none" in text


def test_holder_without_waiters_keeps_the_gpu() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu["holder"]["remaining_s"] = None
    # Waiters of a lower priority class: it keeps the GPU all the same.
    assert "holder   pid:123 for 3.2 s, keeps it: those waiting rank lower" in format_status(status)
    gpu["waiters"] = []
    assert "holder   pid:123 for 3.2 s, keeps it while nobody waits" in format_status(status)


def test_memory_moves_and_waits_are_shown() -> None:
    status = copy.deepcopy(STATUS)
    gpu = status["gpus"][0]
    gpu["handover_waits_for"] = "pid:456"
    gpu["swaps"] = [
        {"tenant": "pid:789", "direction": "out", "bytes": 2**30, "elapsed_s": 3.0},
        {"tenant": "pid:456", "direction": "in", "bytes": 2**31, "elapsed_s": 1.0},
    ]
    gpu.update(free_bytes=5 * 2**30, memory_resident_bytes=3 * 2**30)
    tenant = gpu["tenants"][0]
    tenant.update(remembered_bytes=47 * 2**30, waiting_for="waiting for free memory on GPU 0")
    text = format_status(status)
    assert "quantum over, keeps it until pid:456's memory is back" in text
    assert "  swap     pid:789 out: 1.0 GiB, 3.0 s so far\n           pid:456 in: 2.0 GiB" in text
    assert "  memory   5.0 GiB free (driver), 3.0 GiB held by tenants" in text
    assert "sized from its last run (47.0 GiB)" in text
    assert "; not let go yet: waiting for free memory on GPU 0" in text


def test_no_gpus_no_tenants() -> None:
    assert format_status({**STATUS, "gpus": []}).endswith("no GPUs")
    assert format_tenants([]) == "no tenants"


def test_default_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIWI_SOCKET", "")  # empty counts as unset
    assert build_parser().parse_args(["status"]).socket == "/run/kiwi/kiwid.sock"
    monkeypatch.setenv("KIWI_SOCKET", "/elsewhere/k.sock")
    assert build_parser().parse_args(["-T", "9"]).socket == "/elsewhere/k.sock"
