"""Channels files (``foursight_channels.json``): channel sets for online (load-time) quantization.

Format: ``{"format_version": 1, "channels": {module: [sorted int indices]}, "input_amax": {module: float}}``.
Written by ``foursight calibrate`` and beside every checkpoint by ``foursight quantize``; read by
the engine adapters when they quantize a BF16 model at load time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from foursight import schema


def read_channels_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Module name → int32 channel set. Raises :class:`schema.CheckpointError` naming the bad field."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise schema.CheckpointError(f"channels file {p}: cannot read ({e})") from None
    if not isinstance(raw, dict) or raw.get("format_version") != schema.FORMAT_VERSION:
        raise schema.CheckpointError(f"channels file {p}: format_version must be {schema.FORMAT_VERSION}")
    unknown = set(raw) - {"format_version", "channels", "input_amax"}
    if unknown:
        raise schema.CheckpointError(f"channels file {p}: unknown key(s) {sorted(unknown)}")
    chans = raw.get("channels")
    if not isinstance(chans, dict):
        raise schema.CheckpointError(f"channels file {p}: 'channels' must be an object")
    out = {}
    for name, idx in chans.items():
        if not isinstance(idx, list) or not all(isinstance(i, int) and i >= 0 for i in idx):
            raise schema.CheckpointError(f"channels file {p}: channels[{name!r}] must be a list of non-negative ints")
        out[name] = torch.tensor(sorted(idx), dtype=torch.int32)
    return out


def calibrate_channels(model_dir, out, channels="32", calib=None, ignore=("lm_head",), batch_size=8, max_length=256) -> Path:
    """Calibrate a BF16 model and write a channels file (no quantization)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.calibration import collect_stats, load_calibration_texts, select_channels
    from foursight.checkpoint import check_model_quantizable, find_linears

    cfg = schema.FourSightConfig(ignore=list(ignore))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    names = find_linears(model, cfg)
    check_model_quantizable(model, names)
    groups = collect_stats(model, tok, load_calibration_texts(calib), names, batch_size=batch_size, max_length=max_length)
    sets, amax = {}, {}
    for g in groups.values():
        k = schema.parse_channel_budget(channels, g.in_features, layer=g.members[0])
        ch = select_channels(g.stats.variance, k)
        for n in g.members:
            sets[n] = [int(c) for c in ch]
            amax[n] = float(g.stats.amax.amax())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps({"format_version": schema.FORMAT_VERSION, "channels": sets, "input_amax": amax}))
    tmp.replace(out)
    return out


def linear_names(model: nn.Module, ignore=("lm_head",)) -> list[str]:
    cfg = schema.FourSightConfig(ignore=list(ignore))
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not cfg.is_ignored(n)]
