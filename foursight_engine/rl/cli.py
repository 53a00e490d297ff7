"""``foursight rl``: the command, generated from :class:`~foursight.rl.config.RLConfig` (one flag per field).
Light imports only: the training loop is imported when the command runs."""

from __future__ import annotations

import typer

from foursight.cli_config import typer_command
from foursight.cli_util import guarded
from foursight.rl.config import RLConfig


def rl(cfg: RLConfig) -> None:
    """GRPO with BF16 / FP8 / NVFP4 / FourSight (W4A4 or W4A16) rollouts on a verifiable task; logs JSONL (see docs/rl.md)."""
    from foursight.rl.loop import run_rl  # when the command runs: the loop imports torch and the engines, --help does not

    typer.echo(f"wrote {run_rl(cfg, log=typer.echo)}")


rl_command = guarded(typer_command(RLConfig, rl))
