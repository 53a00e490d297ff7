"""FourSight checkpoints in transformers: ``AutoModelForCausalLM.from_pretrained(<checkpoint>)``.

:func:`register` adds ``quant_method = "foursight"`` to transformers' quantization registries
(``transformers.quantizers.auto.register_quantization_config`` / ``register_quantizer``).
``import foursight`` arranges it (:func:`foursight._transformers_hook`): at once when transformers
is already imported, else when it imports ``transformers.quantizers.auto``; the vLLM and SGLang
plugins need nothing of it.

The quantizer builds the model of a checkpoint the way :func:`foursight.hf.load_reference_model`
does, through the same layer builder (:func:`foursight.hf.linear_from_tensors`): before the
weights load, every non-ignored ``nn.Linear`` becomes a :class:`foursight.hf.FourSightLinearSlots`
(the checkpoint's tensors, empty), and every tensor the model expects is looked up in the
checkpoint's safetensors headers, so a missing or stray tensor raises
:class:`~foursight.schema.CheckpointError` naming it before anything is initialized at random;
after loading, each slot is checked by :func:`foursight.schema.decode_module` and becomes a
:class:`foursight.hf.FourSightLinear` (``foursight.dispatch.prepare_linear``: the PyTorch
reference on CPU, the Triton kernels on CUDA). A folder a writer left incomplete
(:data:`foursight.schema.INCOMPLETE_MARKER`) is refused before anything loads, and after loading
every tensor of the model is checked finite (:func:`foursight.schema.check_finite`: a NaN norm or an
Inf embedding row raises :class:`~foursight.schema.CheckpointError` naming it instead of giving
non-finite logits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from foursight import schema
from foursight.schema import find_linears
from foursight.hf import FourSightLinearSlots
from foursight.schema import CheckpointError, FourSightConfig


class FourSightQuantizationConfig(QuantizationConfigMixin):
    """``quantization_config`` of a FourSight checkpoint as transformers holds it; the fields and
    their validation are :class:`foursight.schema.FourSightConfig`'s (a bad field raises
    :class:`CheckpointError` naming it)."""

    def __init__(self, **kwargs: Any):
        self.quant_method = schema.QUANT_METHOD
        self.foursight = FourSightConfig.parse({"quant_method": schema.QUANT_METHOD, **kwargs})

    def to_dict(self) -> dict[str, Any]:
        return self.foursight.model_dump()

    def __repr__(self) -> str:
        d = self.to_dict()
        d["channels"] = f"<{len(d['channels'])} modules>"
        return f"FourSightQuantizationConfig({d})"


def _checkpoint_keys(checkpoint_files: list[str] | None) -> set[str]:
    """Tensor names in the checkpoint's safetensors files (headers only)."""
    from foursight.tensor_io import read_headers

    if not checkpoint_files:
        raise CheckpointError("a FourSight checkpoint loads from .safetensors files; from_pretrained found none")
    keys: set[str] = set()
    for folder in {str(Path(f).parent) for f in checkpoint_files}:
        schema.check_complete(folder)
    for f in checkpoint_files:
        if not str(f).endswith(".safetensors"):
            raise CheckpointError(f"{f}: a FourSight checkpoint is read from .safetensors files only")
        keys.update(read_headers(f))  # the one reader: a truncated file is named
    return keys


class FourSightHfQuantizer(HfQuantizer):
    """Loads a FourSight checkpoint (pre-quantized only: ``foursight quantize`` makes one)."""

    requires_calibration = True
    quantization_config: FourSightQuantizationConfig

    def validate_environment(self, *args, **kwargs) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise CheckpointError("a FourSight model cannot be offloaded to disk (device_map has 'disk')")

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        return torch.bfloat16  # the checkpoint's BF16 parts and the layers' compute dtype

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs) -> None:
        cfg = self.quantization_config.foursight
        self._names = find_linears(model, cfg)
        for n in self._names:
            lin = model.get_submodule(n)
            slots = FourSightLinearSlots(n, lin.out_features, lin.in_features, lin.bias is not None, cfg)
            model.set_submodule(n, slots)
        have = _checkpoint_keys(checkpoint_files)
        want = set(model.state_dict())
        tied = {k for k in getattr(model, "all_tied_weights_keys", {}) or {}}
        missing = sorted(want - have - tied)
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]} in the FourSight checkpoint"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        unexpected = sorted(have - want)
        if unexpected:
            raise CheckpointError(f"unexpected tensor {unexpected[0]} in the FourSight checkpoint (not a tensor of this model"
                                  + (f"; and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ")"))

    def _process_model_after_weight_loading(self, model, **kwargs):
        for n in self._names:
            slots = model.get_submodule(n)
            model.set_submodule(n, slots.build())
        for name, t in model.state_dict().items():  # norms, embeddings, lm_head: what decode_module does not see
            schema.check_finite(name, t, " in the FourSight checkpoint")
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Add ``foursight`` to transformers' quantization config and quantizer registries (idempotent)."""
    AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(schema.QUANT_METHOD, FourSightQuantizationConfig)
    AUTO_QUANTIZER_MAPPING.setdefault(schema.QUANT_METHOD, FourSightHfQuantizer)
