"""kiwi-hook: what it tells kiwid, and that it never hangs or fails a container start."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kiwid.core.model import TenantPolicy
from kiwid.hook.main import ContainerInfo, MalformedState, container_info, parse_state

HOOK = [sys.executable, "-m", "kiwid.hook.main"]
CID = "4f2a" * 16

HYBRID_CGROUP = """\
12:freezer:/kubepods/besteffort/pod1234/4f2a
9:name=systemd:/kubepods/besteffort/pod1234/4f2a
1:cpu:/kubepods/besteffort/pod1234/4f2a
0::/kubepods/besteffort/pod1234/4f2a
"""


@dataclass
class FakeKiwid:
    """A control socket that answers each request with a canned reply (or never)."""

    path: Path
    reply: dict[str, Any] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    sock: socket.socket | None = None
    thread: threading.Thread | None = None

    def serve(self, answer: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        self.sock.listen(8)
        if answer:  # else: connections queue up in the backlog, nobody answers
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        assert self.sock is not None
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                req = json.loads(data)
                self.requests.append(req)
                reply = self.reply or {"ok": True, "result": {}}
                conn.sendall(json.dumps({"v": 1, "id": req.get("id"), **reply}).encode() + b"\n")

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        if self.thread is not None:
            self.thread.join(5)


@pytest.fixture
def fake_kiwid(tmp_path: Path) -> Iterator[FakeKiwid]:
    kiwid = FakeKiwid(tmp_path / "kiwid.sock")
    yield kiwid
    kiwid.close()


def make_bundle(root: Path, env: list[str] | None = None, cgroups_path: str = "") -> Path:
    bundle = root / "bundle"
    bundle.mkdir(exist_ok=True)
    config: dict[str, Any] = {"process": {"env": env or ["PATH=/bin"]}, "linux": {}}
    if cgroups_path:
        config["linux"]["cgroupsPath"] = cgroups_path
    (bundle / "config.json").write_text(json.dumps(config))
    return bundle


def run_hook(
    *args: str, state: Any = None, stdin: bytes | None = None, timeout: float = 30
) -> tuple[subprocess.CompletedProcess[str], float]:
    data = stdin if stdin is not None else json.dumps(state).encode()
    start = time.monotonic()
    raw = subprocess.run(
        [*HOOK, *args], input=data, capture_output=True, timeout=timeout, check=False
    )
    elapsed = time.monotonic() - start
    out = subprocess.CompletedProcess(
        raw.args, raw.returncode, raw.stdout.decode(), raw.stderr.decode()
    )
    return out, elapsed


# --- what the hook reads ------------------------------------------------------------


def test_parse_state_accepts_what_runtimes_send() -> None:
    state = parse_state(
        json.dumps(
            {"ociVersion": "1.0.2", "id": CID, "status": "creating", "pid": 42, "bundle": "/b"}
        ).encode()
    )
    assert (state["id"], state["pid"], state["bundle"], state["annotations"]) == (
        CID,
        42,
        "/b",
        {},
    )
    poststop = parse_state(b'{"id": "x", "status": "stopped", "annotations": {"a": "b"}}')
    assert poststop["pid"] is None
    assert poststop["annotations"] == {"a": "b"}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"pid": 1}', "no container 'id'"),
        (b'{"id": ""}', "no container 'id'"),
        (b'{"id": "x", "pid": "1"}', "'pid'"),
        (b'{"id": "x", "pid": true}', "'pid'"),
        (b'{"id": "x", "bundle": 3}', "'bundle'"),
        (b'{"id": "x", "annotations": {"a": 1}}', "'annotations'"),
    ],
)
def test_parse_state_refuses_malformed_states(raw: bytes, words: str) -> None:
    with pytest.raises(MalformedState, match=words):
        parse_state(raw)


def test_container_info_from_proc_cri_annotations_and_kiwi_cdi_env(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text(HYBRID_CGROUP)
    bundle = make_bundle(
        tmp_path,
        env=["PATH=/bin", "KIWI_GPU_1=GPU-b", "KIWI_GPU_0=GPU-a", "NVIDIA_VISIBLE_DEVICES=void"],
        cgroups_path="/ignored/when/proc/knows",
    )
    annotations = {
        "io.kubernetes.cri.container-name": "trainer",
        "io.kubernetes.cri.sandbox-name": "train-7f9",
        "io.kubernetes.cri.sandbox-namespace": "ml",
    }
    state = {"id": CID, "pid": 42, "bundle": str(bundle), "annotations": annotations}

    info = container_info(state, proc=proc)

    assert info == ContainerInfo(
        id=CID,
        pid=42,
        cgroup_v2="/kubepods/besteffort/pod1234/4f2a",
        cgroup_v1_freezer="/kubepods/besteffort/pod1234/4f2a",
        name="trainer",
        pod="train-7f9",
        namespace="ml",
        gpus=("GPU-a", "GPU-b"),
    )
    assert info.register_args(hold=True) == {
        "id": CID,
        "cgroup_v2": "/kubepods/besteffort/pod1234/4f2a",
        "cgroup_v1_freezer": "/kubepods/besteffort/pod1234/4f2a",
        "pid": 42,
        "name": "trainer",
        "pod": "train-7f9",
        "namespace": "ml",
        "gpus": ["GPU-a", "GPU-b"],
        "hold": True,
    }


def test_container_info_with_cri_o_annotations_and_nvidia_env(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, env=["NVIDIA_VISIBLE_DEVICES=GPU-x,GPU-y"])
    annotations = {
        "io.kubernetes.container.name": "server",
        "io.kubernetes.pod.name": "infer-1",
        "io.kubernetes.pod.namespace": "prod",
    }
    state = {"id": CID, "pid": None, "bundle": str(bundle), "annotations": annotations}

    info = container_info(state, proc=tmp_path / "no-proc")

    assert (info.name, info.pod, info.namespace) == ("server", "infer-1", "prod")
    assert info.gpus == ("GPU-x", "GPU-y")
    assert (info.cgroup_v2, info.cgroup_v1_freezer) == (None, None)


def test_device_ids_from_the_device_plugin_annotation_else_its_variable(tmp_path: Path) -> None:
    ids = "GPU-a::1, GPU-b::0,,GPU-a::1"
    bundle = make_bundle(tmp_path, env=["KIWI_GPU_0=GPU-a", "KIWI_DEVICE_IDS=GPU-z::9"])
    state = {"id": CID, "bundle": str(bundle), "annotations": {"kiwi.io/device-ids": ids}}

    info = container_info(state, proc=tmp_path / "no-proc")

    assert info.device_ids == ("GPU-a::1", "GPU-b::0")
    assert info.register_args(hold=False)["device_ids"] == ["GPU-a::1", "GPU-b::0"]
    # containerd passes no such annotation into the OCI state: the variable does it.
    state["annotations"] = {}
    assert container_info(state, proc=tmp_path / "no-proc").device_ids == ("GPU-z::9",)
    # Outside Kubernetes there are none, and register does not mention them.
    bundle = make_bundle(tmp_path, env=["KIWI_GPU_0=GPU-a"])
    info = container_info(state, proc=tmp_path / "no-proc")
    assert info.device_ids == ()
    assert "device_ids" not in info.register_args(hold=False)


@pytest.mark.parametrize(
    ("cgroups_path", "expected"),
    [
        ("/kiwi-test/c1", "/kiwi-test/c1"),
        (
            "kubepods-besteffort-pod12.slice:cri-containerd:4f2a",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12.slice"
            "/cri-containerd-4f2a.scope",
        ),
        ("system.slice:docker:4f2a", "/system.slice/docker-4f2a.scope"),
        (":crio:4f2a", "/crio-4f2a.scope"),
        ("relative/path", None),
        ("", None),
    ],
)
def test_cgroup_from_config_json_when_proc_cannot_tell(
    tmp_path: Path, cgroups_path: str, expected: str | None
) -> None:
    bundle = make_bundle(tmp_path, cgroups_path=cgroups_path)
    state = {"id": CID, "pid": 999999, "bundle": str(bundle), "annotations": {}}

    info = container_info(state, proc=tmp_path / "no-proc")

    assert (info.cgroup_v2, info.cgroup_v1_freezer) == (expected, expected)
    assert info.gpus == ()


def test_a_process_in_the_root_cgroup_has_no_cgroup_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("0::/\n")
    info = container_info({"id": "x", "pid": 7, "annotations": {}}, proc=tmp_path)
    assert (info.cgroup_v2, info.cgroup_v1_freezer) == (None, None)


def test_podman_names_come_from_its_container_store(tmp_path: Path) -> None:
    store = tmp_path / "overlay-containers"
    bundle = store / CID / "userdata"
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text("{}")
    (store / "containers.json").write_text(
        json.dumps([{"id": "other", "names": ["x"]}, {"id": CID, "names": ["notebook"]}])
    )
    podman = {"io.container.manager": "libpod"}
    state = {"id": CID, "pid": None, "bundle": str(bundle), "annotations": podman}

    assert container_info(state, proc=tmp_path).name == "notebook"
    explicit = {**state, "annotations": {"kiwi.io/name": "mine"}}
    assert container_info(explicit, proc=tmp_path).name == "mine"


def policy_info(tmp_path: Path, **annotations: str) -> ContainerInfo:
    keys = {"weight": "kiwi.io/weight", "priority": "kiwi.io/priority", "park": "kiwi.io/park"}
    state = {
        "id": CID,
        "bundle": str(make_bundle(tmp_path, cgroups_path="/k/c")),
        "annotations": {keys[k]: v for k, v in annotations.items()},
    }
    return container_info(state, proc=tmp_path / "no-proc")


def test_the_pods_weight_and_priority_annotations_go_into_register(tmp_path: Path) -> None:
    info = policy_info(tmp_path, weight="2.5", priority="-3")

    assert (info.weight, info.priority, info.problems) == (2.5, -3, ())
    args = info.register_args(hold=True)
    assert (args["weight"], args["priority"]) == (2.5, -3)
    # Either alone; and the usual spellings of numbers.
    assert policy_info(tmp_path, weight="3").register_args(hold=True)["weight"] == 3.0
    assert "priority" not in policy_info(tmp_path, weight="3").register_args(hold=True)
    assert policy_info(tmp_path, priority=" +10 ").priority == 10
    assert policy_info(tmp_path, weight=".5").weight == 0.5
    assert policy_info(tmp_path, weight="2e1").weight == 20.0
    assert "weight" not in policy_info(tmp_path, priority="1").register_args(hold=True)


@pytest.mark.parametrize(
    ("annotation", "value", "words"),
    [
        ("weight", "heavy", "not a positive number"),
        ("weight", "", "not a positive number"),
        ("weight", "0", "not a positive number"),
        ("weight", "-2", "not a positive number"),
        ("weight", "1e-400", "not a positive number"),  # a positive number too small for a float
        ("weight", "nan", "not a positive number"),
        ("weight", "inf", "not a positive number"),
        ("weight", "1_000", "not a positive number"),
        ("weight", "0x10", "not a positive number"),
        ("priority", "high", "not an integer"),
        ("priority", "1.5", "not an integer"),
        ("priority", "1e3", "not an integer"),
        ("priority", "", "not an integer"),
        ("priority", "--1", "not an integer"),
    ],
)
def test_an_annotation_that_does_not_parse_is_left_out_with_a_reason(
    tmp_path: Path, annotation: str, value: str, words: str
) -> None:
    info = policy_info(tmp_path, **{annotation: value})

    assert getattr(info, annotation) is None
    assert annotation not in info.register_args(hold=True)
    (problem,) = info.problems
    assert f"kiwi.io/{annotation}={value!r}" in problem
    assert words in problem


RANGES = {  # the core's words (TenantPolicy), as kiwid's config, register and kiwictl say it
    "weight": "weight must be a number from 0.01 to 1000",
    "priority": "priority must be an integer from -1000 to 1000",
}
REFUSALS = {"weight": TenantPolicy.weight_refusal, "priority": TenantPolicy.priority_refusal}


@pytest.mark.parametrize(
    ("annotation", "value", "read", "sent"),
    [
        ("weight", "5000", 5000.0, 1000.0),
        ("weight", "1000.5", 1000.5, 1000.0),
        ("weight", "1e400", math.inf, 1000.0),  # overflows a float: as large as can be
        ("weight", "0.001", 0.001, 0.01),
        ("priority", "1001", 1001, 1000),
        ("priority", "-5000", -5000, -1000),
        ("priority", "99999999999999999999999", 99999999999999999999999, 1000),
        ("priority", "-" + "9" * 5000, -math.inf, -1000),  # longer than int() takes
    ],
)
def test_an_annotation_out_of_kiwids_range_is_brought_within_it_in_kiwids_words(
    tmp_path: Path, annotation: str, value: str, read: float, sent: float
) -> None:
    info = policy_info(tmp_path, **{annotation: value})

    assert info.register_args(hold=True)[annotation] == sent
    (problem,) = info.problems
    shown = repr(value if len(value) <= 40 else value[:40] + "...")
    # What kiwid would say refusing the number, then what the hook asks for instead.
    refusal = REFUSALS[annotation](read)
    assert refusal is not None and refusal.startswith(f"{RANGES[annotation]}, not ")
    assert problem == f"kiwi.io/{annotation}={shown}: {refusal}; asking for {sent:g}"
    assert len(problem) < 200  # a huge value is cut short in the warning


@pytest.mark.parametrize(("weight", "priority"), [("0.01", "-1000"), ("1000", "1000")])
def test_the_bounds_of_kiwids_range_are_sent_as_they_are(
    tmp_path: Path, weight: str, priority: str
) -> None:
    info = policy_info(tmp_path, weight=weight, priority=priority)

    assert (info.weight, info.priority, info.problems) == (float(weight), int(priority), ())


# --- the hook as the runtime runs it ----------------------------------------------


def test_create_registers_the_container_and_poststop_unregisters_it(
    tmp_path: Path, fake_kiwid: FakeKiwid
) -> None:
    fake_kiwid.reply = {"ok": True, "result": {"tenant": "cgroup:/x", "held": False}}
    fake_kiwid.serve()
    bundle = make_bundle(tmp_path, env=["KIWI_GPU_0=GPU-a"], cgroups_path="/kiwi-test/c1")
    state = {"id": CID, "pid": 999999, "bundle": str(bundle), "annotations": {}}
    sock = str(fake_kiwid.path)

    out, _ = run_hook("--socket", sock, "--admission", "none", "create", state=state)
    assert (out.returncode, out.stderr) == (0, "")
    stopped = {"id": CID, "status": "stopped", "bundle": str(bundle)}
    out, _ = run_hook("--socket", sock, "poststop", state=stopped)
    assert (out.returncode, out.stderr) == (0, "")

    register, unregister = fake_kiwid.requests
    assert register["cmd"] == "register"
    assert register["args"] == {
        "id": CID,
        "cgroup_v2": "/kiwi-test/c1",
        "cgroup_v1_freezer": "/kiwi-test/c1",
        "pid": 999999,
        "name": None,
        "pod": None,
        "namespace": None,
        "gpus": ["GPU-a"],
        "hold": False,
    }
    assert unregister == {"v": 1, "id": 1, "cmd": "unregister", "args": {"id": CID}}


def test_a_bad_annotation_is_warned_about_and_the_container_still_registers(
    tmp_path: Path, fake_kiwid: FakeKiwid
) -> None:
    fake_kiwid.reply = {"ok": True, "result": {"tenant": "cgroup:/k/c", "held": False}}
    fake_kiwid.serve()
    annotations = {"kiwi.io/weight": "lots", "kiwi.io/priority": "5000"}
    bundle = make_bundle(tmp_path, cgroups_path="/k/c")
    state = {"id": CID, "bundle": str(bundle), "annotations": annotations}

    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", state=state)

    assert out.returncode == 0
    weight_line, priority_line = out.stderr.splitlines()
    assert weight_line.startswith("kiwi-hook: warning: ")
    assert f"container {CID}" in weight_line
    assert "kiwi.io/weight='lots'" in weight_line
    assert "kiwi.io/priority='5000': priority must be an integer from -1000" in priority_line
    (register,) = fake_kiwid.requests
    assert "weight" not in register["args"]
    assert register["args"]["priority"] == 1000


def test_hold_is_the_default_admission(tmp_path: Path, fake_kiwid: FakeKiwid) -> None:
    fake_kiwid.reply = {"ok": True, "result": {"tenant": "cgroup:/x", "held": True}}
    fake_kiwid.serve()
    state = {"id": CID, "bundle": str(make_bundle(tmp_path, cgroups_path="/k/c"))}

    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", state=state)

    assert out.returncode == 0
    assert fake_kiwid.requests[0]["args"]["hold"] is True


@pytest.mark.serial
def test_with_kiwid_down_the_container_starts_ungated_with_a_warning(tmp_path: Path) -> None:
    state = {"id": CID, "pid": 1, "bundle": str(make_bundle(tmp_path))}

    for action in ("create", "poststop"):
        out, elapsed = run_hook("--socket", str(tmp_path / "absent.sock"), action, state=state)
        assert out.returncode == 0
        assert "warning" in out.stderr
        assert "ungated" in out.stderr
        assert "absent.sock" in out.stderr
        assert elapsed < 5


@pytest.mark.serial
def test_a_hung_kiwid_costs_at_most_the_timeout(tmp_path: Path, fake_kiwid: FakeKiwid) -> None:
    fake_kiwid.serve(answer=False)  # accepts into the backlog, never answers
    state = {"id": CID, "pid": 1, "bundle": str(make_bundle(tmp_path))}

    out, elapsed = run_hook(
        "--socket", str(fake_kiwid.path), "--timeout", "1", "create", state=state
    )

    assert out.returncode == 0
    assert "did not answer" in out.stderr or "no answer" in out.stderr
    assert 1 <= elapsed < 4  # the limit, plus Python's start-up


@pytest.mark.serial
def test_a_stdin_that_never_ends_costs_at_most_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = subprocess.Popen(
        [*HOOK, "--socket", str(tmp_path / "k.sock"), "--timeout", "1", "create"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None
        proc.stdin.write('{"id": "half')
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
    assert proc.stderr is not None
    assert "ungated" in proc.stderr.read()
    proc.stderr.close()
    assert elapsed < 4


@pytest.mark.parametrize("stdin", [b"", b"not json", b'{"pid": 5}', b"\xff"])
def test_a_malformed_state_never_fails_the_container(
    tmp_path: Path, fake_kiwid: FakeKiwid, stdin: bytes
) -> None:
    fake_kiwid.serve()

    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", stdin=stdin)

    assert out.returncode == 0
    assert "warning" in out.stderr
    assert "runs without Kiwi" in out.stderr
    assert fake_kiwid.requests == []


def test_kiwid_refusing_is_logged_and_the_container_still_starts(
    tmp_path: Path, fake_kiwid: FakeKiwid
) -> None:
    fake_kiwid.reply = {
        "ok": False,
        "error": {"code": "invalid-value", "message": "no GPU '9' on this node"},
    }
    fake_kiwid.serve()
    state = {"id": CID, "bundle": str(make_bundle(tmp_path, cgroups_path="/k/c"))}

    out, _ = run_hook("--socket", str(fake_kiwid.path), "create", state=state)

    assert out.returncode == 0
    assert "invalid-value" in out.stderr
    assert "no GPU '9'" in out.stderr


def test_usage(tmp_path: Path, fake_kiwid: FakeKiwid) -> None:
    out, _ = run_hook(state={"id": "x"})
    assert out.returncode == 2
    out, _ = run_hook("destroy", state={"id": "x"})
    assert out.returncode == 2
    out, _ = run_hook("--help", state={"id": "x"})
    assert out.returncode == 0
    assert "poststop" in out.stdout

    # A newer spec's options do not break an older hook; a silly timeout is replaced.
    fake_kiwid.serve()
    state = {"id": "x", "bundle": str(make_bundle(tmp_path, cgroups_path="/k/c"))}
    out, _ = run_hook(
        "--socket", str(fake_kiwid.path), "--timeout", "0", "--future", "create", state=state
    )
    assert out.returncode == 0
    assert "--future" in out.stderr
    assert "out of range" in out.stderr
    assert len(fake_kiwid.requests) == 1


def test_the_pods_park_annotation_goes_into_register_and_a_wrong_one_is_named(
    tmp_path: Path,
) -> None:
    assert policy_info(tmp_path, park="false").register_args(hold=False)["park"] is False
    assert policy_info(tmp_path, park=" True ").register_args(hold=False)["park"] is True
    assert "park" not in policy_info(tmp_path).register_args(hold=False)
    wrong = policy_info(tmp_path, park="no")
    assert wrong.park is None and "park" not in wrong.register_args(hold=False)
    assert wrong.problems == ('ignoring kiwi.io/park=\'no\': not "true" or "false"',)
