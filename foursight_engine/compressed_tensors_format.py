"""Compressed-tensors NVFP4 checkpoints as FourSight reads them: the FourSight k = 0 checkpoint
each one is, without writing anything.

The NVFP4 part of a FourSight module already is compressed-tensors' NVFP4 (:mod:`foursight.nvfp4`:
the same E2M1 codes and nibble order, E4M3 block scales of 16, FP32 global scale ``448*6/amax``, the
same tensor names ``weight_packed``, ``weight_scale``, ``weight_global_scale``, ``input_global_scale``).
So a compressed-tensors ``nvfp4-pack-quantized`` checkpoint reads as a FourSight k = 0 one:

* :func:`foursight_config_from_ct` — its ``quantization_config`` as a FourSight config (every scheme
  FourSight cannot read refused naming the field, :func:`nvfp4_activation_dtype`);
* :func:`as_foursight_weights` — its tensor stream with the empty k = 0 tensors added
  (:func:`k0_tensors`): what ``--quantization foursight`` serves it through, unconverted;
* :func:`read_compressed_tensors` — config and tensors of the whole folder, checked against the model
  its config.json describes (:func:`check_complete_tensors`): what ``inspect`` and ``import`` read;
* :func:`refuse_quantized_model` — what ``quantize`` and ``calibrate`` say when given a model that is
  already quantized.

Writing (``foursight export`` / ``import``) is :mod:`foursight.interop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from foursight import schema
from foursight.schema import CheckpointError, read_config
from foursight.tensor_io import iter_safetensors

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


def nvfp4_activation_dtype(qc: dict[str, Any], where: str) -> str:
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
    act = nvfp4_activation_dtype(qc, where)
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
# what a checkpoint of a model must hold


def meta_model(hf_cfg: dict[str, Any]):
    """The model a config describes, built on the meta device (no memory, no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in hf_cfg.items() if k != "quantization_config"}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))


def linear_names(hf_cfg: dict[str, Any]) -> list[str]:
    """Names of the ``nn.Linear`` modules of the model a config describes (built on the meta device)."""
    from torch import nn

    return [n for n, m in meta_model(hf_cfg).named_modules() if isinstance(m, nn.Linear)]


def needed_tensors(hf_cfg: dict[str, Any]) -> tuple[list[str], set[str], set[str]]:
    """``(linear layer names, tensor names, tied names)`` of the model a config describes: what a
    checkpoint of it must hold (its state dict, built on the meta device) and what it may leave out
    (the tied weights, e.g. ``lm_head.weight`` with ``tie_word_embeddings``)."""
    from torch import nn

    model = meta_model(hf_cfg)
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

def read_compressed_tensors(ct_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json dict, tensors)`` of the FourSight k = 0 form of a compressed-tensors NVFP4 checkpoint.

    The NVFP4 tensors are copied bit for bit; each module gets the empty ``bf16_channels`` and
    ``weight_bf16`` of k = 0; ``activation_scale`` is "static" (compressed-tensors' calibrated
    ``input_global_scale``); a W4A16 scheme becomes ``activation_dtype="bf16"`` with an unused
    ``input_global_scale`` of 1. Fused modules (q/k/v, gate/up) keep their own global scales
    (vLLM's FourSight loader gives each shard its own). Raises CheckpointError naming the field or
    tensor when the checkpoint is not a compressed-tensors NVFP4 one FourSight can read.
    """
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
    act = nvfp4_activation_dtype(qc, where)
    tensors = dict(iter_safetensors(ct_dir))  # every tensor checked finite; the error names it (or the file)
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
    linears = linear_names(hf_cfg)
    stray = sorted(set(prefixes) - set(linears))
    if stray:
        raise CheckpointError(f"unexpected tensor {stray[0]}.{schema.WEIGHT_PACKED}: {stray[0]} is not a linear layer of this model")
    check_complete_tensors(out, prefixes, hf_cfg, f"the compressed-tensors checkpoint {ct_dir}")
    fs = schema.FourSightConfig(activation_dtype=act, activation_scale="static", ignore=[n for n in linears if n not in channels],
                                channels=channels, channel_selection="none", channel_budget="0")
    hf_cfg["quantization_config"] = fs.model_dump()
    return hf_cfg, out
