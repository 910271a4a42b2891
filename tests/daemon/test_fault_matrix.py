"""The fault matrix, short: every driver fault against every operation, once each.

This runs bench/driver_faults.py's own matrix (its rig, runs, operator and
judge, imported, not copied) with one run per cell: a real kiwid on the driver
double (``backend = "nvml"``, ``gate = "cuda-lock"``, ``swap = "checkpoint"``),
four real CUDA tenants in cgroups of their own, one of two processes, on a card
they do not all fit; and the same on the simulated GPU with ``sim-fault`` and
the cgroup freezer. It asserts what the bench counts: no two tenants running
at once outside a hand-over, every tenant's memory on the card or recorded
(and back after ``kiwid recover``), the others' turns while one is stuck, no
traceback, and every stuck tenant brought back by the operator's word. The
judge itself is tested on made-up samples in tests/bench/test_fault_judge.py.

The bench cleans up whatever happens (kiwid stopped, the state recovered, every
cgroup thawed and removed, every tenant killed); a run that finds something
keeps kiwid's logs and names them in the failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stand_ins.cudadouble import NoCompiler, build_library

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is no package: its modules import each other

import driver_faults  # noqa: E402
from _faults_rig import sweep_leftovers  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it makes and freezes cgroups"),
]


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Whatever a bench that was cut short left (with no process in it) is thawed and removed."""
    yield
    sweep_leftovers()


def explain(rep: dict) -> str:
    return driver_faults.table(rep) + "\n" + driver_faults.describe(rep)


def cleaned_up(rep: dict) -> None:
    assert rep["cleanup"] == [], rep["cleanup"]
    assert not Path(rep["cgroup"]).exists(), f"{rep['cgroup']} left behind"


@pytest.mark.timeout(900)
def test_every_fault_against_every_operation_on_the_driver_double(tmp_path: Path) -> None:
    try:
        build_library(tmp_path)
    except NoCompiler as err:
        pytest.skip(str(err))
    opts = driver_faults.Options(
        seed=11,
        runs_per_cell=1,
        kill_every=8,
        react_s=(0.5, 1.5),
        driver_timeout=1.0,
        budget_s=600,
    )
    rep = driver_faults.run_matrix(opts, say=lambda line: None)
    cleaned_up(rep)
    assert driver_faults.violations(rep) == 0, explain(rep)
    assert rep["skipped"] == 0, explain(rep)
    rows = [row for key, row in rep["cells"].items() if key != driver_faults.RESTARTS]
    assert len(rows) == len(driver_faults.all_cells(sim=False))
    assert all(row["runs"] == 1 for row in rows)
    ended = {e: sum(row["endings"][e] for row in rows) for e in driver_faults.ENDINGS}
    # The operator's three ways out each ran (a matrix where nothing got stuck
    # would prove nothing about them).
    assert ended["mended"] and ended["released"] and ended["recovered"], (ended, explain(rep))
    assert rep["figures"]["kills"] >= 4
    assert rep["cells"][driver_faults.RESTARTS]["runs"] == rep["figures"]["kills"]


@pytest.mark.timeout(400)
def test_the_sim_faults_against_checkpoint_and_restore_with_the_freezer() -> None:
    opts = driver_faults.Options(
        seed=5,
        runs_per_cell=2,
        sim=True,
        kill_every=4,
        react_s=(0.5, 1.5),
        driver_timeout=1.0,
        budget_s=200,
    )
    rep = driver_faults.run_matrix(opts, say=lambda line: None)
    cleaned_up(rep)
    assert driver_faults.violations(rep) == 0, explain(rep)
    assert rep["skipped"] == 0, explain(rep)
    rows = [row for key, row in rep["cells"].items() if key != driver_faults.RESTARTS]
    assert len(rows) == 6 and all(row["runs"] == 2 for row in rows)
    ended = {e: sum(row["endings"][e] for row in rows) for e in driver_faults.ENDINGS}
    assert ended["mended"] and ended["released"], (ended, explain(rep))
