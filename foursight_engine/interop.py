"""NVFP4 checkpoints in and out: ``foursight export`` and ``foursight import``, between FourSight
checkpoints and compressed-tensors ``nvfp4-pack-quantized`` ones (the format llm-compressor writes and
stock vLLM and transformers read; how FourSight reads it: :mod:`foursight.compressed_tensors_format`).

* :func:`export_compressed_tensors` writes a plain-NVFP4 (k = 0) FourSight checkpoint as a
  compressed-tensors one: the same tensors minus the empty ``bf16_channels`` / ``weight_bf16``,
  and a ``quantization_config`` built by the compressed-tensors library (its ``NVFP4`` preset,
  W4A4 with the checkpoint's static ``input_global_scale``; ``NVFP4A16`` for a W4A16 checkpoint).
  A checkpoint with BF16 channels (k > 0) has no compressed-tensors form and is refused, naming a layer.
* :func:`import_compressed_tensors` turns a compressed-tensors NVFP4 checkpoint into a FourSight
  k = 0 checkpoint (static activation scales: compressed-tensors' convention), which
  ``--quantization foursight``, ``foursight inspect`` and the reference model take; every other
  compressed-tensors scheme is refused naming the field. With a channel budget (``channels``
  giving k > 0, W4A4 only) it adds activation-side compensation (:func:`compensate_import`): S is
  chosen by calibrating the dequantized model, the NVFP4 tensors stay the imported ones bit for
  bit, ``weight_bf16`` is ``deq(Wq)[:, S]`` and the static input scales are recalibrated.

Both write through the one folder writer (:func:`write_checkpoint_folder`, :mod:`foursight.folder_writer`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from foursight import schema
from foursight.channels_file import ChannelsFile
from foursight.compressed_tensors_format import CT_METHOD, CT_NVFP4_FORMAT, CT_SUFFIXES, linear_names, read_compressed_tensors
from foursight.schema import CheckpointError, read_config

def write_checkpoint_folder(out_dir: Path, src_dir: Path, hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor], force: bool, verb: str,
          channels_file: "ChannelsFile | None" = None, metadata: dict[str, str] | None = None) -> Path:
    """Write ``config.json``, the tensors (:func:`foursight.tensor_io.write_safetensors`: one
    ``model.safetensors`` or index + shards, with ``metadata``, default FourSight's) and the
    tokenizer/generation files of ``src_dir`` (and ``channels_file`` as ``foursight_channels.json``
    when given) to ``out_dir`` through the one folder writer (:func:`foursight.folder_writer.folder_writer`:
    the incomplete-run marker, the ``--force`` rule, a temporary folder renamed at the end)."""
    from foursight.folder_writer import folder_writer
    from foursight.tensor_io import write_safetensors

    with folder_writer(out_dir, force, verb) as tmp:
        write_safetensors(tmp, tensors, metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        for f in src_dir.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template"))
                                or f.name in ("vocab.json", "merges.txt")):
                shutil.copy2(f, tmp / f.name)
        if channels_file is not None:
            channels_file.write(tmp / schema.CHANNELS_FILE)
    return out_dir


def export_compressed_tensors(ckpt_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write the plain-NVFP4 FourSight checkpoint ``ckpt_dir`` (k = 0 everywhere) as a
    compressed-tensors ``nvfp4-pack-quantized`` checkpoint in ``out_dir``.

    Every FourSight module is checked by :func:`foursight.schema.decode_module` first. The
    activation scale the exported model uses is the checkpoint's calibrated ``input_global_scale``
    (compressed-tensors' static scale); a ``activation_scale="dynamic"`` FourSight checkpoint
    computes a per-row scale instead, so its exported model's activations round differently.
    Raises CheckpointError naming the layer with k > 0 or the tensor that is invalid.
    """
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    from foursight.tensor_io import load_quantized_tensors
    from foursight.folder_writer import prepare_destination

    ckpt_dir = Path(ckpt_dir)
    out_dir = prepare_destination(out_dir, force, source=ckpt_dir, verb="export")  # resolved, before anything else
    cfg, mods, rest = load_quantized_tensors(ckpt_dir)
    with_k = sorted(n for n, k in cfg.channels.items() if k)
    if with_k:
        raise CheckpointError(f"layer {with_k[0]} keeps {cfg.channels[with_k[0]]} BF16 channels (and {len(with_k) - 1} more layers); "
                              "compressed-tensors has no form for them: export a plain-NVFP4 checkpoint (`foursight quantize --channels 0`)")
    hf_cfg = read_config(ckpt_dir)
    out: dict[str, torch.Tensor] = dict(rest)
    for name, t in mods.items():
        if schema.WEIGHT_PACKED not in t:
            raise CheckpointError(f"missing tensor {name}.{schema.WEIGHT_PACKED}")
        n_out, k_half = t[schema.WEIGHT_PACKED].shape
        schema.decode_module(name, t, n_out, 2 * k_half, 0)  # every tensor checked, names the culprit
        keep = CT_SUFFIXES if cfg.activation_dtype == "nvfp4" else CT_SUFFIXES[:3]
        out.update({f"{name}.{s}": t[s] for s in keep})
        if schema.BIAS in t:
            out[f"{name}.{schema.BIAS}"] = t[schema.BIAS]
    ignore = [n for n in linear_names(hf_cfg) if n not in mods]
    preset = "NVFP4" if cfg.activation_dtype == "nvfp4" else "NVFP4A16"
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=CT_NVFP4_FORMAT,
                            quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    d = qc.to_dict()
    d["quant_method"] = CT_METHOD
    hf_cfg["quantization_config"] = json.loads(json.dumps(d, default=str))
    return write_checkpoint_folder(out_dir, ckpt_dir, hf_cfg, out, force, "export", metadata={"format": "pt"})


def import_compressed_tensors(ct_dir: str | Path, out_dir: str | Path, channels: str | int = "0", calib: str | Path | None = None,
                              force: bool = False, *, batch_size: int = 8, max_length: int = 256, progress: bool = True) -> Path:
    """Convert a compressed-tensors NVFP4 checkpoint into a FourSight checkpoint, written atomically.

    Args:
        ct_dir: a compressed-tensors ``nvfp4-pack-quantized`` folder (:func:`read_compressed_tensors`).
        out_dir: the FourSight checkpoint folder to write (must not exist unless ``force``).
        channels: BF16 channels per input group, as ``foursight quantize --channels``: a count or a
            percentage of K (:func:`foursight.schema.parse_channel_budget`). When it gives k = 0 for
            every layer (the default) the result is the plain k = 0 import: no calibration, the
            checkpoint's own static input scales. Otherwise :func:`compensate_import` adds the channels.
        calib: calibration JSONL for the channel choice (None: the built-in texts ``quantize`` uses);
            only used when ``channels`` gives k > 0.
        batch_size, max_length, progress: of the calibration (as ``quantize``).
    Raises:
        CheckpointError naming the field, layer or tensor (a scheme FourSight cannot read, a
        ``channels`` budget with k ≥ K for some layer, compensation asked of a W4A16 checkpoint).
    """
    from foursight.folder_writer import prepare_destination

    ct_dir = Path(ct_dir)
    out_dir = prepare_destination(out_dir, force, source=ct_dir, verb="import")  # resolved, before the slow part
    hf_cfg, tensors = read_compressed_tensors(ct_dir)
    ks = _budget_per_layer(tensors, channels)
    if not any(ks.values()):
        return write_checkpoint_folder(out_dir, ct_dir, hf_cfg, tensors, force, "import")
    hf_cfg, tensors, cf = compensate_import(ct_dir, hf_cfg, tensors, channels, calib, batch_size=batch_size,
                                            max_length=max_length, progress=progress)
    return write_checkpoint_folder(out_dir, ct_dir, hf_cfg, tensors, force, "import", channels_file=cf)


def _budget_per_layer(tensors: dict[str, torch.Tensor], channels: str | int) -> dict[str, int]:
    """k of every FourSight module of ``tensors`` under the budget ``channels`` (checked against each
    layer's K before any slow work; CheckpointError names the layer)."""
    out = {}
    for n, t in tensors.items():
        if n.endswith("." + schema.WEIGHT_PACKED):
            name = n[: -len(schema.WEIGHT_PACKED) - 1]
            out[name] = schema.parse_channel_budget(channels, 2 * t.shape[1], layer=name)
    return out


def dequantized_model(hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor]):
    """The BF16 HF model of a FourSight checkpoint's ``(config, tensors)`` with every FourSight
    module as a plain ``nn.Linear`` holding its dequantized weight (``dequantize_weight`` in BF16,
    BF16 channels included) and every other parameter as stored (:func:`foursight.hf.model_from_tensors`,
    which names a missing or unexpected tensor)."""
    from foursight.tensor_io import split_modules
    from foursight.hf import bf16_linear, model_from_tensors
    from foursight.layer import dequantize_weight

    def dequantized(name, t, lin, qc):
        qw = schema.decode_module(name, t, lin.out_features, lin.in_features, qc.channels_for(name))
        if (lin.bias is not None) != (schema.BIAS in t):
            raise CheckpointError(f"layer {name}: bias {'missing' if lin.bias is not None else 'unexpected'} ({name}.bias)")
        return bf16_linear(dequantize_weight(qw, torch.bfloat16), t.get(schema.BIAS))

    return model_from_tensors(hf_cfg, *split_modules(tensors), make_layer=dequantized)


