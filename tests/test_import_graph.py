"""The import graph of the ``foursight`` distribution has no cycle, and the numerics stay at the bottom.

The graph is read from the source, over every module of the four folders that ``pyproject.toml``
maps into ``foursight.*``. Every import counts, also those deferred into a function body (a
deferred import that closes a circle is still a circle: ``layer`` calling into ``kernels`` that
import ``layer``); only ``if TYPE_CHECKING:`` blocks are left out.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Module name -> source file for every module of the distribution."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    roots = {Path(d).resolve() for d in cfg.values()}
    out: dict[str, Path] = {}
    for pkg, d in cfg.items():
        base = (REPO / d).resolve()
        for f in base.rglob("*.py"):
            if any(r != base and r in f.parents for r in roots):
                continue  # belongs to another mapped package
            rel = f.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _imports(tree: ast.Module):
    """Every import node of a module, at any depth, except under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        for node in _imports(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # ``import a.b.c`` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
                if t:
                    parent = t.rpartition(".")[0]
                    while parent and parent != name and not name.startswith(parent + "."):  # importing a.b.c runs a.b's __init__
                        if parent in mods:
                            graph[name].add(parent)
                        parent = parent.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    color: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if color.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in color:
                found = visit(m)
                if found:
                    return found
        color[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in color:
            found = visit(n)
            if found:
                return found
    return None


def test_graph_covers_the_four_packages():
    g = import_graph()
    for pkg in ("foursight", "foursight.kernels", "foursight.quant_methods", "foursight.trainer_bridge"):
        assert pkg in g
    assert "foursight.layer" in g["foursight.kernels.prepared"]  # the graph does see real edges


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    g = import_graph()
    g["foursight.nvfp4"] = set(g["foursight.nvfp4"]) | {"foursight.dispatch"}  # nvfp4 -> dispatch -> layer -> nvfp4
    cycle = find_cycle(g)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert any(a == "foursight.nvfp4" and b == "foursight.dispatch" for a, b in zip(cycle, cycle[1:])), cycle


def test_numerics_sit_below_everything():
    """nvfp4 imports nothing of ours, the oracle and the FP8 rowwise numerics only nvfp4, the kernels only the oracles and nvfp4:
    the linear-layer dispatcher and everything above can import them, never the reverse."""
    g = import_graph()
    ours = lambda m: {t for t in g[m] if t.startswith("foursight")}  # noqa: E731
    assert ours("foursight.nvfp4") <= {"foursight"}
    assert ours("foursight.layer") <= {"foursight", "foursight.nvfp4"}
    assert ours("foursight.fp8") <= {"foursight", "foursight.nvfp4"}  # the FP8 rowwise numerics sit beside nvfp4
    for m in (m for m in g if m.startswith("foursight.kernels")):
        # (the FP8 yardstick's producers take their oracle from foursight.fp8, which sits beside nvfp4)
        assert {t for t in ours(m) if not t.startswith("foursight.kernels")} <= {"foursight", "foursight.nvfp4", "foursight.layer", "foursight.fp8"}, m
    assert "foursight.kernels" in ours("foursight.dispatch")  # the Triton backend (a deferred import)


def test_the_reference_model_does_not_stand_on_calibration():
    """The HF reference model (``foursight.hf``) reads checkpoints through the one checkpoint reader in
    ``foursight.tensor_io``; it imported ``foursight.checkpoint`` for it, and so calibration (the writer's
    statistics) came with every reader of a checkpoint (issue 54 item 5)."""
    g = import_graph()
    seen, todo = set(), ["foursight.hf"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(t for t in g.get(m, ()) if t.startswith("foursight"))
    assert "foursight.calibration" not in seen and "foursight.checkpoint" not in seen, sorted(seen)


def test_cli_and_rl_import_without_the_serving_stack():
    """``foursight rl`` runs where only torch and transformers are (the device of the RL study): the
    CLI's top-level imports must not pull in the bridge's server stack or an engine. Regression: the
    bridge CLI imported a constant from ``guards``, which imports starlette, and every run of the
    study's first device chunk died at import (2026-12-06)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import importlib.abc, sys
        BLOCK = {"starlette", "fastapi", "uvicorn", "httpx", "vllm", "sglang", "openai", "trl"}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCK:
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        sys.meta_path.insert(0, Block())
        sys.argv = ["foursight", "rl", "--help"]
        from foursight.cli import main
        main()
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--rollout-precision" in p.stdout, p.stdout[-2000:]


#: the most floors the product's spine may have (issue 39's target; it had 13 by the issue's count, 16 by this one)
MAX_FLOORS = 9
#: the height now: it may shrink, never grow (14 when this check was added, 2026-12-06, through the vLLM plugin;
#: 9 since the plugin's chain was cut and the experimental kernels left the default path)
FLOORS_NOW = 9


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain of the (acyclic) ``graph``: its length is the number of floors."""
    best: dict[str, list[str]] = {}

    def chain(n: str) -> list[str]:
        if n not in best:
            below = max((chain(m) for m in sorted(graph[n])), key=len, default=[])
            best[n] = [n, *below]
        return best[n]

    return max((chain(n) for n in sorted(graph)), key=len, default=[])


def test_floor_counter_sees_a_planted_tower():
    g = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}
    assert longest_chain(g) == ["a", "b", "c"]
    g = import_graph()
    g["foursight.nvfp4"] = set(g["foursight.nvfp4"]) | {"tower.0"}  # the bottom floor now stands on ten more
    g.update({f"tower.{i}": {f"tower.{i + 1}"} for i in range(9)} | {"tower.9": set()})
    assert len(longest_chain(g)) > MAX_FLOORS + 10 - 1


def test_the_spine_does_not_grow():
    chain = longest_chain(import_graph())
    assert len(chain) <= FLOORS_NOW, f"{len(chain)} floors: " + " -> ".join(chain)


def test_the_spine_has_at_most_nine_floors():
    """The longest chain of imports of the product (every import, deferred ones too: a module stands
    on what it imports wherever it imports it) has at most :data:`MAX_FLOORS` modules. A tall spine
    means a change at the bottom is a change everywhere, and usually a helper that sits too high."""
    chain = longest_chain(import_graph())
    assert len(chain) <= MAX_FLOORS, f"{len(chain)} floors: " + " -> ".join(chain)


def experimental_modules() -> set[str]:
    """The modules the backend registry and the kernel-form table name for the experimental backends and forms
    (loaded by name), which are the modules of ``foursight.kernels.experimental``."""
    from foursight.kernels import api, backends, forms  # noqa: F401 - api registers the rows of the table of forms

    names = {b.module for b in backends.REGISTRY.values() if b.module}
    return names | {m for f in forms.EXPERIMENTAL for m in (f.module, f.twin)}


def test_experimental_kernels_stay_off_the_default_path():
    """Issue 39: the experimental backends (FlashInfer, dot_scaled) and kernel forms (Gluon WS) live apart from the
    default path. The registry names their modules and imports one by name only when it is asked for, so they are
    not floors under the default path; here: every name it gives is a module of the product, and no other module
    imports one (only an experimental module may stand on another: the twin on its form, FlashInfer on dot_scaled)."""
    graph, exp = import_graph(), experimental_modules()
    assert exp and exp <= set(graph), exp - set(graph)
    package = {m for m in graph if m.startswith("foursight.kernels.experimental.")}
    assert exp == package, exp ^ package  # every experimental module is named, and all live in the one package
    importers = {f"{m} -> {t}" for m, deps in graph.items() if m not in exp for t in deps & exp}
    assert importers == set()


def private_imports(files: dict[str, Path] | None = None) -> list[str]:
    """``module: from X import _name`` (or ``x._name``, ``x`` a module of ours it imported) for every
    ``_private`` name (not a dunder) one module of the product (or each of ``files``) takes from a module of the product."""
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    out = []
    for name, f in (_modules() if files is None else files).items():
        tree = ast.parse(f.read_text(), str(f))
        ours: set[str] = set()  # local names bound to our modules (or to names imported from them)
        for node in _imports(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("foursight")):
                for a in node.names:
                    ours.add(a.asname or a.name)
                    if private(a.name):
                        out.append(f"{name}: from {'.' * node.level}{node.module or ''} import {a.name}")
            elif isinstance(node, ast.Import):
                ours |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("foursight")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name) and node.value.id in ours:
                out.append(f"{name}: {node.value.id}.{node.attr}")
    return out


def test_no_private_name_is_imported_across_modules():
    """A name that another module needs is public: ``from foursight.x import _helper`` hides a
    dependency the reader of ``x`` does not see (issue 39 found 15 in the kernels alone)."""
    assert private_imports() == []


def test_no_test_imports_a_private_name_of_the_product():
    """Issue 54: the tests, too, reach the product through public names only (a test that needs an
    inner piece names why it is public where it is defined)."""
    tests = Path(__file__).resolve().parent
    files = {str(f.relative_to(tests)): f for f in sorted(tests.rglob("*.py"))}
    assert private_imports(files) == []
