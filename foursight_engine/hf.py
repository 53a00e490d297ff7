"""FourSight layers inside Hugging Face models: the PyTorch reference model of a checkpoint,
in-memory quantization of a BF16 model, and restoring layers to BF16.

The HF model with :class:`FourSightLinear` modules swapped in is the reference every engine
adapter is compared with (teacher-forced logprobs), and the "HF engine" of the bridge; on CUDA
its layers run the Triton SpliceGEMM kernels (:mod:`foursight.dispatch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from foursight import schema
from foursight.tensor_io import load_quantized_tensors
from foursight.dispatch import prepare_linear
from foursight.layer import QuantizedWeight, quantize_weight
from foursight.schema import CheckpointError, FourSightConfig, find_linears


class FourSightLinear(nn.Module):
    """Drop-in replacement for ``nn.Linear`` computing the compensated layer.

    Holds the :class:`QuantizedWeight` tensors as buffers and their execution form
    (:func:`foursight.dispatch.prepare_linear`: the backend is chosen here, once), rebuilt by
    :meth:`refresh` after any change.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, act_quant: bool = True,
                 input_global_scale: torch.Tensor | None = None, name: str = ""):
        super().__init__()
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.name = name
        self.act_quant = act_quant
        for key, t in zip(schema.WEIGHT_SUFFIXES, qw.tensors()):
            self.register_buffer(key, t)
        self.register_buffer(schema.BIAS, bias)
        self.register_buffer(schema.INPUT_GLOBAL_SCALE, input_global_scale)
        self.refresh()

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(*(getattr(self, key) for key in schema.WEIGHT_SUFFIXES))

    def refresh(self, channels_checked: bool = False) -> None:
        """Rebuild the execution form from the buffers (idempotent); ``channels_checked``: the buffers
        hold the layer's own, already validated channel set (no re-check, no host reads for it)."""
        self._prepared = prepare_linear(self.qweight, self.name, channels_checked=channels_checked)

    def _apply(self, fn, *args, **kwargs):  # keep the execution form on the buffers' device
        out = super()._apply(fn, *args, **kwargs)
        self.refresh()
        return out

    def set_weight(self, weight: torch.Tensor, channels: torch.Tensor | None = None) -> None:
        """Re-quantize from a new BF16 weight [N, K] in place (same channel set by default): the
        buffers keep their storage when the shapes match (a new channel count replaces them)."""
        ch = self.bf16_channels if channels is None else channels
        # the layer's own set was checked when the layer was built: no host sync for it per sync
        qw = quantize_weight(weight.to(self.weight_packed.device), ch, name=self.name, channels_checked=channels is None)
        with torch.no_grad():
            for key, t in zip(schema.WEIGHT_SUFFIXES, qw.tensors()):
                cur = getattr(self, key)
                if cur is not None and cur.shape == t.shape and cur.dtype == t.dtype:
                    cur.copy_(t)
                else:
                    setattr(self, key, t)
        self.refresh(channels_checked=channels is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._prepared(x, self.bias, self.input_global_scale, self.act_quant)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.bf16_channels.numel()}, act_quant={self.act_quant}"


def linear_from_tensors(name: str, tensors: dict[str, torch.Tensor], out_features: int, in_features: int,
                        has_bias: bool, cfg: FourSightConfig) -> FourSightLinear:
    """The :class:`FourSightLinear` of checkpoint module ``name`` (suffix -> tensor), every tensor
    checked by :func:`foursight.schema.decode_module`; the one builder of the reference model and
    of the transformers quantizer (:mod:`foursight.hf_quantizer`)."""
    qw = schema.decode_module(name, tensors, out_features, in_features, cfg.channels_for(name))
    if has_bias != (schema.BIAS in tensors):
        raise CheckpointError(f"layer {name}: bias {'missing' if has_bias else 'unexpected'} ({name}.bias)")
    igs = tensors[schema.INPUT_GLOBAL_SCALE].float() if cfg.activation_scale == "static" else None
    return FourSightLinear(qw, tensors.get(schema.BIAS), cfg.activation_dtype == "nvfp4", igs, name=name)


class FourSightLinearSlots(nn.Module):
    """The empty checkpoint tensors of one FourSight module (the shapes and dtypes of
    :func:`foursight.schema.expected_shapes`), for a loader that fills a model's state dict in place
    (transformers' ``from_pretrained``); :meth:`build` turns the filled slots into the layer."""

    def __init__(self, name: str, out_features: int, in_features: int, has_bias: bool, cfg: FourSightConfig,
                 bias_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.name, self.out_features, self.in_features, self.has_bias, self.cfg = name, out_features, in_features, has_bias, cfg
        for suffix, (shape, dtype) in schema.expected_shapes(out_features, in_features, cfg.channels_for(name), name).items():
            self.register_buffer(suffix, torch.empty(shape, dtype=dtype))
        self.register_buffer(schema.BIAS, torch.empty(out_features, dtype=bias_dtype) if has_bias else None)

    def build(self) -> FourSightLinear:
        tensors = {k: v for k, v in self._buffers.items() if v is not None}
        return linear_from_tensors(self.name, tensors, self.out_features, self.in_features, self.has_bias, self.cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"FourSight layer {self.name} was never loaded (its checkpoint tensors are still empty slots)")


def _set_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, child)
    setattr(owner, child, new)
    return old


