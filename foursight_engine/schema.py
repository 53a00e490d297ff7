"""The one place that defines FourSight checkpoint tensor names, the config schema and validation.

Every engine adapter (vLLM, SGLang, HF) and the checkpoint writer import from here, so a
checkpoint that one of them accepts, all of them accept, and a bad one fails with the same
message everywhere.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from foursight.nvfp4 import BLOCK_SIZE

QUANT_METHOD = "foursight"
FORMAT_VERSION = 1

# ---- tensor names (suffixes after the module prefix) -----------------------------------------
WEIGHT_PACKED = "weight_packed"  # uint8 [N, K/2]
WEIGHT_SCALE = "weight_scale"  # float8_e4m3fn [N, K/16]
WEIGHT_GLOBAL_SCALE = "weight_global_scale"  # float32 [1]  (448*6/amax, compressed-tensors convention)
INPUT_GLOBAL_SCALE = "input_global_scale"  # float32 [1]  (calibrated activation global scale)
BF16_CHANNELS = "bf16_channels"  # int32 [k], sorted
WEIGHT_BF16 = "weight_bf16"  # bfloat16 [N, k]
BIAS = "bias"

TENSOR_SUFFIXES = (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE, BF16_CHANNELS, WEIGHT_BF16)

#: Files next to a checkpoint.
LAYER_REPORT_FILE = "foursight_layers.json"
CHANNELS_FILE = "foursight_channels.json"


class CheckpointError(ValueError):
    """A FourSight checkpoint or config is invalid. The message names the tensor, layer or field."""


class FourSightConfig(BaseModel):
    """``config.json["quantization_config"]`` of a FourSight checkpoint.

    Unknown keys are rejected (``extra="forbid"``) so that a typo never silently changes numerics.
    """

    model_config = ConfigDict(extra="forbid")

    quant_method: Literal["foursight"] = QUANT_METHOD
    format_version: int = FORMAT_VERSION
    group_size: Literal[16] = BLOCK_SIZE
    weight_dtype: Literal["nvfp4"] = "nvfp4"
    #: "nvfp4": W4A4 (the default); "bf16": W4A16, activations kept in BF16.
    activation_dtype: Literal["nvfp4", "bf16"] = "nvfp4"
    #: "dynamic": per-row global scale 448*6/rowamax at run time (batch-invariant);
    #: "static": the calibrated ``input_global_scale`` tensor of each layer.
    activation_scale: Literal["dynamic", "static"] = "dynamic"
    #: module names (or name suffixes, or "re:<regex>") kept unquantized
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    #: number of BF16 channels per quantized module (full module name -> k)
    channels: dict[str, int] = Field(default_factory=dict)
    #: how channels were chosen: "calibration", "weight" (online fallback), "none"
    channel_selection: str = "calibration"
    #: the ``--channels`` request (e.g. "32" or "2%") or "error-target:<x>"
    channel_budget: str = "0"

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v != FORMAT_VERSION:
            raise ValueError(f"unsupported FourSight format_version {v}; this build reads version {FORMAT_VERSION}")
        return v

    @field_validator("channels")
    @classmethod
    def _nonneg(cls, v: dict[str, int]) -> dict[str, int]:
        for name, k in v.items():
            if k < 0 or (k and k % 1):
                raise ValueError(f"channels[{name!r}] = {k} must be a non-negative integer")
        return v

    @classmethod
    def parse(cls, data: dict) -> "FourSightConfig":
        """Validate a raw dict; raise :class:`CheckpointError` naming the offending field."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            parts = []
            for err in e.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "<root>"
                parts.append(f"quantization_config.{loc}: {err['msg']}")
            raise CheckpointError("invalid FourSight quantization_config: " + "; ".join(parts)) from None

    def is_ignored(self, name: str) -> bool:
        """True if module ``name`` matches an entry of ``ignore`` (exact, dotted suffix, or ``re:`` regex)."""
        import re

        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], name):
                    return True
            elif name == pat or name.endswith("." + pat):
                return True
        return False

    def channels_for(self, name: str) -> int:
        """k of module ``name`` (0 when the module is not listed)."""
        return int(self.channels.get(name, 0))


