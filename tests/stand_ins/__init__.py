"""Stand-ins for foreign libraries, importable under their real names.

Put this directory first on ``PYTHONPATH`` and ``import pynvml`` gets
:mod:`tests.stand_ins.pynvml`; that is how a real ``python -m kiwid`` in a test
runs its NVML backend on a machine without a GPU.
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
