"""The analysis of bench/gpu/swap.py (the H200 swap check), on made-up logs: no GPU, no kiwid."""

from __future__ import annotations

import sys
from pathlib import Path

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))  # bench/gpu is no package: its modules import each other

import swap_analysis  # noqa: E402
import swap_dry  # noqa: E402
import swap_logs  # noqa: E402
import swap_report  # noqa: E402

NAMES = {"kiwigpu-bench-1": "w1", "kiwigpu-bench-10": "w10"}


def test_kiwid_lines_name_the_worker_in_either_form():
    rest = " in 2.39 s (2.20 GB/s)"
    lines = [
        (
            1.0,
            "[INFO] Swapped out /kiwigpu-bench-1 (cgroup:/kiwigpu-bench-1): 5261334937 bytes"
            + rest,
        ),
        (2.0, "[INFO] Swapped in cgroup:/kiwigpu-bench-10: 1000 bytes in 0.50 s (0.00 GB/s)"),
        (3.0, "[INFO] Grant: /kiwigpu-bench-10 (cgroup:/kiwigpu-bench-10) holds GPU 0 (its turn)"),
        (4.0, "[ERROR] Swap failed: in of cgroup:/kiwigpu-bench-1: CUDA_ERROR_OUT_OF_MEMORY"),
        (5.0, "[WARNING] Swap out of cgroup:/other (cgroup:/other) not done: host RAM floor: ..."),
        (6.0, "[INFO] New TQ = 20"),
    ]
    events = swap_logs.parse_kiwid(lines, NAMES)
    assert [(e.kind, e.who) for e in events] == [
        ("swap-out", "w1"),
        ("swap-in", "w10"),
        ("grant", "w10"),
        ("swap-failed", "w1"),
        ("swap-refused", "cgroup:/other (cgroup:/other)"),
    ]
    assert events[0].nbytes == 5261334937
    assert events[0].seconds == 2.39
    assert round(events[0].gbps, 2) == 2.20  # recomputed from bytes and seconds


def test_worker_log_survives_a_line_cut_by_sigkill():
    text = "alloc 1.0 2.0 100 3\np 2.0 0\nverify 2.0 2.1 0 100 1\np 3.0 10\np 9.0 11\nverify 9.0 9"
    log = swap_logs.parse_worker_log(text)
    assert log.alloc == (1.0, 2.0, 100, 3)
    assert log.points == [(2.0, 0), (3.0, 10), (9.0, 11)]
    assert log.verifies == [(2.0, 2.1, 0, 100, True)]
    assert swap_logs.stalls_of(log.points, end=20.0) == [(3.0, 9.0), (9.0, None)]


def test_analysis_of_a_made_up_rotation():
    logs, events, lo, hi = swap_dry.synthetic()
    a = swap_analysis.analyse(logs, events, lo, hi)
    rows = [(h.frm, h.to, h.out_s, h.in_s, h.gap_s) for h in a.handovers]
    assert rows == [
        (None, "w0", None, None, None),
        ("w0", "w1", 5.0, 2.0, 7.0),
        ("w1", "w2", 5.0, 2.0, 7.5),
    ]
    assert [(e.kind, e.who) for e in a.other_swaps] == [
        ("swap-out", "w1"),
        ("swap-out", "w2"),
        ("swap-in", "w0"),
    ]
    assert {t.label: round(t.useful_s, 2) for t in a.tenants} == {"w0": 42.7, "w1": 23.8, "w2": 3.3}
    assert not a.integrity_ok and a.integrity.startswith("FAIL: w2")
    assert [t.swap_ins_checked for t in a.tenants] == [1, 1, 1]

    logs["w2"].verifies[1] = (67.5, 67.6, 0, 10**10, True)  # w2's data came back intact after all
    a = swap_analysis.analyse(logs, events, lo, hi)
    assert a.integrity_ok, a.integrity
    assert "== integrity: PASS" in swap_report.report(a, ["machine: test"])


def test_declare_writes_one_rule_per_tenant_that_kiwid_accepts(tmp_path: Path) -> None:
    import subprocess  # noqa: PLC0415

    import swap  # noqa: PLC0415
    import swap_args  # noqa: PLC0415
    from swap_host import config_text  # noqa: PLC0415

    args = swap_args.parse(["--rehearse", "--declare", "--tenants", "2", "--torch-tenant"])
    declared = swap.declarations(args)
    assert declared is not None
    assert sorted(declared) == ["/kiwigpu-bench-0", "/kiwigpu-bench-1", "/kiwigpu-bench-2"]
    assert all(n == int((args.gib + args.overhead_gib) * 2**30) for n in declared.values())
    assert swap.declarations(swap_args.parse(["--rehearse"])) is None
    config = tmp_path / "kiwi.toml"
    config.write_text(config_text(30, backend="sim", gate=None, declared=declared))
    text = config.read_text()
    assert text.count("[[tenants]]") == 3
    assert 'match = { cgroup = "/kiwigpu-bench-1" }' in text
    out = subprocess.run(
        [sys.executable, "-m", "kiwid", "check-config", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
