"""The benchmark scripts: each parses, defines every top-level name once (a second ``def`` of the same
name silently replaces the first: that broke bench_decode's CUDA-graph timing once), and the
end-to-end benchmark runs on the CPU with its tiny model."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every script of benchmarks/ and its subject folders (kernels/, fidelity/, rl/, weight_sync/); results/ holds data
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").rglob("*.py") if "results" not in p.relative_to(ROOT / "benchmarks").parts)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT / "benchmarks")))
def test_benchmark_defines_each_top_level_name_once(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    seen: dict[str, int] = {}
    dup = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                dup.append(f"{node.name} (lines {seen[node.name]} and {node.lineno})")
            seen[node.name] = node.lineno
    assert not dup, f"{path.name} defines these twice: {dup}"


def test_the_benchmarks_readme_names_every_script():
    """benchmarks/README.md is the index of the folder: it names every script (``.py``, ``.sh``) of it by file
    name, so a newcomer finds each from there (issue 54 item 6: it omitted 15 of 44, among them the device
    script in use)."""
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [p for p in (ROOT / "benchmarks").rglob("*") if p.suffix in (".py", ".sh") and p.name != "__init__.py"
               and not {"results", "__pycache__"} & set(p.relative_to(ROOT / "benchmarks").parts)]
    assert len(scripts) > 40
    missing = sorted(str(p.relative_to(ROOT / "benchmarks")) for p in scripts if f"`{p.name}`" not in readme)
    assert not missing, f"benchmarks/README.md does not name: {missing}"


def test_bench_decode_runs_on_cpu_tiny(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kernels/bench_decode.py"), "--tiny", "--device", "cpu", "--batches", "1,2",
         "--modes", "bf16,foursight-w4a4", "--prefill-tokens", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_decode.json").read_text())
    assert rows, "no results written"


def test_sass_loops_finds_plain_predicated_and_uniform_backward_branches():
    """benchmarks/kernels/sass.py's loop finder on hand-written SASS: a plain ``BRA`` loop, a predicated one and
    the sm_100 form ``BRA.U !UP3, 0x..`` are loops (target to branch, predicates stripped, modifiers kept); a
    forward branch and ``BRA.DIV`` with a register are not."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))
    try:
        import sass
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "kernels"))
    text = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;",
        "        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*0030*/                   BRA 0x10 ;",
        "        /*0040*/                   UTCOMMA.4X gdesc[UR4], gdesc[UR6], tmem[UR8] ;",
        "        /*0050*/              @!P0 FFMA R3, R3, R4, R5 ;",
        "        /*0060*/                   BRA.U !UP3, 0x40 ;",
        "        /*0070*/               @P1 BRA 0x50 ;",
        "        /*0080*/                   BRA 0xa0 ;",
        "        /*0090*/                   BRA.DIV UR4, 0x0 ;",
        "        /*00a0*/                   EXIT ;",
    ])
    assert [a for a, _ in sass.instructions(text)] == list(range(0, 0xB0, 0x10))
    assert sass.loops(text) == [
        ["HMMA.16816.F32", "IADD3", "BRA"],
        ["UTCOMMA.4X", "FFMA", "BRA.U"],
        ["FFMA", "BRA.U", "BRA"],
    ]


def _common():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return common


def test_interleaved_rounds_rotate_the_order_and_keep_every_sample_with_its_clocks():
    """Each round calls every timer once, the order rotated by one place a round (so no method always runs first or
    always after the same one); min / median / max are over the rounds; the clocks are read once a round."""
    common = _common()
    calls, ticks = [], iter(range(1000))

    def timer(name, values):
        it = iter(values)

        def t():
            calls.append(name)
            return next(it)
        return t

    res = common.interleaved_rounds({"a": timer("a", [5, 1, 3, 9]), "b": timer("b", [2, 2, 8, 4]), "c": timer("c", [7, 6, 5, 4])},
                                    rounds=4, clocks=lambda: {"sm_mhz": next(ticks)})
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert res["order"][1] == ["b", "c", "a"]
    assert res["samples"]["a"] == [5, 1, 3, 9]
    assert res["stats"]["a"] == {"min": 1, "median": 4.0, "max": 9, "n": 4}
    assert res["stats"]["c"]["median"] == 5.5
    assert [c["sm_mhz"] for c in res["clocks"]] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rounds"):
        common.interleaved_rounds({"a": lambda: 1.0}, rounds=0)


def test_parse_smi_clocks_reads_numbers_reasons_and_missing_fields():
    common = _common()
    got = common.parse_smi_clocks("1980, 2619, 1980, 2619, 41, 123.45, 0x0000000000000004\n")
    assert got == {"sm_mhz": 1980.0, "mem_mhz": 2619.0, "max_sm_mhz": 1980.0, "max_mem_mhz": 2619.0, "temp_c": 41.0,
                   "power_w": 123.45, "throttle_reasons": "0x0000000000000004"}
    assert common.parse_smi_clocks("1755, 2619, 1980, 2619, [N/A], [Not Supported], 0x1")["power_w"] is None
    with pytest.raises(ValueError, match="expected 7 fields"):
        common.parse_smi_clocks("1980, 2619")


def test_bench_fair_dry_run_times_every_method_in_rotated_rounds(tmp_path):
    """bench_fair.py --dry-run on the CPU: every per-layer method and decode mode timed (eager wall clock), in rounds
    whose order rotates; the fused FP8 producers give the eager FP8 road's logits up to a rare last-bit code."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/kernels/bench_fair.py"), "--dry-run", "--linears", "down",
         "--modes", "bf16,fp8,fp8-fused", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "bench_fair.json").read_text())
    assert res["dry_run"] is True
    row = res["layers"]["down/M=1"]
    assert set(row["us_per_call"]) == {"bf16", "bf16-gemm", "fp8-fused", "fp8-gemm", "fp8-eager", "w4a4", "w4a4-gemm"}
    for st in row["us_per_call"].values():
        assert st["n"] == 2 and 0 < st["min"] <= st["median"] <= st["max"]
    assert row["order"][1] == row["order"][0][1:] + row["order"][0][:1]
    # the fused producer quantizes as the engines do (y · 1/scale), the eager road by division: codes differ in a
    # rare last-bit case, so the two products' errors against fp32 agree closely
    fused, eager = row["rel_err_vs_fp32"]["fp8-fused"], row["rel_err_vs_fp32"]["fp8-eager"]
    assert 0 < fused and abs(fused - eager) <= 0.02 * eager
    dec = res["decode"]["batches"]["1"]
    for part in ("step", "linears"):
        assert set(dec[part]["ms"]) == {"bf16", "fp8", "fp8-fused"}
    assert dec["check_fp8_fused_vs_eager_rel"] < 1e-3
    assert "Dry run on the CPU" in (tmp_path / "bench_fair.md").read_text()
