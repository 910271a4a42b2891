"""The fault matrix, sampled: a few of its cells in each run, every cell over runs.

This runs bench/driver_faults.py's own matrix (its rig, runs, operator and
judge, imported, not copied): a real kiwid on the driver double (``backend =
"nvml"``, ``gate = "cuda-lock"``, ``swap = "checkpoint"``), four real CUDA
tenants in cgroups of their own, one of two processes, on a card they do not all
fit; and the same on the simulated GPU with ``sim-fault`` and the cgroup freezer.
It asserts what the bench counts: no two tenants running at once outside a
hand-over, every tenant's memory on the card or recorded (and back after ``kiwid
recover``), the others' turns while one is stuck, no traceback, and every stuck
tenant brought back by the operator's word. The judge itself is tested on
made-up samples in tests/bench/test_fault_judge.py.

The whole matrix (45 cells on the double, 6 on the sim, about 10 minutes for one
run of each) is the bench command, bench/driver_faults.py (bench/README.md).
Each test run takes a sample: the cells are split into fixed slices (every
``stride``-th cell, so that a slice mixes operations and kinds), and a run takes
the slice of its *round*, the number of commits on HEAD (the days since
1970-01-01 where git or the history is missing, e.g. a shallow clone): each new
commit tests the next slice, and every cell is run within ``stride`` successive
commits (8 on the double, 3 on the sim). The round also seeds the runs' random
moments. The cells that ran, the round and how to run them again are in the
summary at the end of pytest's output (and in a failure's message):
``KIWI_FAULT_MATRIX_ROUND=N`` runs round N's sample again, ``KIWI_FAULT_MATRIX_ROUND=all``
the whole matrix, once per cell.

The bench cleans up whatever happens (kiwid stopped, the state recovered, every
cgroup thawed and removed, every tenant killed); a run that finds something
keeps kiwid's logs and names them in the failure. The two tests run on one
xdist worker, one after the other: each sweeps what a killed bench left behind.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.stand_ins.cudadouble import NoCompiler, build_library

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is no package: its modules import each other

import driver_faults  # noqa: E402
from _faults_rig import sweep_leftovers  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cgroups,  # the tenants run in cgroups of their own, frozen by kiwid
    pytest.mark.xdist_group("fault-matrix"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it makes and freezes cgroups"),
]

ROUND_VARIABLE = "KIWI_FAULT_MATRIX_ROUND"
DOUBLE_CELLS_PER_RUN = 6  # of 45: every cell within 8 successive rounds
SIM_CELLS_PER_RUN = 2  # of 6: every cell within 3


@dataclass(frozen=True)
class Round:
    """Which slice of the matrix this run takes (``number`` None: the whole matrix)."""

    number: int | None
    source: str

    def sample(self, cells: list[tuple[str, str]], per_run: int) -> list[tuple[str, str]]:
        """Round ``number``'s slice: every ``stride``-th cell, from ``number % stride``."""
        if self.number is None:
            return cells
        stride = math.ceil(len(cells) / per_run)
        return cells[self.number % stride :: stride]

    def seed(self, whole: int) -> int:
        return whole if self.number is None else self.number


