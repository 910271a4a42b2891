"""Stand-ins for foreign libraries, importable under their real names.

Put this directory first on ``PYTHONPATH`` and ``import pynvml`` gets
:mod:`tests.stand_ins.pynvml`; that is how a real ``python -m kiwid`` in a test
runs its NVML backend on a machine without a GPU.

The driver double stands in for ``libcuda.so.1``'s checkpoint API, so that a
real kiwid runs its CUDA lock gate and checkpoint swaps too:
``libcuda_standin.c`` (the C library, with the layout of its state directory),
:mod:`tests.stand_ins.cudadir` (that layout for Python; the stand-in pynvml
shows a device whose ``"cuda"`` names such a directory),
:mod:`tests.stand_ins.cuda_tenant` (a program whose processes "use the GPU")
and :mod:`tests.stand_ins.cudadouble` (build, configure, inject faults, start
tenants).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DIRECTORY = Path(__file__).resolve().parent
"""Put this first on ``PYTHONPATH`` to import the stand-ins by their real names."""
NVML_MACHINE = "KIWI_STANDIN_NVML"
"""The environment variable naming the stand-in pynvml's machine file (JSON)."""


def write_machine(path: Path, machine: dict[str, Any]) -> None:
    """Write the stand-in pynvml's machine file atomically (temporary file, then rename).

    See :mod:`tests.stand_ins.pynvml` for its keys. A process that has NVML
    loaded sees the new machine at its next NVML call.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(machine, indent=1))
    os.replace(tmp, path)
