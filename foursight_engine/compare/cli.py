"""``foursight compare``: the command, generated from :class:`~foursight.compare.config.CompareConfig`."""

from __future__ import annotations

import dataclasses
import sys

from foursight.cli_config import typer_command
from foursight.cli_util import guarded
from foursight.compare.config import CompareConfig
from foursight.compare.run import run_compare
from foursight.compare.spec import CompareError, parse_engines


def compare(cfg: CompareConfig) -> None:
    """Measure training-inference mismatch across engines and precisions; write report.md, metrics.json and plots.

    The first of --engines generates the rollouts unless --generator is given; every engine and the
    learner (HF BF16) then score the identical tokens teacher-forced. FourSight/NVFP4 checkpoints are
    made with `foursight quantize` (--channels) unless given.
    """
    from foursight.models import resolve_model

    specs = parse_engines(cfg.engines)
    if cfg.attribute_by not in ("type", "block"):
        raise CompareError("--attribute-by must be 'type' or 'block'")
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        cfg = dataclasses.replace(cfg, command="foursight compare " + " ".join(sys.argv[2:]))
    run_compare(resolve_model(cfg.model), specs, cfg)
    print(f"report: {cfg.out / 'report.md'}")


compare_command = guarded(typer_command(CompareConfig, compare))