def this_round() -> Round:
    """The round: ``$KIWI_FAULT_MATRIX_ROUND``, else the commits on HEAD, else the date."""
    given = os.environ.get(ROUND_VARIABLE, "").strip()
    if given == "all":
        return Round(None, f"{ROUND_VARIABLE}=all")
    if given:
        return Round(int(given), f"{ROUND_VARIABLE}={given}")
    git = ["git", "-C", str(REPO)]
    try:
        shallow = subprocess.run(
            [*git, "rev-parse", "--is-shallow-repository"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        count = subprocess.run(
            [*git, "rev-list", "--count", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        count = None
    if count is not None and count.returncode == 0 and shallow.stdout.strip() == "false":
        return Round(int(count.stdout), "the commits on HEAD")
    days = (datetime.datetime.now(datetime.UTC).date() - datetime.date(1970, 1, 1)).days
    return Round(days, "the days since 1970-01-01 (no git history here)")


def cell_names(cells: list[tuple[str, str]]) -> str:
    return ",".join(f"{op}/{kind}" for op, kind in cells)


def ran(which: Round, opts: driver_faults.Options) -> str:
    """What ran, and how to run it again (here, and with the bench)."""
    number = "all" if which.number is None else which.number
    bench = (
        f"PYTHONPATH=$PWD .venv/bin/python bench/driver_faults.py{' --sim' if opts.sim else ''}"
        f" --cells '{opts.cells}' --runs-per-cell {opts.runs_per_cell} --seed {opts.seed}"
        f" --kill-every {opts.kill_every} --driver-timeout {opts.driver_timeout:g}"
        f" --react {opts.react_s[0]:g} {opts.react_s[1]:g}"
    )
    return (
        f"round {number} (from {which.source}): {opts.cells}; again: "
        f"{ROUND_VARIABLE}={number} scripts/test {__file__.removeprefix(str(REPO) + '/')}, "
        f"or {bench}"
    )


def run_sample(
    sim: bool, per_run: int, runs_per_cell: int, kill_every: int, whole_seed: int, record
) -> tuple[dict, Round]:
    which = this_round()
    cells = which.sample(driver_faults.all_cells(sim=sim), per_run)
    runs = len(cells) * runs_per_cell
    opts = driver_faults.Options(
        seed=which.seed(whole_seed),
        runs_per_cell=runs_per_cell,
        cells=cell_names(cells),
        sim=sim,
        kill_every=min(kill_every, runs),  # a sample kills kiwid at least once too
        react_s=(0.5, 1.5),
        driver_timeout=1.0,
        budget_s=60 + 20 * runs,
    )
    record("note", ran(which, opts))
    rep = driver_faults.run_matrix(opts, say=lambda line: None)
    rep["ran"] = ran(which, opts)
    return rep, which


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Whatever a bench that was cut short left (with no process in it) is thawed and removed."""
    yield
    sweep_leftovers()


def explain(rep: dict) -> str:
    return rep["ran"] + "\n" + driver_faults.table(rep) + "\n" + driver_faults.describe(rep)


def cleaned_up(rep: dict) -> None:
    assert rep["cleanup"] == [], rep["cleanup"]
    assert not Path(rep["cgroup"]).exists(), f"{rep['cgroup']} left behind"


def endings(rep: dict) -> dict[str, int]:
    rows = [row for key, row in rep["cells"].items() if key != driver_faults.RESTARTS]
    return {e: sum(row["endings"][e] for row in rows) for e in driver_faults.ENDINGS}


@pytest.mark.timeout(900)
def test_every_fault_against_every_operation_on_the_driver_double(
    tmp_path: Path, record_property
) -> None:
    try:
        build_library(tmp_path)
    except NoCompiler as err:
        pytest.skip(str(err))
    rep, which = run_sample(
        sim=False,
        per_run=DOUBLE_CELLS_PER_RUN,
        runs_per_cell=1,
        kill_every=8,
        whole_seed=11,
        record=record_property,
    )
    cleaned_up(rep)
    assert driver_faults.violations(rep) == 0, explain(rep)
    assert rep["skipped"] == 0, explain(rep)
    rows = [row for key, row in rep["cells"].items() if key != driver_faults.RESTARTS]
    want = which.sample(driver_faults.all_cells(sim=False), DOUBLE_CELLS_PER_RUN)
    assert len(rows) == len(want), explain(rep)
    assert all(row["runs"] == 1 for row in rows), explain(rep)
    assert rep["figures"]["kills"] >= (4 if which.number is None else 1), explain(rep)
    assert rep["cells"][driver_faults.RESTARTS]["runs"] == rep["figures"]["kills"]
    if which.number is None:
        # The operator's three ways out each ran (a matrix where nothing got stuck
        # would prove nothing about them); a sample of a few cells may need none.
        ended = endings(rep)
        assert ended["mended"] and ended["released"] and ended["recovered"], explain(rep)


@pytest.mark.timeout(400)
def test_the_sim_faults_against_checkpoint_and_restore_with_the_freezer(record_property) -> None:
    rep, which = run_sample(
        sim=True,
        per_run=SIM_CELLS_PER_RUN,
        runs_per_cell=2,
        kill_every=4,
        whole_seed=5,
        record=record_property,
    )
    cleaned_up(rep)
    assert driver_faults.violations(rep) == 0, explain(rep)
    assert rep["skipped"] == 0, explain(rep)
    rows = [row for key, row in rep["cells"].items() if key != driver_faults.RESTARTS]
    want = which.sample(driver_faults.all_cells(sim=True), SIM_CELLS_PER_RUN)
    assert len(rows) == len(want) and all(row["runs"] == 2 for row in rows), explain(rep)
    if which.number is None:
        ended = endings(rep)
        assert ended["mended"] and ended["released"], explain(rep)
