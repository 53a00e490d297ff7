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
