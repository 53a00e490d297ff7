"""One engine registry (issue 39): every engine kind of ``trainer_bridge.backends.registry.ENGINE_KINDS`` is
accepted by ``bridge serve``, ``compare`` and ``rl``, or refused by name where a verb cannot use it; a kind
added to the table reaches every verb; and no list of kinds or if-chain over them is written elsewhere."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from foursight.trainer_bridge.backends.registry import ENGINE_KINDS, EngineKind, kinds_for, load

REPO = Path(__file__).resolve().parent.parent
URL = "http://127.0.0.1:9"  # never connected: the engines are made, not started


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def _bridge(kind: str, model: Path):
    from foursight.trainer_bridge.bridge_config import BridgeConfig
    from foursight.trainer_bridge.cli import build_engines

    row = ENGINE_KINDS[kind]
    return build_engines(BridgeConfig(engine=kind, model=model, engine_urls=[] if row.in_process else [URL, URL + "0"]))


def _compare(kind: str, model: Path):
    from foursight.compare.launch import open_engine
    from foursight.compare.spec import EngineSpec, parse_engine_urls

    spec = EngineSpec.parse(f"{kind}:bf16")
    urls = parse_engine_urls([f"{kind}:bf16={URL}"]) if ENGINE_KINDS[kind].server else {}
    engine, server = open_engine(spec, {"bf16": model}, urls, model / "logs", "", 64)
    assert server is None  # reached by URL or in this process: nothing started
    return [engine]


def _rl(kind: str, model: Path):
    from foursight.rl import RLConfig

    row = ENGINE_KINDS[kind]
    RLConfig(engine=kind, rollout_precision=row.rollout_precisions[-1]).validate()
    return load(row.rollout)


@pytest.mark.parametrize("verb", ["bridge", "compare", "rl"])
@pytest.mark.parametrize("kind", list(ENGINE_KINDS))
def test_every_kind_is_accepted_or_refused_by_name(kind, verb, tiny_llama_dir, monkeypatch):
    """Accepted: the verb makes the row's own engine class. Refused: an error that names the kind and the verb
    (through the verb's real command line too)."""
    from foursight.rl.config import RLError

    row = ENGINE_KINDS[kind]
    make = {"bridge": _bridge, "compare": _compare, "rl": _rl}[verb]
    if row.serves(verb):
        assert kind in kinds_for(verb)
        got = make(kind, tiny_llama_dir)
        if verb == "rl":
            for method in ("for_rl", "sync", "generate", "close"):  # the RolloutEngine protocol, read without importing vLLM
                assert callable(getattr(got, method)), (kind, method)
        else:
            want = load(row.in_process or row.server)
            assert got and all(type(e) is want for e in got), (kind, verb, got)
        return
    assert kind not in kinds_for(verb)
    with pytest.raises((ValueError, RLError)) as e:
        make(kind, tiny_llama_dir)
    assert repr(kind) in str(e.value) and f"foursight {verb}" in str(e.value), str(e.value)
    from foursight.cli import app

    monkeypatch.delenv("FOURSIGHT_BRIDGE_API_KEY", raising=False)
    args = {"bridge": ["bridge", "serve", "--engine", kind, "--engine-url", URL, "--wait", "0"],
            "compare": ["compare", "--engines", f"{kind}:bf16"], "rl": ["rl", "--engine", kind, "--steps", "1"]}[verb]
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code == 2 and repr(kind) in _flat(r.output) and f"foursight {verb}" in _flat(r.output), r.output


def test_rl_can_build_the_hf_rollout_engine_through_its_row(tiny_llama_dir):
    """rl makes its engine from the row (``for_rl``), and what it gets is a RolloutEngine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.trainer_bridge.backends.base import RolloutEngine, RolloutSetup

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    learner = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    eng = load(ENGINE_KINDS["hf"].rollout).for_rl(RolloutSetup(learner, tiny_llama_dir, tok, "bf16", None, "0"))
    try:
        assert isinstance(eng, RolloutEngine) and eng.precision == "bf16" and eng.model is not None
        out = eng.generate([[1, 2, 3]], 2, 2, seed=0)
        assert len(out) == 2 and all(len(r.token_ids) == len(r.logprobs) > 0 for r in out)
    finally:
        eng.close()


def test_a_kind_added_to_the_table_reaches_every_verb(tiny_llama_dir, monkeypatch):
    """The verbs read the table when they run, not a copy of it: a new server kind (here reusing the SGLang
    client) is taken by the bridge and compare, and refused by name by rl, which has no rollout engine for it."""
    from foursight.compare.spec import CompareError, EngineSpec
    from foursight.rl.config import RLError

    row = EngineKind("toy", "Toy", server="foursight.trainer_bridge.backends.sglang:SGLangHTTPEngine")
    monkeypatch.setitem(ENGINE_KINDS, "toy", row)
    assert [type(e).__name__ for e in _bridge("toy", tiny_llama_dir)] == ["SGLangHTTPEngine", "SGLangHTTPEngine"]
    assert [type(e).__name__ for e in _compare("toy", tiny_llama_dir)] == ["SGLangHTTPEngine"]
    with pytest.raises(CompareError, match="in-process HF engine only"):  # fp8 is made in this process
        EngineSpec.parse("toy:fp8")
    with pytest.raises(RLError, match="'toy' cannot be used by foursight rl"):
        _rl("toy", tiny_llama_dir)


# ---- no fourth list: the kinds are spelled in the registry only


def _product_files() -> list[Path]:
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted({f for d in dirs for f in (REPO / d).rglob("*.py")})


def kind_lists(tree: ast.AST, kinds: set[str]) -> list[str]:
    """Where a module spells engine kinds by hand: a tuple/list/set of two or more kind names, a dict keyed by
    two or more, or one function comparing a value with two or more kind names (an if-chain over kinds)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            if all(isinstance(e, ast.Constant) and e.value in kinds for e in node.elts):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            if len(keys & kinds) >= 2:
                found.append(f"line {node.lineno}: a dict keyed by {sorted(keys & kinds)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            compared = {c.value for sub in ast.walk(node) if isinstance(sub, ast.Compare)
                        and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in sub.ops)
                        for c in (sub.left, *sub.comparators) if isinstance(c, ast.Constant) and c.value in kinds}
            if len(compared) >= 2:
                found.append(f"line {node.lineno}: {node.name}() branches on {sorted(compared)}")
    return found


def test_the_checker_finds_the_lists_this_issue_removed():
    """The three tuples and if-chains of ee7c2bc, as they were written, are found."""
    kinds = set(ENGINE_KINDS)
    old = ('ENGINES = ("vllm", "sglang", "hf")\n'
           'KINDS = ("hf", "vllm", "sglang")\n'
           'def build_engines(engine):\n'
           '    if engine == "hf":\n        return 1\n'
           '    if engine == "vllm":\n        return 2\n')
    assert len(kind_lists(ast.parse(old), kinds)) == 3
    assert kind_lists(ast.parse('if rollout not in ("vllm", "foursight"): pass'), kinds) == []  # not a list of kinds


def test_no_engine_kind_list_outside_the_registry():
    registry = REPO / "trainer_bridge" / "backends" / "registry.py"
    kinds = set(ENGINE_KINDS)
    hits = {str(f.relative_to(REPO)): h for f in _product_files() if f != registry
            for h in [kind_lists(ast.parse(f.read_text(), str(f)), kinds)] if h}
    assert not hits, f"engine kinds spelled outside trainer_bridge/backends/registry.py (use its ENGINE_KINDS / kinds_for): {hits}"
