"""``foursight calibrate``: calibrate a BF16 model and write a channels file (no quantization).

The file format and its rules belong to :class:`foursight.schema.ChannelsFile`; this module only
fills one from calibration statistics, with the same channel selection and the same FP4-part
amax as ``foursight quantize`` writes beside a checkpoint. ``--out`` is resolved first, as the
folder writer resolves it (:func:`foursight.folder_writer.resolve_out`); an existing file is
replaced only with ``force``, and only when it is a channels file (:func:`prepare_channels_destination`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from foursight import schema


def prepare_channels_destination(out: str | Path, force: bool = False) -> Path:
    """The resolved ``out`` of a channels file, checked before any slow work: a folder there is refused; an
    existing file only with ``force``, and then only a channels file (:meth:`foursight.schema.ChannelsFile.read`
    accepts it); every refusal is a :class:`FileExistsError` naming it, and nothing is changed."""
    from foursight.folder_writer import resolve_out

    p = resolve_out(out)
    schema.check_channels_destination(p)
    if p.exists() or p.is_symlink():
        if not force:
            raise FileExistsError(f"{p} exists; pass --force to replace it")
        if p.is_symlink() or not p.is_file():
            raise FileExistsError(f"refusing to replace {p} with --force: it is not a regular file; nothing was changed")
        try:
            schema.ChannelsFile.read(p)
        except schema.CheckpointError as e:
            raise FileExistsError(f"refusing to replace {p} with --force: it is not a channels file ({e}); nothing was changed, "
                                  "choose another --out") from None
    return p


def calibrate_channels(model_dir, out, channels="32", calib=None, ignore=("lm_head",), batch_size=8, max_length=256,
                       force: bool = False) -> Path:
    """Calibrate the BF16 model in ``model_dir`` and write the channels file ``out``
    (:func:`prepare_channels_destination`: an existing file only with ``force``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.calibration import check_calibration_batches, collect_stats, load_calibration_texts
    from foursight.channels import choose_channels
    from foursight.checkpoint import check_model_quantizable, find_linears

    out = prepare_channels_destination(out, force)  # before the slow part
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
    prepare_channels_destination(out, force)  # again: another run may have written it meanwhile
    return cf.write(out)
