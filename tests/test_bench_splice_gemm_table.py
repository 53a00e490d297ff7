"""The per-layer grid's markdown table (benchmarks/kernels/bench_splice_gemm.py), from synthetic rows on
the CPU: cuBLAS is timed twice per row (first, and again after that M's FourSight rows), both are shown,
and every ratio divides the faster of the two (the conservative figure for FourSight), or the one
timing that a result file written before the second timing has."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bsg():
    sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))
    try:
        import bench_splice_gemm
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "kernels"))
    return bench_splice_gemm


def _res(rows):
    return {"env": {"gpu": "Test GPU", "date_utc": "2026-12-06 00:00:00", "command": "bench_splice_gemm.py --test",
                    "torch": "t", "triton": "t"},
            "method": "synthetic", "ceilings": {}, "rows": rows, "quant": [], "batch_invariance": []}


def _table(md: str) -> list[dict]:
    """The main table's rows as {column header: cell}."""
    lines = md.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith("| N | K | M |"))
    head = [c.strip() for c in lines[i].strip("|").split("|")]
    out = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        out.append(dict(zip(head, (c.strip() for c in line.strip("|").split("|")))))
    return out


def _row(m, cublas, after, **times):
    r = {"N": 8192, "K": 8192, "M": m, "path": "decode", "cublas_ms": cublas, "w4a4_k128_rel_err": 1e-3, **times}
    if after is not None:
        r["cublas_after_ms"] = after
    return r


def test_ratios_use_the_faster_cublas_timing(bsg):
    rows = [
        _row(1, 0.0563, 0.0470, w4a4_k0_ms=0.0240, w4a4_k128_ms=0.0250, fp8_gemm_ms=0.0300),  # first timing slower
        _row(16, 0.0400, 0.0500, w4a4_k128_ms=0.0320, gemlite_ms=0.0350),  # second timing slower
        _row(64, 0.0490, None, w4a4_k128_ms=0.0350),  # a file from before the second timing
    ]
    table = _table(bsg.markdown(_res(rows)))
    assert [t["M"] for t in table] == ["1", "16", "64"]
    t1, t16, t64 = table
    # every ratio divides the minimum of the two cuBLAS figures
    assert t1["W4A4 k=128"] == f"{0.0470 / 0.0250:.2f}" == "1.88"  # not 56.3 / 25.0 = 2.25
    assert t1["W4A4 k=0"] == f"{0.0470 / 0.0240:.2f}"
    assert t1["FP8 gemm"] == f"{0.0470 / 0.0300:.2f}"
    assert t16["W4A4 k=128"] == f"{0.0400 / 0.0320:.2f}" and t16["GemLite"] == f"{0.0400 / 0.0350:.2f}"
    assert t64["W4A4 k=128"] == f"{0.0490 / 0.0350:.2f}"
    assert t1["W4A4 k=64"] == "" and t1["k-ovh"] == f"{(0.0250 / 0.0240 - 1) * 100:+.1f}%"
    # both timings shown, in µs
    assert (t1["cuBLAS µs"], t1["cuBLAS after"]) == ("56.3", "47.0")
    assert (t16["cuBLAS µs"], t16["cuBLAS after"]) == ("40.0", "50.0")
    assert (t64["cuBLAS µs"], t64["cuBLAS after"]) == ("49.0", "")


def test_table_header_says_which_cublas_figure_the_ratios_use(bsg):
    md = bsg.markdown(_res([_row(1, 0.05, 0.04, w4a4_k128_ms=0.02)]))
    assert "faster (minimum) of the two" in md
    assert bsg.cublas_ref_ms({"cublas_ms": 0.05, "cublas_after_ms": 0.04}) == 0.04
    assert bsg.cublas_ref_ms({"cublas_ms": 0.05}) == 0.05
    assert bsg.cublas_ref_ms({}) is None


def test_kernels_md_table_is_what_the_printed_command_prints():
    """issue 53 item 8: docs/kernels.md prints ``python benchmarks/kernels/kernel_table.py
    benchmarks/results/splice_gemm.json      # the table below``; run as printed (this venv's python, from
    the repository), its output is a table that stands below that line in the same page, unchanged
    (before: the page had no table below it; the table was only in docs/kernels-history.md)."""
    import re
    import subprocess

    text = (ROOT / "docs" / "kernels.md").read_text()
    (line,) = [m for m in re.findall(r"^(python .*?)\s+# the table below$", text, flags=re.M)]
    r = subprocess.run([sys.executable, *line.split()[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    table = r.stdout.strip()
    assert table.startswith("| N×K | M |") and table.count("\n") >= 10, table[:300]
    assert table in text[text.index(line):], "the printed command's table is not below it in docs/kernels.md"
