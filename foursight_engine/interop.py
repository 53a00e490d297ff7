"""NVFP4 checkpoints in and out: compressed-tensors ``nvfp4-pack-quantized`` (the format
llm-compressor writes and stock vLLM and transformers read).

The NVFP4 part of a FourSight module already is compressed-tensors' NVFP4 (:mod:`foursight.nvfp4`:
the same E2M1 codes and nibble order, E4M3 block scales of 16, FP32 global scale
``448*6/amax``, the same tensor names ``weight_packed``, ``weight_scale``, ``weight_global_scale``,
``input_global_scale``). So:

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
* :func:`refuse_quantized_model` is what ``quantize`` and ``calibrate`` say when given a model that
  is already quantized.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from foursight import schema
from foursight.schema import CheckpointError, read_config

CT_METHOD = "compressed-tensors"
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
#: tensors of a compressed-tensors NVFP4 module (input_global_scale only with W4A4)
CT_SUFFIXES = (schema.WEIGHT_PACKED, schema.WEIGHT_SCALE, schema.WEIGHT_GLOBAL_SCALE, schema.INPUT_GLOBAL_SCALE)
#: what an imported W4A16 module gets as its (unused) activation global scale
UNUSED_INPUT_SCALE = 1.0


def quant_method(model_dir: str | Path) -> str | None:
    """``quantization_config.quant_method`` of an HF folder (None for a plain model)."""
    qc = read_config(model_dir).get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None


def refuse_quantized_model(model_dir: str | Path, verb: str = "quantize") -> None:
    """Raise CheckpointError saying what ``verb`` needs when ``model_dir`` is already quantized."""
    method = quant_method(model_dir)
    if method is None:
        return
    if method == schema.QUANT_METHOD:
        raise CheckpointError(f"--model {model_dir} is already a FourSight checkpoint; `foursight {verb}` needs the BF16 model it was made from "
                              f"(serve this one with `foursight serve {model_dir}`)")
    if method == CT_METHOD:
        raise CheckpointError(f"--model {model_dir} is a compressed-tensors checkpoint (quant_method 'compressed-tensors'), already quantized; "
                              f"`foursight {verb}` needs the BF16 model. To serve it with --quantization foursight (k = 0), convert it: "
                              f"`foursight import {model_dir} --out DIR`")
    raise CheckpointError(f"--model {model_dir} is already quantized (quantization_config.quant_method {method!r}); `foursight {verb}` needs a BF16 model")


# ---------------------------------------------------------------------------------------------
# checking a compressed-tensors config


def _ct_nvfp4_activations(qc: dict[str, Any], where: str) -> str:
    """Check that ``qc`` is one compressed-tensors NVFP4 scheme FourSight can read; return the
    FourSight ``activation_dtype`` ("nvfp4" for W4A4, "bf16" for W4A16). Errors name the field."""
    from compressed_tensors.quantization import QuantizationConfig

    try:
        cfg = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "quant_method"})
    except Exception as e:  # noqa: BLE001 - pydantic names the field
        raise CheckpointError(f"{where}: invalid compressed-tensors quantization_config ({e})") from None
    if cfg.format != CT_NVFP4_FORMAT:
        raise CheckpointError(f"{where}: quantization_config.format is {cfg.format!r}; FourSight reads {CT_NVFP4_FORMAT!r} only")
    if cfg.kv_cache_scheme is not None:
        raise CheckpointError(f"{where}: quantization_config.kv_cache_scheme is set; FourSight has no quantized KV cache")
    kinds = set()
    for gname, g in cfg.config_groups.items():
        field = f"quantization_config.config_groups.{gname}"
        w, a = g.weights, g.input_activations
        if w is None or (w.num_bits, w.type, w.strategy, w.group_size, w.symmetric, w.dynamic) != (4, "float", "tensor_group", 16, True, False):
            raise CheckpointError(f"{where}: {field}.weights is not NVFP4 (4-bit float, tensor_group, group_size 16, symmetric, static): {w}")
        if g.output_activations is not None:
            raise CheckpointError(f"{where}: {field}.output_activations is set; FourSight quantizes weights and inputs only")
        if a is None:
            kinds.add("bf16")
        elif (a.num_bits, a.type, a.strategy, a.group_size, str(a.dynamic)) == (4, "float", "tensor_group", 16, "local"):
            kinds.add("nvfp4")
        else:
            raise CheckpointError(f"{where}: {field}.input_activations is not NVFP4 (4-bit float, tensor_group 16, dynamic 'local'): {a}")
        if [t for t in g.targets if t != "Linear"]:
            raise CheckpointError(f"{where}: {field}.targets {g.targets}; FourSight reads schemes that target 'Linear'")
    if len(kinds) != 1:
        raise CheckpointError(f"{where}: quantization_config.config_groups mix W4A4 and W4A16 schemes; FourSight needs one activation type")
    return kinds.pop()


def foursight_config_from_ct(qc: dict[str, Any], where: str = "quantization_config") -> "schema.FourSightConfig":
    """The FourSight k = 0 config a compressed-tensors NVFP4 ``quantization_config`` reads as
    (what ``--quantization foursight`` serves a compressed-tensors folder with): the scheme's
    activation type, compressed-tensors' static ``input_global_scale``, its ``ignore`` list (the
    same exact-name / ``re:`` rules), no BF16 channels. Raises CheckpointError naming the field."""
    act = _ct_nvfp4_activations(qc, where)
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise CheckpointError(f"{where}: quantization_config.ignore must be a list of module names, got {ignore!r}")
    return schema.FourSightConfig(activation_dtype=act, activation_scale="static", ignore=list(ignore), channels={},
                                  channel_selection="none", channel_budget="0")


def k0_tensors(weight_packed: torch.Tensor, activation_dtype: str, has_input_scale: bool) -> dict[str, torch.Tensor]:
    """What a FourSight k = 0 module holds beyond compressed-tensors' NVFP4 tensors: the empty
    ``bf16_channels`` / ``weight_bf16``, and for W4A16 (``activation_dtype`` "bf16", which has no
    ``input_global_scale``) the unused activation scale. The one rule of :func:`read_compressed_tensors`
    and of :func:`as_foursight_weights`."""
    n_out = weight_packed.shape[0]
    out = {schema.BF16_CHANNELS: torch.zeros(0, dtype=torch.int32), schema.WEIGHT_BF16: torch.zeros(n_out, 0, dtype=torch.bfloat16)}
    if activation_dtype == "bf16" and not has_input_scale:
        out[schema.INPUT_GLOBAL_SCALE] = torch.tensor([UNUSED_INPUT_SCALE], dtype=torch.float32)
    return out


def as_foursight_weights(weights: Iterable[tuple[str, torch.Tensor]], activation_dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A compressed-tensors NVFP4 checkpoint's ``(name, tensor)`` stream as the FourSight k = 0
    checkpoint it is: every tensor unchanged, and after each ``<module>.weight_packed`` the module's
    :func:`k0_tensors`. An engine loading a compressed-tensors folder with ``--quantization
    foursight`` reads through this, so no conversion is written to disk."""
    for name, t in weights:
        yield name, t
        if name.endswith("." + schema.WEIGHT_PACKED):
            module = name[: -len(schema.WEIGHT_PACKED) - 1]
            # W4A16 schemes have no input_global_scale at all, W4A4 ones always one per module
            for suffix, v in k0_tensors(t, activation_dtype, has_input_scale=activation_dtype != "bf16").items():
                yield f"{module}.{suffix}", v


