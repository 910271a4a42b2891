from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiwid.config import (
    ConfigError,
    GpuOverride,
    SchedulerSettings,
    ServiceLimits,
    Settings,
    check_config_main,
    load_config,
    parse_config,
    service_limits,
)

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "kiwi.toml"
SRC = "/etc/kiwi.toml"

# TOML (table, key) -> (settings group, field), with a valid non-default value.
KEYS: dict[tuple[str, str], tuple[str, str, str, Any]] = {
    ("scheduler", "tq"): ("scheduler", "tq", "12.5", 12.5),
    ("scheduler", "idle_release"): ("scheduler", "idle_release", "7", 7.0),
    ("scheduler", "mode"): ("scheduler", "mode", '"auto"', "auto"),
    ("scheduler", "handover_allowance"): ("scheduler", "handover_allowance", "3", 3.0),
    ("scheduler", "preempt_after"): ("scheduler", "preempt_after", "5", 5.0),
    ("scheduler", "max_wait"): ("scheduler", "max_wait", "300", 300.0),
    ("gpu", "backend"): ("gpu", "backend", '"sim"', "sim"),
    ("gpu", "poll_interval"): ("gpu", "poll_interval", "0.05", 0.05),
    ("gpu", "gate"): ("gpu", "gate", '"cuda-lock"', "cuda-lock"),
    ("gpu", "gate_timeout"): ("gpu", "gate_timeout", "0.5", 0.5),
    ("gpu", "driver_timeout"): ("gpu", "driver_timeout", "20", 20.0),
    ("gpu.sim", "devices"): ("gpu", "sim_devices", "8", 8),
    ("gpu.sim", "memory_gib"): ("gpu", "sim_memory_gib", "141", 141.0),
    ("gpu.sim", "swap_out_gbps"): ("gpu", "sim_swap_out_gbps", "3", 3.0),
    ("gpu.sim", "swap_in_gbps"): ("gpu", "sim_swap_in_gbps", "7.5", 7.5),
    ("control", "socket"): ("control", "socket", '"/run/k.sock"', "/run/k.sock"),
    ("control", "admin_group"): ("control", "admin_group", '"gpu-admins"', "gpu-admins"),
    ("daemon", "state_dir"): ("daemon", "state_dir", '"/var/lib/kiwi"', "/var/lib/kiwi"),
    ("daemon", "shutdown_timeout"): ("daemon", "shutdown_timeout", "2.5", 2.5),
    ("daemon", "log_level"): ("daemon", "log_level", '"debug"', "debug"),
    ("memory", "reserve_mib"): ("memory", "reserve_mib", "0", 0),
    ("memory", "swap"): ("memory", "swap", '"checkpoint"', "checkpoint"),
    ("memory", "park"): ("memory", "park", '"off"', "off"),
    ("memory", "host_floor_mib"): ("memory", "host_floor_mib", "0", 0),
    ("memory", "checkpoint_lanes"): ("memory", "checkpoint_lanes", "2", 2),
    ("memory", "newcomer"): ("memory", "newcomer", '"free"', "free"),
    ("memory", "checkpoint_retry_after"): ("memory", "checkpoint_retry_after", "3600", 3600.0),
    ("metrics", "listen"): ("metrics", "listen", '"127.0.0.1:9417"', "127.0.0.1:9417"),
    ("kubernetes", "resource"): ("kubernetes", "resource", '"example.com/gpu"', "example.com/gpu"),
    ("kubernetes", "replicas"): ("kubernetes", "replicas", "8", 8),
    ("kubernetes", "admission"): ("kubernetes", "admission", '"none"', "none"),
    ("kubernetes", "cdi_dir"): ("kubernetes", "cdi_dir", '"/etc/cdi"', "/etc/cdi"),
    ("kubernetes", "device_plugin_dir"): (
        "kubernetes",
        "device_plugin_dir",
        '"/tmp/dp"',
        "/tmp/dp",
    ),
    ("kubernetes", "gpus"): ("kubernetes", "gpus", '["2", "GPU-x"]', ("2", "GPU-x")),
    ("kubernetes", "pod_resources_socket"): ("kubernetes", "pod_resources_socket", '""', ""),
}
KEYS_GROUPS = [f.name for f in dataclasses.fields(Settings) if f.name != "tenants"]


def errors(text: str, service: ServiceLimits | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text, SRC, service=service)
    assert str(info.value) == "\n".join(info.value.problems)
    return list(info.value.problems)


