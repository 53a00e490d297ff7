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
  compressed-tensors scheme is refused naming the field.
* :func:`refuse_quantized_model` is what ``quantize`` and ``calibrate`` say when given a model that
  is already quantized.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from foursight import schema
from foursight.schema import CheckpointError

CT_METHOD = "compressed-tensors"
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
#: tensors of a compressed-tensors NVFP4 module (input_global_scale only with W4A4)
CT_SUFFIXES = (schema.WEIGHT_PACKED, schema.WEIGHT_SCALE, schema.WEIGHT_GLOBAL_SCALE, schema.INPUT_GLOBAL_SCALE)
#: what an imported W4A16 module gets as its (unused) activation global scale
UNUSED_INPUT_SCALE = 1.0


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of an HF folder as a dict (CheckpointError naming the file when unreadable)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir}: no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable config ({type(e).__name__}: {e})") from None


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


# ---------------------------------------------------------------------------------------------
# writing


def _linear_names(hf_cfg: dict[str, Any]) -> list[str]:
    """Names of the ``nn.Linear`` modules of the model a config describes (built on the meta device)."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {k: v for k, v in hf_cfg.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _save(out_dir: Path, src_dir: Path, hf_cfg: dict[str, Any], tensors: dict[str, torch.Tensor], force: bool) -> Path:
    """Write ``config.json``, one ``model.safetensors`` and the tokenizer/generation files of
    ``src_dir`` to ``out_dir`` atomically (a temporary folder beside it, then renamed)."""
    from safetensors.torch import save_file

    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        for f in src_dir.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template"))
                                or f.name in ("vocab.json", "merges.txt")):
                shutil.copy2(f, tmp / f.name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
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
    return _save(out_dir, ckpt_dir, hf_cfg, out, force)


def import_compressed_tensors(ct_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Convert a compressed-tensors NVFP4 checkpoint into a FourSight k = 0 checkpoint
    (:func:`read_compressed_tensors`, then written atomically)."""
    hf_cfg, tensors = read_compressed_tensors(ct_dir)
    return _save(Path(out_dir), Path(ct_dir), hf_cfg, tensors, force)


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
        if act == "bf16":
            t.setdefault(schema.INPUT_GLOBAL_SCALE, torch.tensor([UNUSED_INPUT_SCALE], dtype=torch.float32))
        for s in (schema.WEIGHT_GLOBAL_SCALE, schema.INPUT_GLOBAL_SCALE):
            if s in t:
                t[s] = t[s].float().reshape(-1)
        n_out, k_half = t[schema.WEIGHT_PACKED].shape
        t[schema.BF16_CHANNELS] = torch.zeros(0, dtype=torch.int32)
        t[schema.WEIGHT_BF16] = torch.zeros(n_out, 0, dtype=torch.bfloat16)
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
    fs = schema.FourSightConfig(activation_dtype=act, activation_scale="static", ignore=[n for n in linears if n not in channels],
                                channels=channels, channel_selection="none", channel_budget="0")
    hf_cfg["quantization_config"] = fs.model_dump()
    return hf_cfg, out