# ---------------------------------------------------------------------------------------------
# writing


def _meta_model(hf_cfg: dict[str, Any]):
    """The model a config describes, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in hf_cfg.items() if k != "quantization_config"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))


def _linear_names(hf_cfg: dict[str, Any]) -> list[str]:
    """Names of the ``nn.Linear`` modules of the model a config describes (built on the meta device)."""
    from torch import nn

    return [n for n, m in _meta_model(hf_cfg).named_modules() if isinstance(m, nn.Linear)]


def needed_tensors(hf_cfg: dict[str, Any]) -> tuple[list[str], set[str], set[str]]:
    """``(linear layer names, tensor names, tied names)`` of the model a config describes: what a
    checkpoint of it must hold (its state dict, built on the meta device) and what it may leave out
    (the tied weights, e.g. ``lm_head.weight`` with ``tie_word_embeddings``)."""
    from torch import nn

    model = _meta_model(hf_cfg)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if hf_cfg.get("tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False)):
        tied.add("lm_head.weight")
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)], set(model.state_dict()), tied


def check_complete_tensors(names: "Iterable[str]", quantized: "Iterable[str]", hf_cfg: dict[str, Any], where: str) -> None:
    """Compare a checkpoint's tensor ``names`` with those its model needs (:func:`needed_tensors`):
    every parameter of a layer not in ``quantized`` must be present (tied ones may be absent) and
    no tensor may be outside the model. ``quantized`` modules' own tensors are checked by
    :func:`foursight.schema.decode_module`. Raises CheckpointError naming the first missing or
    unexpected tensor."""
    linears, want, tied = needed_tensors(hf_cfg)
    quantized = set(quantized)
    have = set(names)
    missing = sorted(n for n in want - have - tied if n.rpartition(".")[0] not in quantized)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]} in {where}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                              + ": the model its config.json describes needs it")
    unexpected = sorted(n for n in have - want if n.rpartition(".")[0] not in quantized)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in {where}: not a tensor of the model its config.json describes"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))


def _save(out_dir: Path, src_dir: Path, hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor], force: bool, verb: str,
          channels_file: "schema.ChannelsFile | None" = None, metadata: dict[str, str] | None = None) -> Path:
    """Write ``config.json``, the tensors (:func:`foursight.checkpoint.write_safetensors`: one
    ``model.safetensors`` or index + shards, with ``metadata``, default FourSight's) and the
    tokenizer/generation files of ``src_dir`` (and ``channels_file`` as ``foursight_channels.json``
    when given) to ``out_dir`` through the one folder writer (:func:`foursight.folder_writer.folder_writer`:
    the incomplete-run marker, the ``--force`` rule, a temporary folder renamed at the end)."""
    from foursight.checkpoint import write_safetensors
    from foursight.folder_writer import folder_writer

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

    from foursight.checkpoint import load_quantized_tensors
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
    ignore = [n for n in _linear_names(hf_cfg) if n not in mods]
    preset = "NVFP4" if cfg.activation_dtype == "nvfp4" else "NVFP4A16"
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=CT_NVFP4_FORMAT,
                            quantization_status=QuantizationStatus.COMPRESSED, ignore=ignore)
    d = qc.to_dict()
    d["quant_method"] = CT_METHOD
    hf_cfg["quantization_config"] = json.loads(json.dumps(d, default=str))
    return _save(out_dir, ckpt_dir, hf_cfg, out, force, "export", metadata={"format": "pt"})


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
        return _save(out_dir, ct_dir, hf_cfg, tensors, force, "import")
    hf_cfg, tensors, cf = compensate_import(ct_dir, hf_cfg, tensors, channels, calib, batch_size=batch_size,
                                            max_length=max_length, progress=progress)
    return _save(out_dir, ct_dir, hf_cfg, tensors, force, "import", channels_file=cf)


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
    BF16 channels included) and every other parameter as stored. CheckpointError names a missing
    or unexpected tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from foursight.checkpoint import split_modules
    from foursight.layer import dequantize_weight

    qc = schema.FourSightConfig.parse(hf_cfg["quantization_config"])
    raw = {k: v for k, v in hf_cfg.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mods, rest = split_modules(tensors)
    sd = dict(rest)
    for name, t in mods.items():
        n_out, k_half = t[schema.WEIGHT_PACKED].shape
        qw = schema.decode_module(name, t, n_out, 2 * k_half, qc.channels_for(name))
        sd[f"{name}.weight"] = dequantize_weight(qw, torch.bfloat16)
        if schema.BIAS in t:
            sd[f"{name}.bias"] = t[schema.BIAS]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in checkpoint")
    if tied:
        model.tie_weights()
    return model.eval()


def compensate_import(ct_dir: str | Path, hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor], channels: str | int,
                      calib: str | Path | None = None, batch_size: int = 8, max_length: int = 256,
                      progress: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor], "schema.ChannelsFile"]:
    """Add activation-side compensation to the FourSight k = 0 form ``(hf_cfg, tensors)`` of an
    imported W4A4 checkpoint (:func:`read_compressed_tensors` of ``ct_dir``, whose tokenizer is used).

    1. The dequantized BF16 model (:func:`dequantized_model`) runs the calibration of ``foursight
       quantize`` (:func:`foursight.calibration.collect_stats` on ``calib`` or the built-in texts):
       per input group (q/k/v, gate/up share one) the channel variance and the input amax.
    2. Per group, k from ``channels`` exactly as ``quantize_model`` turns its ``--channels`` into k
       (:func:`foursight.channels.choose_k`), S = the top-k channels by variance
       (:func:`foursight.channels.select_channels`).
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
    from foursight.channels import choose_k, select_channels
    from foursight.checkpoint import find_linears, split_modules
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
    cf = schema.ChannelsFile()
    ks: dict[str, int] = {}
    for g in groups.values():
        deq = {n: model.get_submodule(n).weight.detach() for n in g.members}
        k = choose_k(g, list(deq.values()), str(channels))
        ch = select_channels(g.stats.variance, k)
        fp4_amax = g.stats.fp4_amax(ch)
        in_gs = schema.static_input_scale([fp4_amax])
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
            cf.channels[n] = [int(c) for c in ch]
            cf.input_amax[n] = fp4_amax
    fs = qc.model_copy(update={"channels": {n: ks[n] for n in names}, "channel_budget": str(channels),
                               "channel_selection": "calibration" if any(ks.values()) else "none"})
    hf_cfg = dict(hf_cfg, quantization_config=schema.FourSightConfig.parse(fs.model_dump()).model_dump())
    return hf_cfg, out, cf


def read_compressed_tensors(ct_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, tensors)`` of the FourSight k = 0 form of a compressed-tensors NVFP4 checkpoint.

    The NVFP4 tensors are copied bit for bit; each module gets the empty ``bf16_channels`` and
    ``weight_bf16`` of k = 0; ``activation_scale`` is "static" (compressed-tensors' calibrated
    ``input_global_scale``); a W4A16 scheme becomes ``activation_dtype="bf16"`` with an unused
    ``input_global_scale`` of 1. Fused modules (q/k/v, gate/up) keep their own global scales
    (vLLM's FourSight loader gives each shard its own). Raises CheckpointError naming the field or
    tensor when the checkpoint is not a compressed-tensors NVFP4 one FourSight can read.
    """
    from foursight.checkpoint import read_tensors

    ct_dir = Path(ct_dir)
    hf_cfg = read_config(ct_dir)
    qc = hf_cfg.get("quantization_config")
    where = str(ct_dir / "config.json")
    if qc is None:
        raise CheckpointError(f"{where}: no quantization_config: {ct_dir} is not a compressed-tensors checkpoint (a BF16 model? "
                              f"make a FourSight checkpoint with `foursight quantize --model {ct_dir}`)")
    if not isinstance(qc, dict) or qc.get("quant_method") != CT_METHOD:
        got = qc.get("quant_method") if isinstance(qc, dict) else None
        raise CheckpointError(f"{where}: quantization_config.quant_method is {got!r}, not {CT_METHOD!r}")
    act = _ct_nvfp4_activations(qc, where)
    tensors = read_tensors(ct_dir)
    prefixes = sorted({n[: -len(schema.WEIGHT_PACKED) - 1] for n in tensors if n.endswith("." + schema.WEIGHT_PACKED)})
    if not prefixes:
        raise CheckpointError(f"{ct_dir}: no {schema.WEIGHT_PACKED} tensors (is it compressed, quantization_status 'compressed'?)")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    channels: dict[str, int] = {}
    for name in prefixes:
        t = {s: tensors[f"{name}.{s}"] for s in (*CT_SUFFIXES, schema.BIAS) if f"{name}.{s}" in tensors}
        used.update(f"{name}.{s}" for s in t)
        t.update(k0_tensors(t[schema.WEIGHT_PACKED], act, has_input_scale=schema.INPUT_GLOBAL_SCALE in t))
        for s in (schema.WEIGHT_GLOBAL_SCALE, schema.INPUT_GLOBAL_SCALE):
            if s in t:  # a missing one is named by decode_module below
                t[s] = t[s].float().reshape(-1)
        n_out, k_half = t[schema.WEIGHT_PACKED].shape
        schema.decode_module(name, t, n_out, 2 * k_half, 0)
        out.update({f"{name}.{s}": v for s, v in t.items()})
        channels[name] = 0
    for n, v in tensors.items():
        if n in used:
            continue
        pre, _, suf = n.rpartition(".")
        if pre in channels:
            raise CheckpointError(f"unexpected tensor {n} in the compressed-tensors checkpoint (FourSight reads {', '.join(CT_SUFFIXES)} and bias)")
        out[n] = v
    linears = _linear_names(hf_cfg)
    stray = sorted(set(prefixes) - set(linears))
    if stray:
        raise CheckpointError(f"unexpected tensor {stray[0]}.{schema.WEIGHT_PACKED}: {stray[0]} is not a linear layer of this model")
    check_complete_tensors(out, prefixes, hf_cfg, f"the compressed-tensors checkpoint {ct_dir}")
    fs = schema.FourSightConfig(activation_dtype=act, activation_scale="static", ignore=[n for n in linears if n not in channels],
                                channels=channels, channel_selection="none", channel_budget="0")
    hf_cfg["quantization_config"] = fs.model_dump()
    return hf_cfg, out

