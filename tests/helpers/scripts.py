"""Benchmarks and scripts as modules, found by name.

``benchmarks/`` and ``scripts/`` are folders of command-line scripts, not packages; a test that checks
a script's pieces loads it here. A benchmark is found by its file name anywhere under ``benchmarks/``,
so moving it between subfolders changes no test.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def benchmark_path(name: str) -> Path:
    """``benchmarks/**/NAME.py``; exactly one must exist."""
    hits = sorted((REPO / "benchmarks").rglob(f"{name}.py"))
    if len(hits) != 1:
        raise LookupError(f"benchmark {name!r}: expected one benchmarks/**/{name}.py, found {[str(h) for h in hits]}")
    return hits[0]


@functools.cache
def load_benchmark(name: str) -> ModuleType:
    """The benchmark script ``NAME.py`` (under ``benchmarks/``) as a module, loaded once."""
    return _load(f"benchmarks.{name}", benchmark_path(name))


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module, loaded once."""
    return _load(f"scripts.{name}", REPO / "scripts" / f"{name}.py")


def _load(module_name: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise FileNotFoundError(f"{module_name}: no file {path}")
    spec = importlib.util.spec_from_file_location(module_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return mod
