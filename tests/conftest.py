"""What the whole suite shares: how it runs in parallel, and the stand-in libcuda.

``scripts/test`` runs the suite in two parts (``--part``, see ``pytest --help``):

* ``parallel``: every test not marked ``serial``, spread over pytest-xdist workers
  (``-n auto --dist loadfile``). The tests of one file run on one worker, in file
  order (e.g. tests/deploy/test_rollout.py, whose tests share one fleet and each
  leaves it as the next expects). Not ``--dist loadgroup``: pytest-xdist 3.8 tags a
  grouped test by setting ``item._nodeid``, which pytest 9 no longer reads, so its
  ``xdist_group`` marks group nothing and such a file's tests were spread over
  workers, each with a fleet of its own. The long ones are sent first, so
  that no worker starts a minutes-long test at the end while the others idle.
* ``serial``: the tests marked ``serial``, one after the other in one process, with
  no other test running: each measures time (shares of the GPU over a minute, a
  hand-over within a second, an answer within two seconds), and a test beside it,
  with its own busy tenants on a 2-core machine, would change what it measures.

Without ``--part`` every selected test runs (as a plain ``pytest`` always did);
under xdist the ``serial`` ones then at least run on one worker, one at a time.

A test is marked ``cgroups`` here when it makes real cgroups through one of the
fixtures in :data:`CGROUP_FIXTURES` (or is marked so by hand): these are the tests
that depend on the cgroup hierarchy, which tests/deploy/test_pure_cgroup2.py runs
on a pure-cgroup2 host.

A test's ``record_property("note", text)`` is printed in the summary at the end of
the run (under xdist too, where a passing test's output is not): e.g. which cells
of the fault matrix this run sampled, and how to run them again.

``cuda_library`` is the stand-in ``libcuda.so.1`` (``tests/stand_ins``), compiled
once per session (once per xdist worker) rather than once per test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.stand_ins.cudadouble import NoCompiler, build_library

PARTS = ("parallel", "serial")
CGROUP_FIXTURES = frozenset(
    {"tenants", "card", "sandbox", "layout", "cgroup", "freezer", "test_cgroup"}
)
"""Fixtures that make real cgroups (or find the hierarchies to make them in):
tests/daemon/conftest.py's ``tenants`` and the driver double's ``card`` (its tenants
in cgroups of their own), tests/adapters/conftest.py's ``sandbox`` and ``layout``,
tests/adapters/test_sim.py's ``freezer``, tests/daemon/test_follow_memory.py's
``cgroup`` and tests/daemon/test_containers_e2e.py's ``test_cgroup`` (containers')."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=PARTS,
        default=None,
        help="parallel: leave out the tests marked serial; serial: only those "
        "(scripts/test runs both, in turn); default: every test",
    )


def _under_xdist(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no"


def _rank(item: pytest.Item) -> int:
    """The order in which xdist hands out work: the longest first (see the module doc)."""
    if item.get_closest_marker("slow") is None:
        return 2
    return 0 if item.nodeid.startswith("tests/deploy/") else 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if CGROUP_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cgroups)
    part = config.getoption("part")
    if part is not None:
        keep, left_out = [], []
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            (keep if serial == (part == "serial") else left_out).append(item)
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = keep
    if _under_xdist(config):
        for item in items:
            if item.get_closest_marker("serial") is not None:
                item.add_marker(pytest.mark.xdist_group("serial"))
        # Every worker sorts the same collection the same way: xdist checks that.
        items.sort(key=_rank)


_notes: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _notes.extend(f"{report.nodeid}: {v}" for k, v in report.user_properties if k == "note")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _notes:
        terminalreporter.section("notes")
        for note in _notes:
            terminalreporter.line(note)


@pytest.fixture(scope="session")
def cuda_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in libcuda.so.1, built once (skips without a C compiler)."""
    try:
        return build_library(tmp_path_factory.mktemp("cudadouble"))
    except NoCompiler as err:
        pytest.skip(str(err))