def test_defaults() -> None:
    s = Settings()
    assert (s.scheduler.tq, s.scheduler.idle_release, s.scheduler.mode) == (30.0, 5.0, "exclusive")
    assert s.scheduler.handover_allowance == 2.0
    assert dict(s.scheduler.gpu) == {}
    assert (s.gpu.backend, s.gpu.poll_interval, s.gpu.sim_devices) == ("nvml", 0.5, 1)
    assert s.gpu.sim_memory_gib == 80.0
    assert (s.control.socket, s.control.admin_group) == ("/run/kiwi/kiwid.sock", "kiwi")
    assert (s.daemon.state_dir, s.daemon.shutdown_timeout, s.daemon.log_level) == (
        "/run/kiwi/state",
        10.0,
        "info",
    )
    assert s.memory.reserve_mib == 1024
    assert parse_config("") == parse_config("", "<string>")
    assert parse_config("").settings == s
    assert parse_config("").source is None


def test_settings_are_frozen_and_hashable() -> None:
    s = parse_config('[scheduler.gpu."0"]\ntq = 10\n').settings
    assert hash(s) == hash(dataclasses.replace(s))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.scheduler.tq = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.scheduler.gpu["1"] = GpuOverride()  # type: ignore[index]
    built = SchedulerSettings(gpu={"0": GpuOverride(tq=10.0)})
    assert built == s.scheduler
    assert hash(built) == hash(s.scheduler)
    assert "GpuOverrides" in repr(built.gpu)


def test_shipped_file_is_the_defaults() -> None:
    loaded = load_config(SHIPPED)
    assert loaded.settings == Settings()
    assert loaded.warnings == ()
    assert loaded.source == SHIPPED


def test_shipped_file_shows_every_key() -> None:
    doc = tomllib.loads(SHIPPED.read_text(encoding="utf-8"))
    shown = {("gpu.sim", k) for k in doc["gpu"].pop("sim")}
    shown |= {(table, key) for table, values in doc.items() for key in values}
    assert shown == set(KEYS)
    fields = {(g, f.name) for g in KEYS_GROUPS for f in dataclasses.fields(getattr(Settings(), g))}
    assert fields - {("scheduler", "gpu")} == {(g, f) for g, f, _, _ in KEYS.values()}
    assert '# [scheduler.gpu."0"]' in SHIPPED.read_text(encoding="utf-8")


@pytest.mark.parametrize(("table", "key"), list(KEYS))
def test_every_key_round_trips(table: str, key: str) -> None:
    group, attr, literal, expected = KEYS[table, key]
    settings = parse_config(f"[{table}]\n{key} = {literal}\n").settings
    value = getattr(getattr(settings, group), attr)
    assert value == expected
    assert type(value) is type(expected)
    assert value != getattr(getattr(Settings(), group), attr)


@given(st.floats(min_value=0.05, max_value=60) | st.integers(min_value=1, max_value=60))
def test_poll_interval_accepts_its_range(value: float) -> None:
    assert parse_config(f"gpu.poll_interval = {value!r}").settings.gpu.poll_interval == value


def test_gpu_overrides_and_precedence() -> None:
    text = """
        [scheduler]
        tq = 20
        [scheduler.gpu."1"]
        tq = 40
        idle_release = 9
        [scheduler.gpu."GPU-abc"]
        tq = 60
        [scheduler.gpu."MIG-GPU-abc/1/0"]
        mode = "off"
    """
    sched = parse_config(text).settings.scheduler
    assert sched.gpu["1"] == GpuOverride(tq=40.0, idle_release=9.0)
    assert sched.for_gpu(0, "GPU-zzz") == (20.0, 5.0, "exclusive")
    assert sched.for_gpu(1, "GPU-zzz") == (40.0, 9.0, "exclusive")
    assert sched.for_gpu(1, "GPU-abc") == (60.0, 9.0, "exclusive")  # UUID wins, per field
    assert sched.for_gpu(0, "GPU-abc").tq == 60.0
    assert sched.for_gpu(3, "MIG-GPU-abc/1/0") == (20.0, 5.0, "off")