def expected_shapes(out_features: int, in_features: int, k: int, name: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of each tensor of a FourSight module.

    Raises :class:`CheckpointError` if ``in_features`` is not a multiple of 16 or ``k >= in_features``.
    """
    if in_features % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={in_features} is not a multiple of {BLOCK_SIZE}")
    if k >= in_features:
        raise CheckpointError(f"{name}: k={k} BF16 channels but in_features={in_features}")
    return {
        WEIGHT_PACKED: ((out_features, in_features // 2), torch.uint8),
        WEIGHT_SCALE: ((out_features, in_features // BLOCK_SIZE), torch.float8_e4m3fn),
        WEIGHT_GLOBAL_SCALE: ((1,), torch.float32),
        INPUT_GLOBAL_SCALE: ((1,), torch.float32),
        BF16_CHANNELS: ((k,), torch.int32),
        WEIGHT_BF16: ((out_features, k), torch.bfloat16),
    }


def validate_module_tensors(
    name: str,
    tensors: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
    k: int,
) -> None:
    """Check that module ``name`` has every FourSight tensor with the right shape, dtype and values.

    Args:
        name: module prefix, e.g. ``model.layers.0.self_attn.q_proj``.
        tensors: suffix -> tensor, as read from the checkpoint.
        out_features, in_features: the dense weight's shape [N, K].
        k: expected number of BF16 channels.
    Raises:
        CheckpointError naming the tensor (``<name>.<suffix>``) that is missing, mis-shaped,
        of the wrong dtype, or holds invalid values.
    """
    for suffix, (shape, dtype) in expected_shapes(out_features, in_features, k, name).items():
        full = f"{name}.{suffix}"
        if suffix not in tensors:
            raise CheckpointError(f"missing tensor {full} (expected shape {list(shape)} {dtype})")
        t = tensors[suffix]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {full} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            raise CheckpointError(f"tensor {full} has dtype {t.dtype}, expected {dtype}")
    ch = tensors[BF16_CHANNELS].long()
    if ch.numel():
        if int(ch.min()) < 0 or int(ch.max()) >= in_features:
            raise CheckpointError(f"tensor {name}.{BF16_CHANNELS} has indices outside [0, {in_features})")
        if ch.numel() > 1 and not bool((ch[1:] > ch[:-1]).all()):
            raise CheckpointError(f"tensor {name}.{BF16_CHANNELS} must be strictly increasing")
    for suffix in (WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE):
        v = tensors[suffix].float()
        if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise CheckpointError(f"tensor {name}.{suffix} must be finite and > 0, got {v.tolist()}")
    if not bool(torch.isfinite(tensors[WEIGHT_BF16].float()).all()):
        raise CheckpointError(f"tensor {name}.{WEIGHT_BF16} holds NaN/Inf")


def parse_channel_budget(spec: str | int, in_features: int, layer: str = "layer") -> int:
    """Turn ``--channels`` (``"128"``, ``128`` or ``"2%"``) into k for a layer with K=in_features.

    A percentage is rounded up to a multiple of 16 (whole NVFP4 blocks) and capped below K;
    an explicit count must be < K (else :class:`CheckpointError` naming ``layer``).
    """
    s = str(spec).strip()
    try:
        if s.endswith("%"):
            frac = float(s[:-1]) / 100.0
            if not 0 <= frac < 1:
                raise ValueError
            k = int(math.ceil(frac * in_features / BLOCK_SIZE) * BLOCK_SIZE) if frac > 0 else 0
            k = min(k, in_features - BLOCK_SIZE)
        else:
            k = int(s)
            if k < 0:
                raise ValueError
    except ValueError:
        raise CheckpointError(f"--channels {spec!r}: expected a non-negative integer or a percentage like '2%'") from None
    if k >= in_features:
        raise CheckpointError(f"{layer}: --channels {spec} gives k={k} but the layer has K={in_features}; k must be < K")
    return k
