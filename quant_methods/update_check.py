"""The whole-update check every engine's weight-update route runs before it applies anything (issue 28).

A weight update is atomic only if it is refused *before* its first tensor is written: an engine's
``load_weights`` writes tensor by tensor, so a bad tensor found on the way leaves the ones before
it applied (and, later, served under the next version tag). :func:`check_update` therefore reads
the names, dtypes, shapes and values of the WHOLE update against the served model and raises
:class:`~foursight.schema.CheckpointError` naming the first bad tensor; the route loads nothing
unless it passes. Used by vLLM's routes (:mod:`foursight.quant_methods.vllm_weight_sync`,
:mod:`foursight.quant_methods.vllm_weight_transfer`) and SGLang's
(:mod:`foursight.quant_methods.sglang_plugin`).

Rules, per tensor (HF names, as a trainer or a checkpoint gives them):

* a FourSight layer's shard ``<shard>.weight`` (a BF16 sync): a finite float tensor ``[rows, K]``;
* with ``checkpoint_tensors`` (SGLang's ``update_weights_from_disk`` takes a FourSight checkpoint
  folder), a FourSight layer's checkpoint tensors ``<shard>.weight_packed`` etc.: the dtype the
  checkpoint format fixes, the shard's shape, and global scales in their working range
  (:func:`foursight.schema.check_global_scale`);
* any other tensor must map (``map_name``: the engine's fused-layer mapping, ``q_proj`` ->
  ``qkv_proj``) to a parameter of the model; a float parameter takes a finite float tensor, an
  integer one the same dtype; the shape is the parameter's (a vocab-padded embedding takes up to
  its padded rows; with TP > 1 only dimensions that are not split are compared; a fused
  parameter's shard is not compared here but by its loader's own check, which runs per shard).

Names an engine skips (rotary tables) and a tied ``lm_head.weight`` pass.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from foursight.quant_methods.config import ENGINE_SKIPPED, packed_name_map
from foursight.quant_methods.plan import WEIGHT, LayerPlan
from foursight.schema import (
    BF16_CHANNELS,
    INPUT_GLOBAL_SCALE,
    WEIGHT_BF16,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    CheckpointError,
    check_finite,
    check_global_scale,
)

#: how an engine's answer to a refused update starts (SGLang's ``message``): the bridge reads it as
#: "refused before anything was applied" and answers 422 instead of 502
REFUSED_PREFIX = "FourSight refused the update, nothing applied: "


def _shards(model: torch.nn.Module) -> tuple[dict[str, tuple[LayerPlan, int]], int]:
    """Checkpoint module name of every FourSight shard -> (its layer's plan, shard index); the TP size."""
    shards: dict[str, tuple[LayerPlan, int]] = {}
    tp = 1
    for m in model.modules():
        plan = getattr(m, "foursight_plan", None)
        if plan is None:
            continue
        tp = max(tp, plan.tp_size)
        for i, n in enumerate(plan.shard_names):
            shards[n] = (plan, i)
    return shards, tp


def _shard_rows(plan: LayerPlan, i: int) -> int:
    """Rows of shard ``i`` in the full (unsharded) tensor a trainer or a checkpoint gives."""
    return plan.shard_sizes[i] * (1 if plan.k_split else plan.tp_size)


def _check_shard_tensor(name: str, t: torch.Tensor, plan: LayerPlan, i: int, leaf: str) -> None:
    """A FourSight checkpoint tensor of shard ``i``: its format's dtype and shape."""
    rows, K = _shard_rows(plan, i), plan.input_size
    spec: dict[str, tuple[torch.dtype, list[int] | None]] = {
        WEIGHT_PACKED: (torch.uint8, [rows, K // 2]),
        WEIGHT_SCALE: (torch.float8_e4m3fn, [rows, K // 16]),
        WEIGHT_BF16: (torch.bfloat16, [rows, plan.k]),
        WEIGHT_GLOBAL_SCALE: (torch.float32, None),
        INPUT_GLOBAL_SCALE: (torch.float32, None),
        BF16_CHANNELS: (torch.int32, [plan.k]),
    }
    dtype, shape = spec[leaf]
    if t.dtype != dtype:
        raise CheckpointError(f"tensor {name} has dtype {t.dtype}, expected {dtype}")
    if shape is None:  # a per-shard global scale: [1] or a scalar
        if tuple(t.shape) not in ((), (1,)):
            raise CheckpointError(f"tensor {name} has shape {list(t.shape)}, expected [1]")
        check_global_scale(name, t)
    elif list(t.shape) != shape and not (plan.k_split and leaf in (WEIGHT_PACKED, WEIGHT_SCALE) and t.shape[:1] == (rows,)):
        raise CheckpointError(f"tensor {name} has shape {list(t.shape)}, expected {shape}")


def check_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 map_name: Callable[[str], str | None] | None = None, checkpoint_tensors: bool = False,
                 where: str = "") -> int:
    """Validate a WHOLE update against ``model`` before anything of it is loaded (rules: module
    docstring). ``map_name`` maps a checkpoint name to the engine's parameter name (None: skip the
    tensor, as vLLM's ``hf_to_vllm_mapper`` does); default :func:`packed_name_map`. Raises
    :class:`CheckpointError` naming the first bad tensor (and ``where``); returns the number of tensors."""
    map_name = map_name or packed_name_map(model)
    params = dict(model.named_parameters())
    shards, tp = _shards(model)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    n = 0
    for name, t in weights:
        n += 1
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor {name}{where} is a {type(t).__name__}, not a tensor")
        mod, _, leaf = name.rpartition(".")
        if mod in shards and checkpoint_tensors and leaf in (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_BF16, WEIGHT_GLOBAL_SCALE,
                                                             INPUT_GLOBAL_SCALE, BF16_CHANNELS):
            plan, i = shards[mod]
            if plan.mode != "checkpoint":
                raise CheckpointError(f"unexpected tensor {name}{where}: layer {plan.prefix} quantizes its BF16 weight "
                                      f"at load (online mode) and takes only {mod}.weight")
            _check_shard_tensor(name + where, t, plan, i, leaf)
            check_finite(name, t, where)
            continue
        if not t.is_floating_point() and not checkpoint_tensors:
            raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected a floating-point weight")
        if mod in shards and leaf == WEIGHT:
            plan, i = shards[mod]
            if not t.is_floating_point():
                raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected a floating-point weight")
            rows = _shard_rows(plan, i)
            if t.dim() != 2 or t.shape[1] != plan.input_size or (plan.tp_size == 1 and t.shape[0] != rows):
                raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {[rows, plan.input_size]}")
        else:
            mapped = map_name(name)
            p = params.get(mapped) if mapped is not None else None
            if p is None:
                if mapped is None or name.endswith(ENGINE_SKIPPED) or (tied and name == "lm_head.weight"):
                    continue
                raise CheckpointError(f"unexpected tensor {name}{where}: the model has no parameter for it")
            if p.is_floating_point() != t.is_floating_point() or (not p.is_floating_point() and p.dtype != t.dtype):
                raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected "
                                      + ("a floating-point weight" if p.is_floating_point() else str(p.dtype)))
            fused = mapped != name
            if p.numel() and not fused and t.dim() == p.dim():
                padded = hasattr(p, "output_dim") and p.dim() == 2 and getattr(_owner(model, mapped), "org_vocab_size", None) is not None
                for d, (a, b) in enumerate(zip(t.shape, p.shape)):
                    split = tp > 1 and d in (getattr(p, "output_dim", None), getattr(p, "input_dim", None))
                    if (padded and d == 0 and a <= b) or split:
                        continue
                    if a != b:
                        raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {list(p.shape)}")
            elif p.numel() and not fused and t.dim() != p.dim():
                raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {list(p.shape)}")
        check_finite(name, t, where)
    return n


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(param_name.rpartition(".")[0])
    except AttributeError:
        return None