def test_unknown_keys() -> None:
    assert errors("[scheduler]\ntqq = 1\n") == [
        f"{SRC}: unknown key scheduler.tqq "
        "(known keys: tq, idle_release, mode, handover_allowance, preempt_after, max_wait, gpu)"
    ]
    assert errors("[sched]\n") == [
        f"{SRC}: unknown key sched (known keys: scheduler, gpu, control, daemon, memory, "
        "metrics, kubernetes, tenants)"
    ]
    assert errors('[scheduler.gpu."0"]\nmemory = 1\n') == [
        f'{SRC}: unknown key scheduler.gpu."0".memory (known keys: tq, idle_release, mode)'
    ]
    assert errors('[gpu.sim]\n"mem gib" = 1\n') == [
        f'{SRC}: unknown key gpu.sim."mem gib" '
        "(known keys: devices, memory_gib, swap_out_gbps, swap_in_gbps)"
    ]


SECS = "must be a number of seconds > 0"
POLL = "must be a number of seconds from 0.05 to 60"
DEVICES = "must be an integer number of devices from 1 to 64"
LANES = "must be an integer number of concurrent checkpoints from 1 to 8"
MIB = "must be an integer number of MiB >= 0"
RETRY = "must be a number of seconds from 0 to 31536000"
SOCKET = "must be an absolute path of at most 107 bytes"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("scheduler.tq = -1", SECS),
        ("scheduler.tq = 0", SECS),
        ("scheduler.tq = inf", SECS),
        ("scheduler.tq = nan", SECS),
        ('scheduler.tq = "30"', f"{SECS}, not a string"),
        ("scheduler.tq = true", f"{SECS}, not a boolean"),
        ("scheduler.idle_release = [1]", f"{SECS}, not an array"),
        ("scheduler.handover_allowance = 0.0", SECS),
        ('scheduler.mode = "fair"', 'must be one of "exclusive", "auto", "off"'),
        ('gpu.backend = "cuda"', 'must be one of "nvml", "sim"'),
        ("gpu.poll_interval = 0.01", POLL),
        ("gpu.poll_interval = 61", POLL),
        ("gpu.sim.devices = 65", DEVICES),
        ("gpu.sim.devices = 2.0", f"{DEVICES}, not a float"),
        ("gpu.sim.memory_gib = 0", "must be a number of GiB > 0"),
        ("gpu.sim.swap_out_gbps = 0", "must be a number of GB/s > 0"),
        ('memory.swap = "always"', 'must be one of "none", "checkpoint", "auto"'),
        ("memory.host_floor_mib = -1", "must be an integer number of MiB >= 0"),
        ("memory.checkpoint_lanes = 0", LANES),
        ("memory.checkpoint_lanes = 9", LANES),
        ("memory.checkpoint_lanes = 1.5", f"{LANES}, not a float"),
        ('memory.newcomer = "all"', 'must be one of "whole-card", "free"'),
        ("memory.checkpoint_retry_after = -1", RETRY),
        ("memory.checkpoint_retry_after = 31536001", RETRY),
        ("memory.checkpoint_retry_after = inf", RETRY),
        ('memory.checkpoint_retry_after = "1d"', f"{RETRY}, not a string"),
        ('control.socket = "kiwid.sock"', SOCKET),
        ('control.admin_group = ""', "must be a group name"),
        ('daemon.state_dir = "run/kiwi"', "must be an absolute path of at most 4095 bytes"),
        ("daemon.shutdown_timeout = -5", SECS),
        (
            'kubernetes.cdi_dir = "etc/cdi"',
            'must be an absolute path of at most 4095 bytes, or "" (no CDI spec)',
        ),
        ('daemon.log_level = "INFO"', 'must be one of "debug", "info", "warning", "error"'),
        ("memory.reserve_mib = -1", MIB),
        ("memory.reserve_mib = 1979-05-27", f"{MIB}, not a date or time"),
        ("scheduler = 5", "must be a table, not an integer"),
        ("gpu.sim = true", "must be a table, not a boolean"),
        ("scheduler.gpu = []", "must be a table, not an array"),
        ('scheduler.gpu."0" = 30', "must be a table, not an integer"),
    ],
)
def test_bad_values_name_file_key_and_value(text: str, reason: str) -> None:
    assert errors(text) == [f"{SRC}: {text}: {reason}"]


def test_keys_and_values_are_shown_as_toml() -> None:
    assert errors("scheduler.gpu.0.tq = -2") == [f'{SRC}: scheduler.gpu."0".tq = -2: {SECS}']
    assert errors("control.socket = {a = 1}") == [
        f"{SRC}: control.socket = {{ a = 1 }}: {SOCKET}, not a table"
    ]


