"""The whole-update check every engine's weight-update route runs before it applies anything (issue 28).

A weight update is atomic only if it is refused *before* its first tensor is written: an engine's
``load_weights`` writes tensor by tensor, so a bad tensor found on the way leaves the ones before
it applied (and, later, served under the next version tag). :func:`check_update` therefore reads
the names, dtypes, shapes and values of the WHOLE update against the served model and raises
:class:`~foursight.schema.CheckpointError` naming the first bad tensor; the route loads nothing
unless it passes. Used by vLLM's routes (:mod:`foursight.quant_methods.vllm_weight_update`,
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

from foursight.quant_methods.layer_layout import WEIGHT, LayerLayout
from foursight.quant_methods.param_names import ENGINE_SKIPPED, packed_name_map
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
    finite_flag,
)

def _shards(model: torch.nn.Module) -> tuple[dict[str, tuple[LayerLayout, int, bool]], int]:
    """Checkpoint module name of every FourSight shard -> (its layer's layout, shard index, whether the layer
    quantizes its BF16 weight at load); the TP size."""
    shards: dict[str, tuple[LayerLayout, int, bool]] = {}
    tp = 1
    for m in model.modules():
        plan = getattr(m, "foursight_plan", None)
        if plan is None:
            continue
        lay = plan.layout
        tp = max(tp, lay.tp_size)
        for i, n in enumerate(lay.shard_names):
            shards[n] = (lay, i, plan.quantizes_at_load)
    return shards, tp


def _shard_rows(plan: LayerLayout, i: int) -> int:
    """Rows of shard ``i`` in the full (unsharded) tensor a trainer or a checkpoint gives."""
    return plan.shard_sizes[i] * (1 if plan.k_split else plan.tp_size)


def _check_shard_tensor(name: str, t: torch.Tensor, plan: LayerLayout, i: int, leaf: str) -> None:
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


class UpdateChecker:
    """:func:`check_update` bound to one model: the model's parameters, FourSight shards and name
    mapping are read once, so that a trainer's per-tensor loop (TRL colocate: one ``load_weights``
    call per tensor) pays only the per-tensor checks. Built by :func:`guard_load_weights`."""

    def __init__(self, model: torch.nn.Module, map_name: Callable[[str], str | None] | None = None,
                 checkpoint_tensors: bool = False) -> None:
        self.model = model
        self.map_name = map_name or packed_name_map(model)
        self.params = dict(model.named_parameters())
        self.shards, self.tp = _shards(model)
        self.tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self.checkpoint_tensors = checkpoint_tensors

    def check(self, weights: Iterable[tuple[str, torch.Tensor]], where: str = "") -> int:
        """Check every ``(name, tensor)`` (module docstring's rules); raises CheckpointError naming
        the first bad one (and ``where``); returns the number of tensors."""
        n = 0
        for name, t in weights:
            n += 1
            self.check_one(name, t, where)
        return n

    def check_one(self, name: str, t: torch.Tensor, where: str = "") -> None:
        checkpoint_tensors, shards = self.checkpoint_tensors, self.shards
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor {name}{where} is a {type(t).__name__}, not a tensor")
        mod, _, leaf = name.rpartition(".")
        if mod in shards and checkpoint_tensors and leaf in (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_BF16, WEIGHT_GLOBAL_SCALE,
                                                             INPUT_GLOBAL_SCALE, BF16_CHANNELS):
            plan, i, at_load = shards[mod]
            if at_load:
                raise CheckpointError(f"unexpected tensor {name}{where}: layer {plan.prefix} quantizes its BF16 weight "
                                      f"at load (online mode) and takes only {mod}.weight")
            _check_shard_tensor(name + where, t, plan, i, leaf)
            check_finite(name, t, where)
            return
        if not t.is_floating_point() and not checkpoint_tensors:
            raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected a floating-point weight")
        if mod in shards and leaf == WEIGHT:
            plan, i, _ = shards[mod]
            if not t.is_floating_point():
                raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected a floating-point weight")
            rows = _shard_rows(plan, i)
            if t.dim() != 2 or t.shape[1] != plan.input_size or (plan.tp_size == 1 and t.shape[0] != rows):
                raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {[rows, plan.input_size]}")
        else:
            mapped = self.map_name(name)
            p = self.params.get(mapped) if mapped is not None else None
            if p is None:
                if mapped is None or name.endswith(ENGINE_SKIPPED) or (self.tied and name == "lm_head.weight"):
                    return
                raise CheckpointError(f"unexpected tensor {name}{where}: the model has no parameter for it")
            if p.is_floating_point() != t.is_floating_point() or (not p.is_floating_point() and p.dtype != t.dtype):
                raise CheckpointError(f"tensor {name}{where} has dtype {t.dtype}, expected "
                                      + ("a floating-point weight" if p.is_floating_point() else str(p.dtype)))
            fused = mapped != name
            if p.numel() and not fused and t.dim() == p.dim():
                padded = hasattr(p, "output_dim") and p.dim() == 2 and getattr(_owner(self.model, mapped), "org_vocab_size", None) is not None
                for d, (a, b) in enumerate(zip(t.shape, p.shape)):
                    split = self.tp > 1 and d in (getattr(p, "output_dim", None), getattr(p, "input_dim", None))
                    if (padded and d == 0 and a <= b) or split:
                        continue
                    if a != b:
                        raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {list(p.shape)}")
            elif p.numel() and not fused and t.dim() != p.dim():
                raise CheckpointError(f"tensor {name}{where} has shape {list(t.shape)}, expected {list(p.shape)}")
        _check_finite_fast(name, t, where)


def _check_finite_fast(name: str, t: torch.Tensor, where: str = "") -> None:
    """:func:`foursight.schema.check_finite` without its float32 copy of the tensor
    (:func:`foursight.schema.finite_flag`: one ``aminmax`` pass in the tensor's own dtype)."""
    if t.is_floating_point() and t.numel() and not bool(finite_flag(t)):
        check_finite(name, t, where)  # counts and names the bad values


def check_update(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 map_name: Callable[[str], str | None] | None = None, checkpoint_tensors: bool = False,
                 where: str = "") -> int:
    """Validate a WHOLE update against ``model`` before anything of it is loaded (rules: module
    docstring). ``map_name`` maps a checkpoint name to the engine's parameter name (None: skip the
    tensor, as vLLM's ``hf_to_vllm_mapper`` does); default :func:`packed_name_map`. Raises
    :class:`CheckpointError` naming the first bad tensor (and ``where``); returns the number of tensors."""
    return UpdateChecker(model, map_name, checkpoint_tensors).check(weights, where)


def guard_load_weights(model: torch.nn.Module, map_name: Callable[[str], str | None] | None = None) -> None:
    """Make the engine's own ``model.load_weights`` check each call WHOLE before it writes anything.

    A trainer that syncs through the engine's model directly (TRL colocate: one tensor per call;
    verl: one bucket per call, then the post-load step) bypasses every FourSight update route, and
    vLLM's loaders for norms, embeddings and lm_head check nothing: a NaN norm was served, an Inf
    embedding row wedged the engine at its next request, an int32 norm was cast and served, and an
    online layer's NaN was written before its quantizer refused it (a layer that re-raised at every
    forward). With the guard, a call's tensors are read into a list (a bucket is bounded by the
    trainer), checked by an :class:`UpdateChecker` built once for the model, and handed to the
    original ``load_weights`` only if all pass: a refused call raises :class:`CheckpointError`
    naming the tensor and writes nothing. Installed on the instance (other models of the same class
    are untouched), idempotent; ``model.load_weights.foursight_unchecked`` is the original, for a
    route that checked the whole update itself (:func:`unchecked_load_weights`)."""
    current = model.load_weights
    if getattr(current, "foursight_unchecked", None) is not None:
        return
    checker: list[UpdateChecker] = []  # built at the first call: the model's parameters are final by then

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args, **kwargs):
        items = weights if isinstance(weights, (list, tuple)) else list(weights)
        if not checker:
            checker.append(UpdateChecker(model, map_name))
        checker[0].check(items)
        return current(items, *args, **kwargs)

    load_weights.foursight_unchecked = current  # type: ignore[attr-defined]
    model.load_weights = load_weights


def unchecked_load_weights(model: torch.nn.Module) -> Callable:
    """The model's ``load_weights`` without the :func:`guard_load_weights` check (for a route that
    already checked the whole update)."""
    lw = model.load_weights
    return getattr(lw, "foursight_unchecked", lw)


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(param_name.rpartition(".")[0])
    except AttributeError:
        return None
