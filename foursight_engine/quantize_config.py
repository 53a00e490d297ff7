"""Options of one ``foursight quantize`` run: :class:`QuantizeConfig`, written once; the CLI's flags are
generated from it (:func:`foursight.cli_config.typer_command`), as ``compare`` and ``rl`` do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from foursight.cli_config import option
from foursight.cli_util import DEFAULT_CHANNELS, CalibOption, ChannelsOption, IgnoreOption, ModelOption


@dataclass
class QuantizeConfig:
    """Options of one quantization (the flags of ``foursight quantize``; each field's help is its flag's help)."""

    model: Optional[str] = option(None, typer_type=ModelOption)
    out: Path = option(Path("out/smollm2-foursight"), help="Checkpoint folder to write.")
    channels: str = option(DEFAULT_CHANNELS, typer_type=ChannelsOption)
    calib: Optional[Path] = option(None, typer_type=CalibOption)
    ignore: list[str] = option(default_factory=lambda: ["lm_head"], typer_type=IgnoreOption)
    bf16_layers: Optional[list[str]] = option(None, help="Whole layers kept in BF16 (the practitioners' carve-out): attention, mlp, "
                                                         "first:N, last:N, block:I, joined by & to intersect, or a name/re: pattern; "
                                                         "repeatable (foursight.bf16_layers).")
    error_target: Optional[float] = option(None, help="Per-layer budget: smallest k (0,16,32,...) with relative output error <= this.")
    max_k: Optional[int] = option(None, min=0, help="Cap on k for --error-target.")
    activations: str = option("nvfp4", help="nvfp4 (W4A4) or bf16 (W4A16).")
    activation_scale: str = option("dynamic", help="dynamic (per-row, at run time) or static (calibrated).")
    batch_size: int = option(8, help="Texts per calibration batch.")
    max_length: int = option(256, help="Tokens per calibration text (longer ones are cut).")
    force: bool = option(False, flag="--force/--no-force", help="Replace --out if it is a FourSight checkpoint (anything else is refused).")
    report: Optional[Path] = option(None, help="Also write the per-layer table as Markdown to this new file (--force replaces a "
                                                "report written before; never a file of --model, --out or --calib).")