def compensate_import(ct_dir: str | Path, hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor], channels: str | int,
                      calib: str | Path | None = None, batch_size: int = 8, max_length: int = 256,
                      progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor], "ChannelsFile"]:
    """Add activation-side compensation to the FourSight k = 0 form ``(hf_cfg, tensors)`` of an
    imported W4A4 checkpoint (:func:`read_compressed_tensors` of ``ct_dir``, whose tokenizer is used).

    1. The dequantized BF16 model (:func:`dequantized_model`) runs the calibration of ``foursight
       quantize`` (:func:`foursight.calibration.collect_stats` on ``calib`` or the built-in texts):
       per input group (q/k/v, gate/up share one) the channel variance and the input amax.
    2. Per group, k and S exactly as ``quantize_model`` chooses them (:func:`foursight.channels.choose_channels`:
       k from ``channels``, S = the top-k channels by variance, and the amax of the FP4 part of the input).
    3. Per member: ``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` stay the imported
       tensors **bit for bit**; ``bf16_channels`` = S; ``weight_bf16`` = ``deq(Wq)[:, S]`` in BF16
       (the dequantized weight is the only one there is); ``input_global_scale`` =
       ``448·6 / amax`` of the calibrated FP4 part of the input (S zeroed), shared by the group —
       ``quantize``'s static scale. ``config.json``'s ``channels``, ``channel_selection`` and
       ``channel_budget`` are written as ``quantize`` writes them, and the channels file as
       ``foursight_channels.json``.

    The packed codes of the S columns are *not* zeroed, and need not be: every FourSight forward
    multiplies them by activation columns that are exactly 0 (:func:`foursight.layer.reference_linear`
    zeroes X[:, S] before quantizing, or in W4A16, and code 0 dequantizes to 0; the CUDA execution
    form zeroes those nibbles itself, ``kernels/prepared.py``), so the output is the same as with
    zeroed codes (tested bit for bit on the reference model).

    Compensation needs quantized activations: with only the dequantized weights, a W4A16 layer's
    ``X[:, S] · deq(Wq)[:, S]ᵀ`` is the product the FP4 part already computes, so a W4A16 import is
    refused (CheckpointError naming the field).
    Returns ``(hf_cfg, tensors, channels_file)``.
    """
    from transformers import AutoTokenizer

    from foursight.calibration import collect_stats, load_calibration_texts
    from foursight.channels import choose_channels
    from foursight.schema import find_linears
    from foursight.tensor_io import split_modules
    from foursight.layer import dequantize_weight

    ct_dir = Path(ct_dir)
    qc = schema.FourSightConfig.parse(hf_cfg["quantization_config"])
    if qc.activation_dtype != "nvfp4":
        raise CheckpointError(
            f"{ct_dir / 'config.json'}: --channels {channels} asks for BF16 channels, but the checkpoint is W4A16 "
            "(quantization_config.config_groups.*.input_activations is null): its activations are not quantized and only the "
            "dequantized weights exist, so X[:, S]·deq(W)[:, S] is what the FP4 part already computes and compensation changes "
            "nothing; import it with --channels 0")
    _budget_per_layer(tensors, channels)  # every layer's K checked before the slow part
    mods, rest = split_modules(tensors)
    model = dequantized_model(hf_cfg, tensors)
    names = find_linears(model, qc)
    absent = sorted(set(names) ^ set(mods))
    if absent:
        raise CheckpointError(f"layer {absent[0]}: FourSight tensors and the model's quantized linear layers differ")
    tok = AutoTokenizer.from_pretrained(ct_dir)
    groups = collect_stats(model, tok, load_calibration_texts(calib), names, batch_size=batch_size, max_length=max_length,
                           progress=progress)
    never = [n for n in names if not any(n in g.members for g in groups.values())]
    if never:
        raise CheckpointError(f"layers never called during calibration: {never[:5]}")
    out = dict(rest)
    cf = ChannelsFile()
    ks: dict[str, int] = {}
    for g in groups.values():
        choice = choose_channels(g, [model.get_submodule(n).weight.detach() for n in g.members], str(channels))
        k, ch, fp4_amax, in_gs = choice.k, choice.channels, choice.fp4_amax, choice.input_global_scale
        for n in g.members:
            t = dict(mods[n])
            n_out, k_half = t[schema.WEIGHT_PACKED].shape
            qw0 = schema.decode_module(n, t, n_out, 2 * k_half, 0)
            t[schema.BF16_CHANNELS] = ch.clone()
            t[schema.WEIGHT_BF16] = dequantize_weight(qw0, torch.float32, include_bf16=False)[:, ch.long()].to(torch.bfloat16).contiguous()
            t[schema.INPUT_GLOBAL_SCALE] = in_gs.clone()
            schema.decode_module(n, t, n_out, 2 * k_half, k)
            out.update({f"{n}.{s}": v for s, v in t.items()})
            ks[n] = k
        cf.record(g.members, ch, fp4_amax)
    fs = qc.model_copy(update={"channels": {n: ks[n] for n in names}, "channel_budget": str(channels),
                               "channel_selection": "calibration" if any(ks.values()) else "none"})
    hf_cfg = dict(hf_cfg, quantization_config=schema.FourSightConfig.parse(fs.model_dump()).model_dump())
    return hf_cfg, out, cf