def test_long_values_are_shortened() -> None:
    [problem] = errors(f'control.socket = "/{"x" * 200}"')
    assert problem.startswith(f'{SRC}: control.socket = "/xxx')
    assert "…: must be an absolute path of at most 107 bytes" in problem


@pytest.mark.parametrize("key", ["gpu0", "01", "-1", "uuid-1", "GPU-", "", "٣"])
def test_bad_gpu_keys(key: str) -> None:
    assert errors(f'[scheduler.gpu."{key}"]\ntq = 10\n') == [
        f'{SRC}: scheduler.gpu."{key}": a GPU key must be a decimal index such as "0" '
        'or a UUID starting with "GPU-" or "MIG-"'
    ]


def test_all_problems_are_reported_together() -> None:
    text = """
        bogus = 1
        [scheduler]
        tq = -1
        mode = "fast"
        [scheduler.gpu.x]
        [gpu]
        backend = 3
        [memory]
        reserve_mib = true
    """
    problems = errors(text)
    assert len(problems) == 6
    assert all(p.startswith(f"{SRC}: ") for p in problems)
    joined = "\n".join(problems)
    for needle in ["bogus", "scheduler.tq = -1", "scheduler.mode", 'scheduler.gpu."x"']:
        assert needle in joined
    assert "gpu.backend = 3" in joined
    assert "memory.reserve_mib = true" in joined


def test_short_tq_warns() -> None:
    text = 'scheduler.tq = 5\n[scheduler.gpu."GPU-a"]\ntq = 0.5\n[scheduler.gpu."1"]\ntq = 5.5\n'
    loaded = parse_config(text, SRC)
    tail = (
        "a TQ of 5 s or less is discouraged: each hand-over moves the tenant's GPU memory, "
        "so a short quantum is spent waiting for data"
    )
    assert loaded.warnings == (
        f"scheduler.tq = 5: {tail}",
        f'scheduler.gpu."GPU-a".tq = 0.5: {tail}',
    )
    assert loaded.source == Path(SRC)
    assert loaded.settings.scheduler.tq == 5.0


def test_toml_syntax_error_names_file_and_line() -> None:
    [problem] = errors("[scheduler]\ntq = 30\ntq = = 1\n")
    assert problem.startswith(f"{SRC}: invalid TOML: ")
    assert "line 3" in problem


def test_load_config_errors(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=rf"^{missing}: cannot read: No such file or directory$"):
        load_config(missing)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'daemon.state_dir = "/caf\xe9"\n')
    with pytest.raises(ConfigError, match=rf"^{latin}: not UTF-8 text: .* at byte 24$"):
        load_config(str(latin))


def test_check_config_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kiwi.toml"
    path.write_text("[scheduler]\ntq = 2\n", encoding="utf-8")
    assert check_config_main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{path}: OK\n"
    assert err.startswith(f"warning: {path}: scheduler.tq = 2: a TQ of 5 s or less")
    assert check_config_main([str(SHIPPED)]) == 0
    assert capsys.readouterr() == (f"{SHIPPED}: OK\n", "")


def test_check_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kiwi.toml"
    path.write_text('[scheduler]\ntq = -1\nmode = "x"\n', encoding="utf-8")
    assert check_config_main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{path}: scheduler.tq = -1: must be a number of seconds > 0",
        f'{path}: scheduler.mode = "x": must be one of "exclusive", "auto", "off"',
    ]


