"""The trainer's unswapped reference: two runs alone, ungated, before kiwid starts.

Both have the trainer tenant's own command line (``KIWI_BENCH_REFERENCE=1`` says
which) and run one cycle at the same time, while the other tenants only import
torch. Two, so that a training that is not deterministic on its own (a kernel of
the installed torch that is not, whatever ``use_deterministic_algorithms`` says) is
told apart from a swap that changed it: the rotated run is compared only when the
two unswapped runs agree to the bit.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from enforcement import BenchError, log
from swap_logs import read_worker_log

CUBLAS_WORKSPACE = ":4096:8"  # deterministic cuBLAS (the trainer's loss curve to the bit)


def run_references(argv: Sequence[str], outdir: Path, timeout_s: float) -> tuple[Path, Path]:
    """Run the two references; their loss logs.

    Raises:
        BenchError: one failed or took longer than ``timeout_s``.
    """
    paths = (outdir / "reference-losses.txt", outdir / "reference-losses-2.txt")
    t = time.monotonic()
    procs = []
    for path in paths:
        env = dict(
            os.environ,
            KIWI_BENCH_REFERENCE="1",
            KIWI_BENCH_OUT=str(path),
            KIWI_BENCH_PARENT=str(os.getpid()),
            CUBLAS_WORKSPACE_CONFIG=CUBLAS_WORKSPACE,
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                list(argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, t + timeout_s - time.monotonic()))
            outputs.append(out.strip())
            if proc.returncode != 0:
                raise BenchError(
                    f"the unswapped reference training failed ({proc.returncode}): {out[-400:]}"
                )
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"the unswapped reference training took over {timeout_s:g} s") from exc
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    ref = read_worker_log(paths[0])
    log(
        f"  reference training (2 unswapped runs, before kiwid): {len(ref.losses)} steps in "
        f"{time.monotonic() - t:.1f} s ({outputs[0].splitlines()[-1:]}); model {ref.model}"
    )
    return paths
