"""The FourSight format: checkpoint tensor names, the config schema, the codec, and the names the bridge and the engines share.

This module owns every rule of the on-disk format (reading and writing the tensors themselves is
:mod:`foursight.tensor_io`'s):

* the tensor names of a quantized module and the ``quantization_config`` schema
  (:class:`FourSightConfig`);
* the ``--channels`` budget (:func:`parse_channel_budget`) and the tensors' expected shapes (:func:`expected_shapes`);
* the codec between a :class:`~foursight.layer.QuantizedWeight` and its tensors
  (:func:`encode_module` / :func:`decode_module`, which validates every tensor), the value ranges it
  checks (:func:`check_global_scale`, :func:`check_finite`);
* the incomplete-run marker every reader refuses (:func:`check_complete`) and the one reader of
  ``config.json`` (:func:`read_config`);
* the static activation scale of a layer from its calibrated amax (:func:`static_input_scale`;
  the channels file that stores the amax is :mod:`foursight.channels_file`'s);
* the names the trainer bridge and the engine adapters share: the ``FOURSIGHT_*`` environment
  variables and the prefix of a refused weight update (:data:`REFUSED_PREFIX`).

The checkpoint writer and reader, the RL weight sync, the vLLM and SGLang loaders and the HF
reference model all go through it, so a checkpoint that one of them accepts,
all of them accept, and a bad one fails with the same message everywhere.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from foursight.layer import QuantizedWeight
from foursight.nvfp4 import BLOCK_SIZE, global_scale_from_amax

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
#: The suffixes that make up a :class:`~foursight.layer.QuantizedWeight`, in its field order.
WEIGHT_SUFFIXES = (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_GLOBAL_SCALE, BF16_CHANNELS, WEIGHT_BF16)

#: Files next to a checkpoint.
LAYER_REPORT_FILE = "foursight_layers.json"
CHANNELS_FILE = "foursight_channels.json"

# ---- names the trainer bridge and the engine adapters share ----------------------------------
# The bridge sets these in an engine's environment and reads the engines' answers; the engine
# adapters (``foursight.quant_methods``) read them. They live here so that neither side reaches
# into the other for a name.

#: the token an engine serving its weight routes over HTTP requires of every weight update
ENV_WEIGHTS_TOKEN = "FOURSIGHT_WEIGHTS_TOKEN"
#: the request header that carries that token to the engine's development routes (checked by
#: :class:`foursight.quant_methods.weight_authority.DevRoutesGuard`, which ``foursight serve`` mounts)
WEIGHTS_TOKEN_HEADER = "X-FourSight-Weights-Token"
#: the folders (``os.pathsep``-separated) such an engine loads weight-update files from
ENV_WEIGHTS_DIR = "FOURSIGHT_WEIGHTS_DIR"
#: the shared-memory folder weight-update files are written to (default ``/dev/shm``)
ENV_SHM_DIR = "FOURSIGHT_SHM_DIR"
#: online (load-time) quantization of a BF16 model in vLLM and SGLang (:mod:`foursight.quant_methods.online`)
ENV_CHANNELS_FILE = "FOURSIGHT_CHANNELS_FILE"
ENV_CHANNEL_BUDGET = "FOURSIGHT_CHANNEL_BUDGET"
ENV_ACTIVATION_DTYPE = "FOURSIGHT_ACTIVATION_DTYPE"
ENV_ACTIVATION_SCALE = "FOURSIGHT_ACTIVATION_SCALE"
ENV_IGNORE = "FOURSIGHT_IGNORE"
#: "0": an online layer frees its BF16 weights once quantized (a serving engine: the memory goes to the KV cache);
#: it then refuses weight updates, which re-quantize from them. Default "1" (RL: the trainer syncs weights)
ENV_ONLINE_KEEP_BF16 = "FOURSIGHT_ONLINE_KEEP_BF16"
#: the start of every message with which an engine refuses a weight update before loading any of it
#: (vLLM's worker and native route, SGLang's plugin): the bridge answers 422, the engine stays in sync
REFUSED_PREFIX = "FourSight refused the weight update, nothing loaded: "


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


def expected_shapes(out_features: int, in_features: int, k: int, name: str,
                    local_in_features: int | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of each tensor of a FourSight module.

    ``local_in_features`` is the K of this tensor-parallel rank's packed weight and block scales
    (row-parallel layers); by default the whole ``in_features``.
    Raises :class:`CheckpointError` if ``in_features`` is not a multiple of 16 or ``k >= in_features``.
    """
    if in_features % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={in_features} is not a multiple of {BLOCK_SIZE}")
    if k >= in_features:
        raise CheckpointError(f"{name}: k={k} BF16 channels but in_features={in_features}")
    kl = in_features if local_in_features is None else local_in_features
    return {
        WEIGHT_PACKED: ((out_features, kl // 2), torch.uint8),
        WEIGHT_SCALE: ((out_features, kl // BLOCK_SIZE), torch.float8_e4m3fn),
        WEIGHT_GLOBAL_SCALE: ((1,), torch.float32),
        INPUT_GLOBAL_SCALE: ((1,), torch.float32),
        BF16_CHANNELS: ((k,), torch.int32),
        WEIGHT_BF16: ((out_features, k), torch.bfloat16),
    }


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


def check_channel_spec(spec: str | int) -> str:
    """Check the form of ``--channels`` (a count or a percentage of K) before any model is loaded
    (:class:`CheckpointError` as :func:`parse_channel_budget`); ``k < K`` needs the layer and is
    checked there."""
    parse_channel_budget(spec, 1 << 62)
    return str(spec).strip()


# ---- the codec: QuantizedWeight <-> tensors ---------------------------------------------------


def encode_module(
    name: str,
    qw: QuantizedWeight,
    input_global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of module ``name`` (full names ``<name>.<suffix>``).

    ``weight_global_scale`` is written as float32 [1] (per tensor; a per-row scale is not a
    checkpoint form). ``input_global_scale`` (float32 [1]) and ``bias`` are written when given.
    """
    gs = qw.weight_global_scale.float().reshape(-1)
    if gs.numel() != 1:
        raise CheckpointError(f"{name}: a checkpoint module has one weight_global_scale, got {gs.numel()} (fused shards are written one by one)")
    out = {
        f"{name}.{WEIGHT_PACKED}": qw.weight_packed,
        f"{name}.{WEIGHT_SCALE}": qw.weight_scale,
        f"{name}.{WEIGHT_GLOBAL_SCALE}": gs.reshape(1),
        f"{name}.{BF16_CHANNELS}": qw.bf16_channels.to(torch.int32),
        f"{name}.{WEIGHT_BF16}": qw.weight_bf16,
    }
    if input_global_scale is not None:
        out[f"{name}.{INPUT_GLOBAL_SCALE}"] = input_global_scale.float().reshape(1).clone()
    if bias is not None:
        out[f"{name}.{BIAS}"] = bias
    return out


def decode_module(
    name: str,
    tensors: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
    k: int,
    local_in_features: int | None = None,
) -> QuantizedWeight:
    """Check one module's tensors and wrap them as a :class:`~foursight.layer.QuantizedWeight`
    (``weight_global_scale`` as float32).

    Args:
        name: module prefix, e.g. ``model.layers.0.self_attn.q_proj``.
        tensors: suffix -> tensor, as read from the checkpoint.
        out_features, in_features: the dense weight's shape [N, K].
        k: expected number of BF16 channels.
        local_in_features: K of the packed weight and block scales when they are one
            tensor-parallel rank's column shard (the channel indices stay global).
    Raises:
        CheckpointError naming the tensor (``<name>.<suffix>``) that is missing, mis-shaped,
        of the wrong dtype, or holds invalid values.
    """
    for suffix, (shape, dtype) in expected_shapes(out_features, in_features, k, name, local_in_features).items():
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
        check_global_scale(f"{name}.{suffix}", tensors[suffix])
    check_finite(f"{name}.{WEIGHT_SCALE}", tensors[WEIGHT_SCALE])
    if bool((tensors[WEIGHT_SCALE].float() < 0).any()):
        raise CheckpointError(f"tensor {name}.{WEIGHT_SCALE} holds negative block scales")
    check_finite(f"{name}.{WEIGHT_BF16}", tensors[WEIGHT_BF16])
    if BIAS in tensors:
        check_finite(f"{name}.{BIAS}", tensors[BIAS])
    return QuantizedWeight(
        weight_packed=tensors[WEIGHT_PACKED],
        weight_scale=tensors[WEIGHT_SCALE],
        weight_global_scale=tensors[WEIGHT_GLOBAL_SCALE].float(),
        bf16_channels=tensors[BF16_CHANNELS],
        weight_bf16=tensors[WEIGHT_BF16],
    )


# ---- value ranges, finiteness, the incomplete-run marker and config.json ----------------------

#: The range of a global scale ``gs`` (weight or input): the largest magnitude the layer's FP4 grid
#: encodes, ``448·6 / gs``, must be a finite BF16 number (else the dequantized weight or the
#: activation overflows to Inf: 1e-38 already does), so ``gs >= 448·6 / max(bf16)``; and ``gs``
#: itself a finite, normal float32 (a subnormal one has no finite reciprocal: 1e-40 makes every
#: output NaN). Zero, negative, subnormal, NaN, Inf and overflowing scales are all refused.
GLOBAL_SCALE_MIN = float(448.0 * 6.0 / torch.finfo(torch.bfloat16).max)
GLOBAL_SCALE_MAX = float(torch.finfo(torch.float32).max)


def check_global_scale(name: str, t: torch.Tensor) -> None:
    """Raise :class:`CheckpointError` naming tensor ``name`` unless every value of the global scale
    ``t`` lies in [:data:`GLOBAL_SCALE_MIN`, :data:`GLOBAL_SCALE_MAX`] (finite, > 0, normal, and
    ``448·6/gs`` finite in BF16)."""
    v = t.float().reshape(-1)
    bad = ~(torch.isfinite(v) & (v >= GLOBAL_SCALE_MIN) & (v <= GLOBAL_SCALE_MAX))
    if bool(bad.any()):
        got = v[bad][0].item() if v.numel() else None
        raise CheckpointError(f"tensor {name} must be a global scale in [{GLOBAL_SCALE_MIN:.3g}, {GLOBAL_SCALE_MAX:.3g}] "
                              f"(finite, > 0, not subnormal; 448*6/scale finite in BF16), got {got!r}")


#: present in a checkpoint folder only while a FourSight writer (``quantize``, ``import``,
#: ``export``: :func:`foursight.folder_writer.folder_writer`) writes it; every reader refuses a
#: folder that holds it (:func:`check_complete`), and the next run to the same destination removes it
INCOMPLETE_MARKER = ".foursight-incomplete"


def check_complete(folder: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming :data:`INCOMPLETE_MARKER` when ``folder`` holds it
    (a writer was killed before it finished)."""
    p = Path(folder)
    if (p / INCOMPLETE_MARKER).exists():
        raise CheckpointError(f"{p}: incomplete checkpoint ({INCOMPLETE_MARKER} is present: a `foursight quantize`, `import` or "
                              "`export` run was interrupted while writing it; run it again, which also removes this folder)")


def check_finite(name: str, t: torch.Tensor, where: str = "") -> None:
    """Raise :class:`CheckpointError` naming tensor ``name`` (and ``where``, e.g. the file) if
    the floating-point tensor ``t`` holds a NaN or Inf (fp8 included); integer tensors pass."""
    if t.is_floating_point() and t.numel():
        bad = ~torch.isfinite(t.float())
        if bool(bad.any()):
            raise CheckpointError(f"tensor {name}{where} holds {int(bad.sum())} non-finite value(s) (NaN/Inf)")


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device, True when the floating-point tensor ``t`` holds no NaN or
    Inf; nothing is read to the host. One ``aminmax`` pass in the tensor's own dtype (NaN propagates to
    both ends, an Inf is one of them; no float32 copy, no bool per value); fp8 has no ``aminmax`` and
    goes through a float32 copy."""
    if t.element_size() == 1:
        return torch.isfinite(t.float()).all()
    lo, hi = torch.aminmax(t)
    return torch.isfinite(torch.stack((lo, hi))).all()


def check_all_finite(tensors, where: str = "") -> None:
    """:func:`check_finite` over ``(name, tensor)`` pairs with one read to the host per device, not one
    per tensor (on a GPU each read is a synchronisation: a weight sync of a few hundred tensors
    paid one each). Raises the same :class:`CheckpointError`, naming the first tensor in the given
    order that holds a NaN or Inf."""
    items = [(n, t) for n, t in tensors if t.is_floating_point() and t.numel()]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(items):
        by_device.setdefault(t.device, []).append(i)
    bad: list[int] = []
    for idx in by_device.values():
        flags = torch.stack([finite_flag(items[i][1]) for i in idx]).tolist()
        bad += [i for i, ok in zip(idx, flags) if not ok]
    if bad:
        check_finite(*items[min(bad)], where)


def checked_finite(weights, where: str = ""):
    """``(name, tensor)`` pairs of ``weights``, each checked by :func:`check_finite` as it passes:
    the engine loaders' check of the tensors they read themselves (norms, embeddings, lm_head)."""
    for name, t in weights:
        check_finite(name, t, where)
        yield name, t


def read_config(model_dir: str | Path) -> dict:
    """``config.json`` of an HF folder as a dict (CheckpointError naming the folder or the file when
    it is missing or unreadable): the one reader of ``config.json``."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        if not Path(model_dir).exists():
            raise CheckpointError(f"{model_dir} does not exist") from None
        if not Path(model_dir).is_dir():
            raise CheckpointError(f"{model_dir} is not a folder (a checkpoint is a folder with config.json)") from None
        raise CheckpointError(f"{model_dir}: no config.json") from None
    except NotADirectoryError:
        raise CheckpointError(f"{model_dir} is not a folder (a checkpoint is a folder with config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable config ({type(e).__name__}: {e})") from None
    except RecursionError:  # e.g. 100,000 nested lists: Python's JSON parser recurses once per level
        raise CheckpointError(f"{path}: unreadable config (it nests deeper than a JSON parser follows)") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: unreadable config (not a JSON object)")
    return cfg


# ---- the static activation scale ------------------------------------------------------------


def static_input_scale(amaxes: "list[float] | tuple[float, ...]") -> torch.Tensor:
    """Static activation global scale float32 [1] of a layer (or a fused group) from the
    calibrated FP4-part amax of each member: ``448*6 / max(amax)`` (no member's input clips)."""
    return global_scale_from_amax(torch.tensor(max(float(a) for a in amaxes), dtype=torch.float32)).reshape(1)


def find_linears(model: torch.nn.Module, cfg: FourSightConfig) -> list[str]:
    """Names of the ``nn.Linear`` modules to quantize (not matched by ``cfg.ignore``), in model order:
    the layers a channel set is chosen for."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not cfg.is_ignored(n)]
