"""A real kiwid on its NVML backend, over the stand-in pynvml, rotating real processes.

``python -m kiwid`` runs with ``[gpu] backend = "nvml"`` and
``tests/stand_ins`` first on ``PYTHONPATH``, so it imports the stand-in pynvml
(nvidia-ml-py's shapes over a simulated libnvidia-ml). The simulated H200 lists
two busy processes, each in a cgroup of its own, as ``live``: the stand-in
samples them while they run and not while the freezer holds them, as the real
driver did on the H200.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.daemon.conftest import config_text, wait_for
from tests.stand_ins import DIRECTORY, NVML_MACHINE, write_machine

UUID = "GPU-aa0caf94-3e4a-fc56-e823-bae2d7d0090a"


def nvml_config(workdir: Path, **kw: Any) -> str:
    text = config_text(workdir, **kw)
    assert 'backend = "sim"' in text
    return text.replace('backend = "sim"', 'backend = "nvml"')


def h200(*pids: int, **extra: Any) -> dict[str, Any]:
    """The machine file: one H200 whose compute processes are the given real PIDs."""
    processes = [{"pid": pid, "usedGpuMemory": 3198156800, "live": True} for pid in pids]
    gpu = {"uuid": UUID, "name": "NVIDIA H200", "memory": {"total": 150754820096}}
    return {"devices": [{**gpu, "processes": processes, **extra}]}


def test_nvml_backend_rotates_two_busy_tenants(start_kiwid, tenants, workdir) -> None:
    a, b = tenants("a"), tenants("b")
    machine = workdir / "nvml.json"
    write_machine(machine, h200(a.pid, b.pid))
    (workdir / "kiwi.toml").write_text(nvml_config(workdir, tq=1, idle_release=0.5, poll=0.05))
    path = os.pathsep.join(filter(None, [str(DIRECTORY), os.environ.get("PYTHONPATH")]))
    k = start_kiwid(env={"PYTHONPATH": path, NVML_MACHINE: str(machine)})

    gpu = k.status()["gpus"][0]
    assert (gpu["uuid"], gpu["name"], gpu["memory_total_bytes"]) == (
        UUID,
        "NVIDIA H200",
        150754820096,
    )
    names = {a.key: "a", b.key: "b"}

    def holder() -> str | None:
        h = k.status()["gpus"][0]["holder"]
        return names.get(h["tenant"]) if h else None

    def runs_alone() -> str | None:
        """The one tenant not frozen while the other is, or None."""
        frozen = (a.frozen(), b.frozen())
        return {(False, True): "a", (True, False): "b"}.get(frozen)

    # One runs, the other is frozen, and with TQ 1 s they swap, and swap back.
    order: list[str] = []
    deadline = time.monotonic() + 8
    while len(order) < 3 and time.monotonic() < deadline:
        alone = runs_alone()
        if alone is not None and alone == holder() and (not order or order[-1] != alone):
            order.append(alone)
        assert not (a.proc.poll() or b.proc.poll())
        time.sleep(0.02)
    assert len(order) == 3, f"no rotation within 8 s: {order}\n{k.log_text()}"
    assert order[0] != order[1] != order[2]

    # The GPU falls off the bus: kiwid marks it unhealthy and stops gating it.
    write_machine(machine, h200(a.pid, b.pid, errors={"*": "GPU_IS_LOST"}))
    wait_for(lambda: not k.status()["gpus"][0]["healthy"], 5, "the GPU to be unhealthy")
    wait_for(lambda: not a.frozen() and not b.frozen(), 5, "both tenants to be let go")
    k.wait_log("GPU 0 is lost")
    assert k.stop() == 0


def test_a_gpu_that_fails_a_query_keeps_its_tenants_and_kiwid_runs_on(
    start_kiwid, tenants, workdir
) -> None:
    a, b = tenants("a"), tenants("b")
    machine = workdir / "nvml.json"
    write_machine(machine, h200(a.pid, b.pid))
    (workdir / "kiwi.toml").write_text(nvml_config(workdir, tq=30, poll=0.05))
    path = os.pathsep.join(filter(None, [str(DIRECTORY), os.environ.get("PYTHONPATH")]))
    k = start_kiwid(env={"PYTHONPATH": path, NVML_MACHINE: str(machine)})
    wait_for(lambda: a.frozen() != b.frozen(), 5, "one to run, one to wait")
    waiting = a if a.frozen() else b
    # A driver that stops answering the utilisation query (a passing fault, or a
    # card that does not support it): not a lost GPU, and no reason to stop.
    errors = {"nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED"}
    write_machine(machine, h200(a.pid, b.pid, errors=errors))
    k.wait_log("Cannot read GPU 0 this time")
    assert k.proc.poll() is None
    assert waiting.frozen(), "its tenants keep their state"
    assert k.status()["gpus"][0]["healthy"]
    write_machine(machine, h200(a.pid, b.pid))
    k.wait_log("GPU 0 answers again")
    assert k.log_text().count("Cannot read GPU 0 this time") == 1
    assert k.stop() == 0