def test_check_config_default_path_and_usage(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("kiwid.config.loader.DEFAULT_PATH", Path("/nonexistent/kiwi.toml"))
    monkeypatch.setattr("sys.argv", ["kiwid", "check-config"])
    assert check_config_main() == 1
    assert (
        capsys.readouterr().err
        == "/nonexistent/kiwi.toml: cannot read: No such file or directory\n"
    )
    assert check_config_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: kiwid check-config [PATH]")
    assert check_config_main(["a.toml", "-v"]) == 2
    assert "error: unexpected arguments: a.toml -v" in capsys.readouterr().err
    assert check_config_main(["-v"]) == 2
    assert check_config_main(["a.toml", "b.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kiwid check-config [PATH]\n")
    assert err.endswith("error: unexpected arguments: a.toml b.toml\n")


@pytest.mark.parametrize(
    ("listen", "ok"),
    [
        ("127.0.0.1:9417", True),
        ("[::1]:0", True),
        ("", True),
        ("localhost", False),
        ("1.2.3.4:70000", False),
        ("::1:80", False),
        (":80", False),
    ],
)
def test_metrics_listen_is_host_and_port(listen: str, ok: bool) -> None:
    text = f'metrics.listen = "{listen}"'
    if ok:
        assert parse_config(text).settings.metrics.listen == listen
    else:
        assert "metrics.listen" in errors(text)[0]


def test_the_pod_resources_socket_is_an_absolute_path_or_nothing() -> None:
    problem = errors('kubernetes.pod_resources_socket = "kubelet.sock"')[0]
    assert 'kubernetes.pod_resources_socket = "kubelet.sock": must be an absolute path' in problem
    [problem] = errors(f'kubernetes.pod_resources_socket = "/{"x" * 107}"')
    assert problem.endswith(
        ': must be an absolute path of at most 107 bytes, or "" (no PodResources lookups)'
    )


def test_kubernetes_gpus_must_be_a_list_of_names() -> None:
    assert "kubernetes.gpus" in errors('kubernetes.gpus = "0"')[0]
    assert "kubernetes.gpus" in errors("kubernetes.gpus = [0]")[0]


@pytest.mark.timeout(5)
@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("fifo", "it is a FIFO (named pipe), not a regular file"),
        ("/dev/zero", "it is a character device, not a regular file"),
        ("dir", "it is a directory, not a regular file"),
        ("big.toml", "it is larger than 1 MiB, too large for a kiwid configuration"),
        ("loop", "Too many levels of symbolic links"),
        ("missing", "No such file or directory"),
        ("big.toml/below", "Not a directory"),
    ],
)
def test_load_config_refuses_what_is_no_config_file(tmp_path: Path, name: str, reason: str) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big.toml").write_text("#" * (1 << 20) + "\n", encoding="utf-8")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    path = tmp_path / name
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == (f"{path}: cannot read: {reason}",)


def test_load_config_reads_a_file_of_1_mib(tmp_path: Path) -> None:
    path = tmp_path / "kiwi.toml"
    path.write_text("#" * ((1 << 20) - 1) + "\n", encoding="utf-8")
    assert load_config(path).settings == Settings()


def test_unprintable_paths_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("/etc/kiwi\0.toml")
    assert info.value.problems == (
        r"/etc/kiwi\x00.toml: cannot read: the path contains a NUL byte",
    )
    odd = tmp_path / "a\nb\udcff.toml"  # a newline, and the byte 0xff that is no UTF-8
    odd.write_text("scheduler.tq = 0\n", encoding="utf-8")
    assert check_config_main([str(odd)]) == 1
    out, err = capsys.readouterr()
    shown = str(tmp_path / r"a\x0ab\xff.toml")
    assert (out, err) == ("", f"{shown}: scheduler.tq = 0: must be a number of seconds > 0\n")
    assert check_config_main([str(tmp_path / "\ud800")]) == 1  # not even surrogateescape
    err = capsys.readouterr().err
    assert err == f"{tmp_path}/\\ud800: cannot read: the path is no valid file name\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (f"scheduler.tq = 1{'0' * 400}", "scheduler.tq = 1000"),
        (f"memory.reserve_mib = {2**63}", "memory.reserve_mib = 9223372036854775808"),
        (f"scheduler.tq = 1{'0' * 5000}", "invalid TOML"),
    ],
)
def test_huge_integers_are_refused(text: str, problem: str) -> None:
    [found] = errors(text)
    assert found.startswith(f"{SRC}: {problem}")


PATH_KEYS = [
    "control.socket",
    "daemon.state_dir",
    "kubernetes.cdi_dir",
    "kubernetes.device_plugin_dir",
    "kubernetes.pod_resources_socket",
]


@pytest.mark.parametrize("key", PATH_KEYS)
@pytest.mark.parametrize(
    ("escaped", "found"),
    [
        (r"\u0000", "U+0000"),
        (r"\n", "U+000A"),
        (r"\u007f", "U+007F"),
        (r"\u0085", "U+0085"),  # NEL, a C1 control
        (r"\u001b[2J\u0000\u001b", "U+001B, U+0000"),
    ],
)
def test_paths_refuse_control_characters(key: str, escaped: str, found: str) -> None:
    assert errors(f'{key} = "/run/a{escaped}b"') == [
        f'{SRC}: {key} = "/run/a{escaped}b": must not contain control characters (found {found})'
    ]


def test_paths_refuse_unpaired_surrogates() -> None:
    # Only text from no file can hold one (a file is decoded as UTF-8 first).
    assert errors('daemon.state_dir = "/run/\ud800"') == [
        rf'{SRC}: daemon.state_dir = "/run/\ud800": must not contain unpaired surrogates '
        "(found U+D800)"
    ]


