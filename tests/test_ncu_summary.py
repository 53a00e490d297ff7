"""benchmarks/kernels/ncu_summary.py: Nsight Compute's raw CSV read back from a small CSV written here."""

import csv
import importlib.util
import io
import sys
from pathlib import Path

import pytest

_P = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "ncu_summary.py"
_spec = importlib.util.spec_from_file_location("ncu_summary", _P)
ns = importlib.util.module_from_spec(_spec)
sys.modules["ncu_summary"] = ns  # dataclasses resolve the module's annotations through sys.modules
_spec.loader.exec_module(ns)

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Kernel Name", "Block Size", "Grid Size", "gpu__time_duration.sum", "dram__bytes_read.sum.per_second",
          "smsp__warps_active.avg.per_cycle_active", "smsp__warps_eligible.avg.per_cycle_active",
          "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
          "smsp__warps_active.avg.peak_sustained", "smsp__issue_active.avg.pct_of_peak_sustained_active"] + [STALL.format(r) for r in
                                                      ("barrier", "long_scoreboard", "selected", "wait", "not_selected")]


def _launch(i, name, dur, dram, stalls, grid="(4, 2, 1)"):
    # stalls: barrier, long_scoreboard, selected, wait, not_selected
    return [str(i), name, "(128, 1, 1)", grid, dur, dram, "3.50", "0.75", "21.30", "124", "16", "53.36"] + stalls


def _write(path, rows, units=True, preamble=("# commit abc123, card: test", "==PROF== Connected to process 1")):
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(HEADER)
    if units:
        w.writerow(["", "", "", "", "usecond", "Gbyte/second", "warp", "warp", "%", "register/thread", "warp", "%"] + ["inst"] * 5)
    for r in rows:
        w.writerow(r)
    path.write_text("\n".join(preamble) + "\n" + buf.getvalue())
    return path


ROWS = [
    _launch(0, "_act_quant_kernel", "5.25", "10", ["0.1", "2.0", "1", "0.7", "0.9"], grid="(1, 8, 1)"),
    _launch(1, "_fragment_gemm_kernel", "1,250.5", "1,557.5", ["0.94", "1.16", "1", "0.71", "0.89"]),
    _launch(2, "void nvjet_sm90_tst_64x8<float>(int, int)", "50.56", "2,655", ["0", "17.9", "1", "1.66", "0.06"]),
    _launch(3, "_act_quant_kernel", "5.5", "50", ["0.5", "2.3", "1", "0.9", "3.8"]),
    _launch(4, "_fragment_gemm_kernel", "25.5", "1,558", ["0.39", "0.69", "1", "0.69", "0.73"]),
    _launch(5, "void nvjet_sm90_tst_64x16<float>(int, int)", "51", "2,600", ["0", "18.2", "1", "1.66", "0.05"]),
]
PROBE = ("[probe_v4 ncu] M=1 8192x8192 k=128 tile fragment/16/64/256/3/0/128/4/True/False/False/8\n"
         "[probe_v4 ncu] M=16 8192x8192 k=128 tile fragment/16/64/256/3/0/0/4/True/False/False/1\n")


def test_units_names_and_top_stalls(tmp_path):
    ls = ns.launches(_write(tmp_path / "ncu.csv", ROWS))
    assert [la.name for la in ls][:3] == ["_act_quant_kernel", "_fragment_gemm_kernel", "nvjet_sm90_tst_64x8"]
    assert [la.role for la in ls][:3] == ["W4A4 quantizer", "W4A4 GEMM", "cuBLAS BF16"]
    gemm = ls[1]
    assert gemm.duration_us == pytest.approx(1250.5)  # usecond, thousands separator
    assert gemm.dram_read_tbps == pytest.approx(1.5575)  # 1,557.5 Gbyte/second
    assert gemm.grid == "4×2×1" and gemm.block == "128×1×1" and ls[0].grid == "1×8×1"
    assert (gemm.warps_active, gemm.warps_eligible, gemm.occupancy_pct, gemm.registers) == (3.5, 0.75, 21.3, 124)
    assert gemm.issue_pct == 53.36 and gemm.dram_pct is None
    # "selected" (1.0) is the issue itself, never a stall; the rest largest first
    assert gemm.stalls == [("long_scoreboard", 1.16), ("barrier", 0.94), ("not_selected", 0.89)]
    assert ls[2].stalls[0] == ("long_scoreboard", 17.9)


