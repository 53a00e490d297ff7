"""The ``foursight`` command line is one tool: every verb mounted statically, one error style, one
meaning and one default per flag name, options checked against the config dataclass, no side doors."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import typer
from typer.testing import CliRunner

from foursight.cli import app

REPO = Path(__file__).resolve().parent.parent
VERBS = ("models", "calibrate", "quantize", "inspect", "export", "import", "serve", "bridge", "compare", "rl")


def _commands() -> dict:
    """Every leaf command of the app by its path, e.g. ``bridge serve``."""
    root = typer.main.get_command(app)
    out: dict = {}

    def walk(cmd, path: str) -> None:
        if hasattr(cmd, "commands"):  # a group (typer may ship its own click)
            for name, sub in cmd.commands.items():
                walk(sub, f"{path} {name}".strip())
        else:
            out[path] = cmd

    walk(root, "")
    return out


def test_every_verb_is_mounted():
    r = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for verb in VERBS:
        assert verb in r.output, verb
    assert {"bridge serve", "compare", "rl", "quantize", "calibrate", "inspect", "serve", "models prepare", "models tiny"} <= set(_commands())


def test_help_answers_without_importing_torch():
    """issue 53 item 8: ``foursight --help`` (the installed command, in a process of its own) and each
    verb's ``--help`` answer without importing torch, numpy or an engine (before: torch, 2.2-2.5 s,
    through the compare, rl and bridge modules the command line imported). ``-X importtime`` lists
    every module the process imported."""
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "foursight"
    for args in (["--help"], ["compare", "--help"], ["rl", "--help"], ["bridge", "serve", "--help"], ["quantize", "--help"]):
        r = subprocess.run([sys.executable, "-X", "importtime", str(exe), *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Usage" in r.stdout, (args, r.stdout[-500:], r.stderr[-2000:])
        imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy", "transformers", "vllm", "sglang", "httpx"))
        assert not heavy, (args, heavy[:10])


def test_channels_has_one_default():
    """``--channels`` is "BF16 channels per input (a count or a percentage of K)" in every verb, default 32
    (DEFAULT_CHANNELS) wherever the command calibrates a BF16 model; ``import`` defaults to 0 (its NVFP4
    tensors copied as they are), compensation being an opt-in there."""
    from foursight.cli_util import DEFAULT_CHANNELS

    seen = {}
    for path, cmd in _commands().items():
        for p in cmd.params:
            if "--channels" in getattr(p, "opts", ()):
                seen[path] = p.default
    assert set(seen) >= {"quantize", "calibrate", "compare", "rl"}
    assert seen.pop("import") == "0"
    assert DEFAULT_CHANNELS == "32" and set(seen.values()) == {DEFAULT_CHANNELS}, seen


def test_shared_flags_mean_one_thing():
    """--model, --channels, --calib and --ignore have one help text (one declaration) in every verb."""
    verbs = ("quantize", "calibrate", "compare", "rl")  # bridge serve's --model is the model the HF engine serves
    for flag in ("--model", "--channels", "--calib", "--ignore"):
        helps = {path: p.help for path, cmd in _commands().items() if path in verbs for p in cmd.params if flag in getattr(p, "opts", ())}
        assert len(helps) >= 2 and len(set(helps.values())) == 1, (flag, helps)


def test_tail_threshold_default_is_the_filters():
    from foursight.trainer_bridge.filters import FilterConfig
    from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD

    (p,) = [p for p in _commands()["compare"].params if "--tail-threshold" in p.opts]
    assert p.default == DEFAULT_TAIL_THRESHOLD == FilterConfig().tau


def test_rl_options_match_rlconfig():
    """``foursight rl``'s flags are generated from RLConfig: one flag per field, with the field's default,
    and no other flag; 0 still means "off" (None) for the options whose help says so."""
    from foursight.cli_config import cli_fields, flag_name
    from foursight.rl import RLConfig

    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in cli_fields(RLConfig)}
    assert set(fields) == {f.name for f in dataclasses.fields(RLConfig)}  # every field is a flag
    params = {p.name: p for p in _commands()["rl"].params if p.name != "help"}
    assert set(params) == set(fields), set(params) ^ set(fields)
    for name, want in fields.items():
        assert params[name].default == want, (name, params[name].default, want)
    for f in cli_fields(RLConfig):
        if f.name not in ("model", "channels"):
            assert flag_name(f).split("/")[0] in params[f.name].opts, f.name
    off = {"tis_cap": "--tis-cap", "filter_tau": "--filter-tau", "filter_quantile": "--filter-quantile",
           "error_target": "--error-target", "max_k": "--max-k"}
    ctx = _commands()["rl"].make_context("rl", [x for flag in off.values() for x in (flag, "0")])
    assert all(ctx.params[name] is None for name in off), ctx.params


def test_one_error_style(tmp_path):
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "does not exist" in r.output  # names what is wrong (issue 28)
    assert r.stderr.startswith("error: ") and r.stdout == ""  # on standard error, as click's own usage errors
    r = CliRunner().invoke(app, ["bridge", "serve", "--engine", "hf"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and r.output.startswith("error: ") and "--model" in r.output
    r = CliRunner().invoke(app, ["compare", "--engines", "vllm:fp8"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and r.output.startswith("error: ") and "--engines" in r.output
    r = CliRunner().invoke(app, ["rl", "--task", "nope", "--out", str(tmp_path / "x.jsonl")], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and r.output.startswith("error: ") and "--task" in r.output


def test_no_python_dash_m_side_doors():
    """No module of the package runs as a script: the ``foursight`` console script is the way in."""
    doors = []
    for d in ("foursight_engine", "kernels", "quant_methods", "trainer_bridge"):
        for f in (REPO / d).rglob("*.py"):
            if f.name == "__main__.py":
                doors.append(str(f))
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                    doors.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert not doors, doors


def test_compare_and_serve_flags_all_have_help():
    """Every option of ``compare``, ``rl`` and ``serve`` says what it does (``--help`` is the reference)."""
    import click

    for verb in ("compare", "rl", "serve"):
        bare = [p.opts for p in _commands()[verb].params if isinstance(p, click.Option) and not (p.help or "").strip()]
        assert not bare, (verb, bare)
    (key,) = [p for p in _commands()["compare"].params if "--api-key" in getattr(p, "opts", ())]
    assert key.envvar == "FOURSIGHT_ENGINE_API_KEY"


def test_model_resolves_a_hub_id_from_the_local_cache_only(tmp_path, monkeypatch):
    """``--model org/name`` is the snapshot of the local Hugging Face cache (the cache layout
    huggingface_hub reads: refs/main -> snapshots/<commit>); an id not in the cache is refused
    without a download, naming the id and the cache."""
    import huggingface_hub.constants as hc
    import pytest

    from foursight.models import resolve_model

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-lm" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--acme--tiny-lm" / "refs").mkdir()
    (cache / "models--acme--tiny-lm" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny-lm") == snap
    with pytest.raises(FileNotFoundError, match=r"--model acme/other: not a folder and not in the local Hugging Face cache"):
        resolve_model("acme/other")
    with pytest.raises(FileNotFoundError, match="no config.json in that folder"):
        resolve_model(str(tmp_path))
    # a local folder wins over a cached id of the same name
    local = tmp_path / "acme" / "tiny-lm"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_model("acme/tiny-lm") == Path("acme/tiny-lm")