@pytest.fixture
def odd_files(tmp_path: Path) -> Path:
    """A directory holding one of every kind of file a path may name by mistake."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").touch()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "device").symlink_to("/dev/null")
    (tmp_path / "link-to-dir").symlink_to(tmp_path / "dir")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return tmp_path


@pytest.mark.parametrize("name", ["dir", "link-to-dir", "absent", "dir/absent/absent"])
def test_the_state_dir_may_be_a_directory_or_absent(odd_files: Path, name: str) -> None:
    state_dir = str(odd_files / name)
    assert parse_config(f"daemon.state_dir = {state_dir!r}").settings.daemon.state_dir == state_dir


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("file", "exists and is a regular file, not a directory"),
        ("fifo", "exists and is a FIFO (named pipe), not a directory"),
        ("device", "exists and is a character device, not a directory"),
        ("dangling", "is a symbolic link to nothing, not a directory"),
        ("loop", "is no usable directory: Too many levels of symbolic links"),
        ("file/state", "is no usable directory: a path above it is no directory"),
    ],
)
def test_the_state_dir_must_not_be_anything_else(odd_files: Path, name: str, reason: str) -> None:
    state_dir = odd_files / name
    [problem] = errors(f'daemon.state_dir = "{state_dir}"')
    assert problem.startswith(f'{SRC}: daemon.state_dir = "{str(state_dir)[:40]}')  # shortened
    assert problem.endswith(f": {reason}")


def test_a_state_dir_out_of_sight_is_left_to_kiwid(monkeypatch: pytest.MonkeyPatch) -> None:
    # check-config may run unprivileged; kiwid runs as root and sees for itself.
    def denied(*_: object, **__: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "stat", denied)
    assert parse_config('daemon.state_dir = "/root/x"').settings.daemon.state_dir == "/root/x"


INSIDE = (
    'must not be inside daemon.state_dir = "{state}": that directory is mode 0700, '
    "so no one but root could reach the socket"
)


@pytest.mark.parametrize(
    ("state_dir", "socket", "problem"),
    [
        (None, "/run/kiwi/state/kiwid.sock", INSIDE),
        (None, "/run/kiwi/state/../state/x/kiwid.sock", INSIDE),
        ("/run/kiwi", None, INSIDE),  # the old default state_dir with the default socket
        ("/", "/kiwid.sock", INSIDE),
        ("/run/kiwi/s", "/run/kiwi/s", 'must not be daemon.state_dir = "{state}" itself'),
        (
            "/run/kiwi/kiwid.sock/state",
            None,
            'must not be a directory above daemon.state_dir = "{state}"',
        ),
    ],
)
def test_the_socket_must_lie_outside_the_state_dir(
    state_dir: str | None, socket: str | None, problem: str
) -> None:
    text = "" if state_dir is None else f"daemon.state_dir = {state_dir!r}\n"
    text += "" if socket is None else f"control.socket = {socket!r}\n"
    shown_socket = socket or "/run/kiwi/kiwid.sock"
    reason = problem.format(state=state_dir or "/run/kiwi/state")
    assert errors(text) == [f'{SRC}: control.socket = "{shown_socket}": {reason}']


@pytest.mark.parametrize(
    ("state_dir", "socket"),
    [
        ("/run/kiwi/state", "/run/kiwi/kiwid.sock"),
        ("/run/kiwi/state", "/run/kiwi/state2.sock"),  # a shared prefix is no parent
        ("/var/lib/kiwi", "/run/kiwi/kiwid.sock"),
    ],
)
def test_a_socket_beside_the_state_dir_is_fine(state_dir: str, socket: str) -> None:
    settings = parse_config(f"daemon.state_dir = {state_dir!r}\ncontrol.socket = {socket!r}")
    assert (settings.settings.daemon.state_dir, settings.settings.control.socket) == (
        state_dir,
        socket,
    )


def test_a_bad_path_is_not_compared_again() -> None:
    # The socket is reported once, as relative; the default state_dir is not involved.
    assert errors('control.socket = "run/kiwi/state/kiwid.sock"') == [
        f'{SRC}: control.socket = "run/kiwi/state/kiwid.sock": {SOCKET}'
    ]


SHIPPED_WATCHDOG = (
    "must be at most 15 s, half the 30 s service watchdog (WatchdogSec=30s in the shipped "
    "unit): kiwid pings the watchdog every 15 s from the loop that waits for gates, so a "
    "longer gate could let the watchdog expire, and systemd would kill kiwid"
)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("gpu.gate_timeout = 15.5", SHIPPED_WATCHDOG),
        ("gpu.gate_timeout = 60", SHIPPED_WATCHDOG),
        ("gpu.gate_timeout = inf", SHIPPED_WATCHDOG),
        ("gpu.gate_timeout = 0.05", "must be a number of seconds from 0.1 to 60"),
        ("gpu.gate_timeout = nan", "must be a number of seconds from 0.1 to 60"),
    ],
)
def test_the_gate_timeout_fits_in_the_shipped_watchdog(text: str, reason: str) -> None:
    assert errors(text) == [f"{SRC}: {text}: {reason}"]
    assert parse_config("gpu.gate_timeout = 15").settings.gpu.gate_timeout == 15.0


def test_the_gate_timeout_fits_in_the_watchdog_systemd_gave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kiwi.toml"
    path.write_text("gpu.gate_timeout = 6\n", encoding="utf-8")
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == (
        f"{path}: gpu.gate_timeout = 6: must be at most 5 s, half the 10 s service watchdog "
        "(WATCHDOG_USEC=10000000): kiwid pings the watchdog every 5 s from the loop that "
        "waits for gates, so a longer gate could let the watchdog expire, and systemd would "
        "kill kiwid",
    )
    assert check_config_main([str(path)]) == 1
    assert "half the 10 s service watchdog" in capsys.readouterr().err
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert "half the 10 s" in errors("gpu.gate_timeout = 6")[0]
    monkeypatch.setenv("WATCHDOG_USEC", "300000000")  # 150 s: the range's 60 s still holds
    assert parse_config("gpu.gate_timeout = 60").settings.gpu.gate_timeout == 60.0
    assert errors("gpu.gate_timeout = 61") == [
        f"{SRC}: gpu.gate_timeout = 61: must be a number of seconds from 0.1 to 60"
    ]


@pytest.mark.parametrize(
    "environ",
    [
        {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"},  # another process's watchdog
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": ""},
        {"WATCHDOG_USEC": "ten"},
        {"WATCHDOG_USEC": "-5"},
        {"WATCHDOG_USEC": "\u00b2"},  # a digit to str.isdigit, not to int()
        {"WATCHDOG_USEC": "9" * 5000},
    ],
)
def test_an_unusable_watchdog_variable_means_the_shipped_unit(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str]
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert errors("gpu.gate_timeout = 15.5") == [
        f"{SRC}: gpu.gate_timeout = 15.5: {SHIPPED_WATCHDOG}"
    ]


SHUTDOWN = (
    "must be at most 75 s: the shipped unit gives a stop 90 s (TimeoutStopSec=90s) and "
    "then runs `kiwid recover` (ExecStopPost=) to thaw what a forced stop left gated, "
    "which needs the last 15 s"
)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("daemon.shutdown_timeout = 75.5", SHUTDOWN),
        ("daemon.shutdown_timeout = 90", SHUTDOWN),
        ("daemon.shutdown_timeout = inf", SHUTDOWN),
        ("daemon.shutdown_timeout = 0", SECS),
    ],
)
def test_the_shutdown_timeout_leaves_time_for_recover(text: str, reason: str) -> None:
    assert errors(text) == [f"{SRC}: {text}: {reason}"]
    assert parse_config("daemon.shutdown_timeout = 75").settings.daemon.shutdown_timeout == 75.0


def test_service_limits_can_be_given() -> None:
    environ = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "7"}
    assert service_limits(environ, pid=7) == ServiceLimits(4.0, "WATCHDOG_USEC=4000000")
    assert service_limits(environ, pid=8) == ServiceLimits()
    roomy = ServiceLimits(watchdog_s=60.0, stop_timeout_s=300.0)
    loaded = parse_config("gpu.gate_timeout = 30\ndaemon.shutdown_timeout = 285", service=roomy)
    assert (loaded.settings.gpu.gate_timeout, loaded.settings.daemon.shutdown_timeout) == (30, 285)
    assert (
        "must be at most 2 s, half the 4 s service watchdog"
        in errors("gpu.gate_timeout = 3", service=ServiceLimits(4.0, "WATCHDOG_USEC=4000000"))[0]
    )


KNOWN_TABLES = "scheduler, gpu, control, daemon, memory, metrics, kubernetes, tenants"


def test_tenant_rules_are_read_in_order() -> None:
    text = """
