"""Options written once: a config dataclass generates its verb's flags (foursight.cli_config)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import typer
from typer.testing import CliRunner

from foursight.cli_config import cli_fields, flag_name, option, typer_command
from foursight.cli_util import guarded


@dataclass
class Toy:
    n: int = option(3, min=1, help="how many")
    out: Path = option(Path("x"), help="where")
    name: Optional[str] = option(None, help="a name")
    loud: bool = option(False, help="shout")
    tags: Optional[list[str]] = option(None, help="repeatable")
    internal: str = ""  # not a flag


def _app(seen: list) -> typer.Typer:
    app = typer.Typer()
    app.command("toy")(guarded(typer_command(Toy, seen.append, doc="Toy verb.")))
    app.command("other")(lambda: None)
    return app


def test_flags_defaults_and_bounds_come_from_the_dataclass():
    seen: list[Toy] = []
    r = CliRunner().invoke(_app(seen), ["toy"])
    assert r.exit_code == 0, r.output
    assert seen == [Toy()]
    r = CliRunner().invoke(_app(seen), ["toy", "--n", "7", "--out", "y", "--name", "a", "--loud", "--tags", "p", "--tags", "q"])
    assert r.exit_code == 0, r.output
    assert seen[-1] == Toy(n=7, out=Path("y"), name="a", loud=True, tags=["p", "q"])
    r = CliRunner().invoke(_app(seen), ["toy", "--n", "0"])  # min=1 from the field
    assert r.exit_code == 2 and len(seen) == 2
    r = CliRunner().invoke(_app(seen), ["toy", "--internal", "z"])  # a field without option() is no flag
    assert r.exit_code == 2
    help_text = CliRunner().invoke(_app(seen), ["toy", "--help"], env={"COLUMNS": "200"}).output
    for text in ("how many", "where", "a name", "shout", "repeatable", "Toy verb."):
        assert text in help_text


@pytest.mark.parametrize("verb, config", [("compare", "foursight.compare.config:CompareConfig"),
                                           ("quantize", "foursight.quantize_config:QuantizeConfig"),
                                           ("rl", "foursight.rl.config:RLConfig"),
                                           ("bridge serve", "foursight.trainer_bridge.bridge_config:BridgeConfig")])
def test_verb_flags_are_exactly_its_config(verb, config):
    """Every option of the verb's config is a flag of the verb with the config's default, and no other flag exists
    (the defaults live once, in the config)."""
    import importlib

    from foursight.cli import app

    mod, _, cls = config.partition(":")
    cfg_cls = getattr(importlib.import_module(mod), cls)
    cmd = typer.main.get_command(app)
    for word in verb.split():
        cmd = cmd.commands[word]  # type: ignore[attr-defined]
    params = {p.name: p for p in cmd.params if p.name != "help"}
    fields = {f.name: f for f in cli_fields(cfg_cls)}
    assert set(params) == set(fields)
    for name, f in fields.items():
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        got = params[name].default
        assert (got if not isinstance(default, Path) else Path(got)) == default or (default is None and got in (None, ())), name
        if f.metadata["cli"]["typer_type"] is None:
            assert flag_name(f).split("/")[0] in params[name].opts


def test_rl_command_lines_of_the_docs_parse_into_rl_config(monkeypatch):
    """Every ``foursight rl`` command line printed in README.md and docs/ parses with the generated flags
    into the RLConfig it spells (the run itself is replaced: only the parsing is under test)."""
    import re
    import shlex

    import foursight.rl.loop as rl_loop  # the command imports run_rl from here when it runs
    from foursight.cli import app
    from foursight.rl import RLConfig

    seen: list[RLConfig] = []
    monkeypatch.setattr(rl_loop, "run_rl", lambda cfg, log=print: seen.append(cfg) or cfg.out)
    repo = Path(__file__).resolve().parent.parent
    lines = []
    for doc in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())
        lines += [m.split("  #")[0] for m in re.findall(r"^\s*(?:\.venv/bin/)?foursight rl (.*)$", text, flags=re.M)]
    assert len(lines) >= 2, lines  # docs/rl.md's "How to run"
    for line in lines:
        r = CliRunner().invoke(app, ["rl", *shlex.split(line)])
        assert r.exit_code == 0, (line, r.output)
        args = shlex.split(line)
        got = seen[-1]
        for flag, value in zip(args[::2], args[1::2]):  # the docs' lines are --flag value pairs
            name = flag[2:].replace("-", "_")
            assert str(getattr(got, name)) == value or getattr(got, name) == type(getattr(got, name))(value), (line, flag)
    # 0 means off for the options whose help says so; a repeatable option collects its values
    CliRunner().invoke(app, ["rl", "--tis-cap", "0", "--error-target", "0", "--bf16-layers", "attention", "--bf16-layers", "last:1",
                             "--time-budget", "5", "--no-follow"])
    assert seen[-1] == RLConfig(tis_cap=None, error_target=None, bf16_layers=["attention", "last:1"], time_budget_s=5.0, follow=False)


# ---- `foursight quantize`: its flags generated from QuantizeConfig parse every command line as the hand-written ones did


def _quantize_lines(model: Path, calib: Path, report: Path) -> list[tuple[list[str], dict]]:
    """Representative `foursight quantize` command lines and the options each must reach ``quantize_model`` with
    (written down from the hand-listed flags of ee7c2bc; this test passed there before QuantizeConfig). Since
    ``quantize_model`` takes the QuantizeConfig itself, the BF16 carve-out reaches it as given, resolved inside."""
    m = str(model)
    base = dict(channels="32", calib=None, ignore=("lm_head",), error_target=None, max_k=None, activation_dtype="nvfp4",
                activation_scale="dynamic", batch_size=8, max_length=256, force=False, model=Path(model), bf16_layers=None)
    return [
        ([], dict(base, out=Path("out/smollm2-foursight"), model=None)),
        (["--model", m, "--out", "o", "--channels", "16"], dict(base, out=Path("o"), channels="16")),
        (["--model", m, "--out", "o", "--channels", "2%", "--ignore", "lm_head", "--ignore", "re:.*down_proj"],
         dict(base, out=Path("o"), channels="2%", ignore=("lm_head", "re:.*down_proj"))),
        (["--model", m, "--out", "o", "--error-target", "0.05", "--max-k", "64"], dict(base, out=Path("o"), error_target=0.05, max_k=64)),
        (["--model", m, "--out", "o", "--activations", "bf16", "--activation-scale", "static", "--channels", "0"],
         dict(base, out=Path("o"), channels="0", activation_dtype="bf16", activation_scale="static")),
        (["--model", m, "--out", "o", "--batch-size", "4", "--max-length", "128", "--force", "--calib", str(calib)],
         dict(base, out=Path("o"), batch_size=4, max_length=128, force=True, calib=calib)),
        (["--model", m, "--out", "o", "--force", "--no-force", "--report", str(report)], dict(base, out=Path("o"))),
        (["--model", m, "--out", "o", "--bf16-layers", "attention", "--bf16-layers", "last:1"],
         dict(base, out=Path("o"), bf16_layers=["attention", "last:1"])),  # resolved inside quantize_model (tests/test_checkpoint.py)
    ]


def test_quantize_command_lines_parse_to_the_same_options(tiny_llama_dir, tmp_path, monkeypatch):
    """Each command line reaches ``quantize_model`` with the options it spelled before QuantizeConfig generated the
    flags (the quantization itself is replaced: only the parsing is under test), and --report is written."""
    from types import SimpleNamespace

    import foursight.bf16_layers
    import foursight.checkpoint
    import foursight.cli as cli

    seen: list[dict] = []

    def fake_quantize(src, out, cfg):
        seen.append(dict(channels=cfg.channels, calib=cfg.calib, ignore=tuple(cfg.ignore), error_target=cfg.error_target,
                         max_k=cfg.max_k, activation_dtype=cfg.activations, activation_scale=cfg.activation_scale,
                         batch_size=cfg.batch_size, max_length=cfg.max_length, force=cfg.force, bf16_layers=cfg.bf16_layers,
                         out=Path(out), model=src))
        return SimpleNamespace(out_dir=Path(out), layers=[], bf16_layers=[])

    monkeypatch.setattr(foursight.checkpoint, "quantize_model", fake_quantize)
    monkeypatch.setattr(cli, "_bf16_source", lambda model, verb: None if model is None else Path(model))
    monkeypatch.setattr(foursight.bf16_layers, "checkpoint_bf16_share",
                        lambda d, carve: {"bf16_layers": [], "bf16_weight_share": 0.0, "bf16_layer_share": 0.0, "bf16_channel_share": 0.0})
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "hello"}\n')
    report = tmp_path / "report.md"
    for args, want in _quantize_lines(tiny_llama_dir, calib, report):
        r = CliRunner().invoke(cli.app, ["quantize", *args])
        assert r.exit_code == 0, (args, r.output, r.exception)
        assert dict(seen[-1], ignore=tuple(seen[-1]["ignore"])) == want, args
    assert report.exists()
