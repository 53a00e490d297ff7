"""Options written once: a config dataclass generates its verb's flags (foursight.cli_config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

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


def test_compare_flags_are_exactly_compare_config():
    """Every CompareConfig option is a flag of `foursight compare` with the config's default, and no other
    flag exists (the defaults live once, in CompareConfig)."""
    from foursight.cli import app
    from foursight.compare.config import CompareConfig

    cmd = typer.main.get_command(app).commands["compare"]  # type: ignore[attr-defined]
    params = {p.name: p for p in cmd.params if p.name != "help"}
    fields = {f.name: f for f in cli_fields(CompareConfig)}
    assert set(params) == set(fields)
    for name, f in fields.items():
        default = f.default
        got = params[name].default
        assert (got if not isinstance(default, Path) else Path(got)) == default or (default is None and got in (None, ())), name
        if name != "model" and name != "channels":
            assert flag_name(f) in params[name].opts


def test_rl_command_lines_of_the_docs_parse_into_rl_config(monkeypatch):
    """Every ``foursight rl`` command line printed in README.md and docs/ parses with the generated flags
    into the RLConfig it spells (the run itself is replaced: only the parsing is under test)."""
    import re
    import shlex

    import foursight.rl.cli as rl_cli
    from foursight.cli import app
    from foursight.rl import RLConfig

    seen: list[RLConfig] = []
    monkeypatch.setattr(rl_cli, "run_rl", lambda cfg, log=print: seen.append(cfg) or cfg.out)
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