[[tenants]]
match = { namespace = "research", pod = "train-*" }
weight = 3
[[tenants]]
match = { name = "inference-*", unit = "*.service" }
priority = 10
swap = "never"
max_priority = 12
[[tenants]]
match = {}
tq = 60
max_weight = 2.5
"""
    rules = parse_config(text).settings.tenants
    assert [r.match.pod for r in rules] == ["train-*", None, None]
    assert (rules[0].weight, rules[0].priority) == (3.0, None)
    assert (rules[1].priority, rules[1].swap, rules[1].max_priority) == (10, "never", 12)
    assert rules[1].match.unit == "*.service"
    assert (rules[2].tq, rules[2].max_weight) == (60.0, 2.5)
    assert hash(parse_config(text).settings)  # still frozen and hashable


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[tenants.alice]\nweight = 2\n", "tenants = { alice = { weight = 2 } }: must be an array"),
        ("tenants = {}\n", "tenants = {  }: must be an array of tables"),
        ("[[tenants]]\nweight = 2\n", "tenants[0]: needs a match table"),
        ("[[tenants]]\nmatch = {}\n[[tenants]]\nmatch = {}\nweight = 0\n", "tenants[1].weight = 0"),
        ('[[tenants]]\nmatch = { pods = "x" }\n', "unknown key tenants[0].match.pods"),
        ('[[tenants]]\nmatch = { pod = "" }\n', "tenants[0].match.pod"),
        ('[[tenants]]\nmatch = {}\nswap = "sometimes"\n', "tenants[0].swap"),
        ('[[tenants]]\nmatch = {}\npark = "false"\n', 'tenants[0].park = "false": must be'),
        ("[[tenants]]\nmatch = {}\npark = 0\n", "tenants[0].park = 0: must be"),
        ('[memory]\npark = "always"\n', 'memory.park = "always": must be one of "idle", "off"'),
        ("[[tenants]]\nmatch = {}\npriority = 1.5\n", "tenants[0].priority = 1.5"),
        ("[[tenant]]\nmatch = {}\n", f"unknown key tenant (known keys: {KNOWN_TABLES})"),
    ],
)
def test_tenant_rule_problems_name_the_rule_and_key(text: str, problem: str) -> None:
    found = errors(text)
    assert any(problem in line for line in found), found


# The core's words (TenantPolicy), as set-weight and register say it.
WEIGHTS = "must be a number from 0.01 to 1000"
PRIORITIES = "must be an integer from -1000 to 1000"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("weight = 0.001", f"tenants[0].weight = 0.001: {WEIGHTS}"),
        ("weight = 1000.5", f"tenants[0].weight = 1000.5: {WEIGHTS}"),
        ("max_weight = 0.001", f"tenants[0].max_weight = 0.001: {WEIGHTS}"),
        ("priority = 1001", f"tenants[0].priority = 1001: {PRIORITIES}"),
        ("max_priority = -1001", f"tenants[0].max_priority = -1001: {PRIORITIES}"),
    ],
)
def test_a_rules_weight_or_priority_out_of_range_is_refused_in_the_cores_words(
    line: str, problem: str
) -> None:
    assert errors(f"[[tenants]]\nmatch = {{}}\n{line}\n") == [f"{SRC}: {problem}"]


def test_a_rules_weight_and_priority_bounds_are_accepted() -> None:
    text = "[[tenants]]\nmatch = {}\nweight = 0.01\npriority = -1000\nmax_weight = 1000\n"
    text += "max_priority = 1000\n"
    (rule,) = parse_config(text).settings.tenants
    assert (rule.weight, rule.priority, rule.max_weight, rule.max_priority) == (
        0.01,
        -1000,
        1000.0,
        1000,
    )


def test_unknown_tables_inside_known_ones_too() -> None:
    assert errors("[scheduler.tenants.alice]\ntq = 1\n") == [
        f"{SRC}: unknown key scheduler.tenants "
        "(known keys: tq, idle_release, mode, handover_allowance, preempt_after, max_wait, gpu)"
    ]


def test_a_rules_park_is_a_boolean() -> None:
    text = "[[tenants]]\nmatch = {}\npark = false\n[[tenants]]\nmatch = {}\n"
    rules = parse_config(text).settings.tenants
    assert (rules[0].park, rules[1].park) == (False, None)