def model_from_tensors(hf_cfg: dict[str, Any], mods: dict[str, dict[str, torch.Tensor]], rest: dict[str, torch.Tensor],
                       make_layer: Callable[[str, dict[str, torch.Tensor], nn.Linear, FourSightConfig], nn.Module] | None = None) -> nn.Module:
    """The one builder of an HF model from a FourSight checkpoint's ``config.json`` (a dict) and its tensors
    (:func:`foursight.tensor_io.split_modules`: the FourSight modules and the rest), in BF16 on the CPU.

    Every quantized linear of the model (not in the config's ``ignore``) must have its FourSight module and
    becomes ``make_layer(name, tensors, linear, config)`` (default: the :class:`FourSightLinear` of
    :func:`linear_from_tensors`; :func:`foursight.interop.dequantized_model` passes a dequantizing one);
    every other parameter is loaded as stored and tied embeddings are tied. A missing or unexpected
    tensor or module raises :class:`CheckpointError` naming it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = FourSightConfig.parse(hf_cfg["quantization_config"])
    config = AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    make_layer = make_layer or (lambda n, t, lin, c: linear_from_tensors(n, t, lin.out_features, lin.in_features, lin.bias is not None, c))
    mods = dict(mods)
    names = find_linears(model, cfg)
    for n in names:
        if n not in mods:
            raise CheckpointError(f"missing tensor {n}.{schema.WEIGHT_PACKED} (layer {n} is not in ignore)")
        _set_module(model, n, make_layer(n, mods.pop(n), model.get_submodule(n), cfg))
    if mods:
        raise CheckpointError(f"unexpected FourSight tensors for modules {sorted(mods)[:5]} (not linear layers of this model)")
    missing, unexpected = model.load_state_dict(rest, strict=False)
    quantized = set(names)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if m.rpartition(".")[0] not in quantized and not (tied and m == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in checkpoint")
    if tied:
        model.tie_weights()
    return model.eval()


def load_reference_model(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """Build the HF model of a FourSight checkpoint with :class:`FourSightLinear` layers
    (:func:`model_from_tensors`). Every FourSight tensor is checked by the shared validator (a missing
    or mis-shaped tensor raises :class:`CheckpointError` naming it); every other parameter must be present too.
    """
    ckpt_dir = Path(ckpt_dir)
    _, mods, rest = load_quantized_tensors(ckpt_dir)
    return model_from_tensors(schema.read_config(ckpt_dir), mods, rest).to(device)


def quantize_hf_model(model: nn.Module, channels: dict[str, torch.Tensor], ignore=("lm_head",), act_quant: bool = True) -> nn.Module:
    """Swap every non-ignored ``nn.Linear`` of a BF16 HF model for a :class:`FourSightLinear`, in place.

    Args:
        channels: module name → int32 channel set (missing names get k=0, plain NVFP4).
    """
    cfg = FourSightConfig(ignore=list(ignore))
    for n in find_linears(model, cfg):
        m = model.get_submodule(n)
        ch = channels.get(n, torch.zeros(0, dtype=torch.int32))
        qw = quantize_weight(m.weight.detach(), ch, name=n)
        b = None if m.bias is None else m.bias.detach().clone()
        _set_module(model, n, FourSightLinear(qw, b, act_quant, name=n))
    return model


def quantize_hf_model_fp8(model: nn.Module, ignore=("lm_head",)) -> nn.Module:
    """Swap every non-ignored ``nn.Linear`` of an HF model for an FP8 rowwise W8A8
    :class:`foursight.fp8.Fp8Linear` (the FlashRL anchor), in place; returns the model."""
    from foursight.fp8 import Fp8Linear

    cfg = FourSightConfig(ignore=list(ignore))
    for n in find_linears(model, cfg):
        m = model.get_submodule(n)
        _set_module(model, n, Fp8Linear(m.weight.detach(), m.bias, name=n))
    return model


def restore_bf16(model: nn.Module, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Put a plain BF16 ``nn.Linear`` back at ``name`` (used by per-layer attribution); returns the removed module."""
    return _set_module(model, name, bf16_linear(weight, bias))


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A plain ``nn.Linear`` holding ``weight`` [N, K] (and ``bias``), in their dtype and on their device."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin
