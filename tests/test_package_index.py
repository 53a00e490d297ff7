"""The package index in ``foursight/__init__.py``'s docstring names every module and sub-package of the
distribution's top level and nothing else, so that it cannot go stale again (issue 39: it had lost eight modules)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import foursight

REPO = Path(__file__).resolve().parent.parent


def test_every_top_level_module_and_package_is_in_the_index():
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    base = REPO / dirs["foursight"]
    names = {f.stem for f in base.glob("*.py") if f.stem != "__init__"}
    names |= {d.name for d in base.iterdir() if (d / "__init__.py").exists()}
    names |= {pkg.rpartition(".")[2] for pkg in dirs if pkg != "foursight"}  # kernels, quant_methods, trainer_bridge
    doc = foursight.__doc__ or ""
    column = set()
    for first in re.findall(r"^ {4}([a-z_][a-z0-9_, ]*?)(?= {2,}|\s*\()", doc, flags=re.M):  # the name column
        column |= {n.strip() for n in first.split(",")}
    listed = column | set(re.findall(r"\b([a-z_][a-z0-9_]*) \(", doc))  # names given in passing: "cli_util (shared options, ...)"
    assert sorted(names - listed) == []
    assert sorted(column - names) == []  # and no entry names a module that is gone


def test_the_tests_index_names_every_test_file():
    """tests/README.md is the index of the tests (issue 54 item 6): it names every ``test_*.py`` of tests/ and
    tests/sglang/, and no file that is gone."""
    import re

    tests = Path(__file__).resolve().parent
    have = {str(f.relative_to(tests)) for f in [*tests.glob("test_*.py"), *tests.glob("sglang/test_*.py")]}
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", (tests / "README.md").read_text(), flags=re.M))
    assert have - named == set(), f"tests/README.md does not name {sorted(have - named)}"
    assert named - have == set(), f"tests/README.md names files that are gone: {sorted(named - have)}"
