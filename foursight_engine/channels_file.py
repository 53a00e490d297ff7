"""``foursight calibrate``: calibrate a BF16 model and write a channels file (no quantization).

The file format and its rules belong to :class:`foursight.schema.ChannelsFile`; this module only
fills one from calibration statistics, with the same channel selection and the same FP4-part
amax as ``foursight quantize`` writes beside a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from foursight import schema


def calibrate_channels(model_dir, out, channels="32", calib=None, ignore=("lm_head",), batch_size=8, max_length=256) -> Path:
    """Calibrate the BF16 model in ``model_dir`` and write the channels file ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.calibration import check_calibration_batches, collect_stats, load_calibration_texts
    from foursight.channels import choose_channels
    from foursight.checkpoint import check_model_quantizable, find_linears

    schema.check_channels_destination(out)  # before the slow part
    schema.check_channel_spec(channels)
    check_calibration_batches(batch_size, max_length)
    cfg = schema.FourSightConfig(ignore=list(ignore))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    names = find_linears(model, cfg)
    check_model_quantizable(model, names)
    groups = collect_stats(model, tok, load_calibration_texts(calib), names, batch_size=batch_size, max_length=max_length)
    cf = schema.ChannelsFile()
    for g in groups.values():
        choice = choose_channels(g, [], channels)
        for n in g.members:
            cf.channels[n] = [int(c) for c in choice.channels]
            cf.input_amax[n] = choice.fp4_amax
    return cf.write(out)
