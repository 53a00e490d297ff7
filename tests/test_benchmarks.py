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
