"""bench/gpu/swap.py's state_dir handling, identities and kiwid config passthrough."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package: its modules import each other

import swap_args  # noqa: E402
import swap_host  # noqa: E402
import swap_state  # noqa: E402


def test_a_new_run_empties_the_benchs_own_state_dir(tmp_path):
    state = tmp_path / "bench" / "state"
    state.mkdir(parents=True)
    (state / "footprints.json").write_text("{}")
    (state / "sub").mkdir()
    lines = swap_state.prepare(state, keep=False, bench_root=tmp_path / "bench")
    assert swap_state.listing(state) == []
    assert "emptied (footprints.json, sub)" in lines[0]


def test_keep_state_leaves_it_and_counts_what_the_bench_ran(tmp_path):
    state = tmp_path / "state"
    swap_state.record(state, [("/usr/bin/python3 w.py --seed 0", 10), ("/usr/bin/python3 t.py", 5)])
    swap_state.record(state, [("/usr/bin/python3 w.py --seed 0", 12)])
    (state / "footprints.json").write_text("{}")  # kiwid's
    lines = swap_state.prepare(state, keep=True, bench_root=tmp_path / "elsewhere")
    assert swap_state.listing(state) == ["footprints.json", swap_state.LEDGER]
    assert "has seen 2 workload(s)" in lines[0]
    ledger = swap_state.read_ledger(state)
    assert ledger["/usr/bin/python3 w.py --seed 0"] == {"runs": 2, "bytes": 12}


def test_a_foreign_state_dir_is_never_emptied(tmp_path):
    state = tmp_path / "run-kiwi-state"
    state.mkdir()
    (state / "state.json").write_text("{}")
    with pytest.raises(swap_state.StateDirError, match="not the bench's"):
        swap_state.prepare(state, keep=False, bench_root=tmp_path / "bench")
    assert (state / "state.json").exists()


def test_identity_is_exe_and_arguments():
    ident = swap_state.identity(os.getpid())
    assert ident is not None
    assert ident.startswith(os.readlink(f"/proc/{os.getpid()}/exe") + " ")
    assert swap_state.identity(2**22 + 12345) is None


def test_lanes_and_newcomer_reach_kiwids_config_only_when_given(tmp_path):
    plain = tomllib.loads(swap_host.config_text(30, backend="sim", gate=None))
    assert "checkpoint_lanes" not in plain["memory"] and "newcomer" not in plain["memory"]
    text = swap_host.config_text(
        30,
        backend="nvml",
        gate="cuda-lock",
        state_dir=tmp_path / "s",
        checkpoint_lanes=2,
        newcomer="free",
    )
    doc = tomllib.loads(text)
    assert doc["memory"]["checkpoint_lanes"] == 2
    assert doc["memory"]["newcomer"] == "free"
    assert doc["daemon"]["state_dir"] == str(tmp_path / "s")


def test_options_scale_for_a_rehearsal_and_add_the_trainer():
    args = swap_args.parse(["--rehearse", "--tenants", "2", "--torch-tenant", "--keep-state"])
    assert (args.gib, args.torch_gib, args.tq) == (4.75, 4.75, 5.0)
    assert args.overhead_gib == pytest.approx(0.15)
    plan = "\n".join(swap_args.plan_lines(args))
    assert "2 tenants x 4.75 GiB ballast + a PyTorch trainer with 4.75 GiB" in plan
    assert "kept from an earlier run" in plan
    args = swap_args.parse(["--checkpoint-lanes", "2", "--newcomer", "whole-card"])
    assert (
        "memory.checkpoint_lanes = 2, memory.newcomer = 'whole-card'"
        in swap_args.plan_lines(args)[0]
    )