def test_no_units_row_means_ns_and_bytes_per_second(tmp_path):
    rows = [_launch(0, "_act_quant_kernel", "5,152", "8,645,962,732.92", ["0", "0", "1", "0", "0"])]
    (la,) = ns.launches(_write(tmp_path / "ncu.csv", rows, units=False, preamble=()))
    assert la.duration_us == pytest.approx(5.152) and la.dram_read_tbps == pytest.approx(0.00864596273292)
    with pytest.raises(ValueError, match="unknown bandwidth unit 'GiB/s'"):
        ns.bandwidth_scale("GiB/s")
    with pytest.raises(ValueError, match="no kernel launch rows"):
        ns.launches(_write(tmp_path / "empty.csv", [], units=True))
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no header row"):
        ns.launches(bad)


def test_groups_follow_probe_lines_and_markdown(tmp_path):
    csv_path = _write(tmp_path / "ncu.csv", ROWS)
    log = tmp_path / "steps.log"
    log.write_text("noise\n" + PROBE + "more\n" + PROBE)  # a log that repeats the lines: read once
    probes = ns.probe_lines([log])
    assert [p["M"] for p in probes] == [1, 16] and probes[1]["tile"].endswith("/True/False/False/1")
    grouped = ns.group(ns.launches(csv_path), probes)
    assert [(p["M"], [la.index for la in g]) for p, g in grouped] == [(1, [0, 1, 2]), (16, [3, 4, 5])]
    out = tmp_path / "ncu_summary.md"
    ns.main([str(csv_path), "--probe-log", str(log), "--out", str(out)])
    md = out.read_text()
    assert "commit abc123, card: test" in md and "of 16 (`smsp__warps_active.avg.peak_sustained`)" in md
    # no gpu__dram_throughput column in this CSV: its cell is a dash
    assert ("| 1 | W4A4 GEMM | `_fragment_gemm_kernel` | 4×2×1 | 128×1×1 | 1250.5 | 1.56 | — | 3.50 | 0.75 | 53.4 | 21.3 | 124 | "
            "long_scoreboard 1.16, barrier 0.94, not_selected 0.89 |") in md
    # per-M sum: 5.5 + 25.5 = 31.0 against cuBLAS 51.0
    assert "| 16 | 5.5 | 25.5 | 31.0 | 51.0 | 1.65 |" in md


def test_probe_lines_that_do_not_match_the_launches_are_an_error(tmp_path):
    ls = ns.launches(_write(tmp_path / "ncu.csv", ROWS[:3]))  # one group, two probe lines
    log = tmp_path / "steps.log"
    log.write_text(PROBE)
    with pytest.raises(ValueError, match=r"1 launch groups .* but 2 \[probe_v4 ncu\] lines .*cannot map"):
        ns.group(ls, ns.probe_lines([log]))


def test_gluon_gemm_kernels_count_as_the_w4a4_gemm(tmp_path):
    """The register-streaming (``_stream_kernel``) and warp-specialized (``_ws_kernel``) Gluon forms are the
    W4A4 call's GEMM too (``device_v4.sh``'s ``ncustream`` step): their time enters the per-M sum."""
    rows = [ROWS[0], _launch(1, "_stream_kernel", "24.9", "1,610", ["0.70", "0.93", "1", "0.90", "0.5"]), ROWS[2]]
    csv_path = _write(tmp_path / "ncu_stream.csv", rows)
    log = tmp_path / "ncustream.out"
    log.write_text("[probe_v4 ncu] M=1 8192x8192 k=128 tile gluon_stream/16/1/0/0/64/4/8/4\n")
    assert [la.role for la in ns.launches(csv_path)][:2] == ["W4A4 quantizer", "W4A4 GEMM"]
    assert ns.ROLES["_ws_kernel"] == "W4A4 GEMM"
    out = tmp_path / "ncu_stream_summary.md"
    ns.main([str(csv_path), "--probe-log", str(log), "--out", str(out)])
    assert "| 1 | 5.2 | 24.9 | 30.1 | 50.6 | 1.68 |" in out.read_text()
