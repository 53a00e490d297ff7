"""The execution state of a FourSight engine layer: what :meth:`foursight.quant_methods.plan.LayerPlan.process`
builds from the loaded parameters (:class:`LayerState`), its forward (:func:`apply_linear`), and its
installation in place (:func:`install_state`).

The new state is copied into the old one's tensors when they match, so storage a captured CUDA graph
reads stays valid. :func:`state_tensors` lists every tensor a state holds; it also tells which parameter
storage an execution form shares (:func:`shares_storage`), which a release must not free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from foursight.dispatch import PreparedLinear
from foursight.layer import QuantizedWeight


@dataclass
class LayerState:
    """Execution state of one layer, rebuilt by :meth:`~foursight.quant_methods.plan.LayerPlan.process`.

    Attributes:
        qw: the local :class:`QuantizedWeight` (fused shards, local TP part).
        prepared: ``foursight.dispatch.prepare_linear(qw)`` (backend chosen once).
        input_global_scale: float32 [1] static activation scale, or None (dynamic).
        act_quant: W4A4 (True) or W4A16 (False).
        channels: the (global) channel set of the layer, int32 [k].
        generation: how many times the layer has been processed (1 after the first load).
    """

    qw: QuantizedWeight
    prepared: PreparedLinear
    input_global_scale: torch.Tensor | None
    act_quant: bool
    channels: torch.Tensor
    generation: int


def apply_linear(state: LayerState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Forward of a processed layer: x [..., K_loc] → [..., N_loc] in x's dtype.

    Raises RuntimeError if the layer was never processed (``process`` not called).
    """
    if state is None:
        raise RuntimeError("FourSight layer used before process_weights_after_loading")
    return state.prepared(x, bias, state.input_global_scale, state.act_quant)


def state_tensors(obj: Any, out: list[torch.Tensor] | None = None, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from an execution state (dataclass fields, tuples, lists, dicts), in
    a fixed order, appended to ``out`` and returned; an object met twice (the same QuantizedWeight
    held by the state and by its prepared form) is walked once."""
    out = [] if out is None else out
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return out
    if id(obj) in seen or obj is None or isinstance(obj, (bool, int, float, str)):
        return out
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            state_tensors(getattr(obj, f.name), out, seen)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            state_tensors(x, out, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            state_tensors(x, out, seen)
    return out


def shares_storage(form: Any, storages: list[torch.UntypedStorage]) -> bool:
    """Whether the execution form ``form`` reads any of ``storages`` (then they are its copy, not a second one)."""
    held = {t.untyped_storage().data_ptr() for t in state_tensors(form)}
    return any(st.data_ptr() in held for st in storages)


def install_state(layer: Any, new: LayerState) -> bool:
    """Make ``new`` the layer's execution state, in place when possible.

    When the layer already has a state whose tensors match ``new``'s one for one (shape, dtype,
    device: always so for a weight update with a fixed channel set), the new values are copied
    into the old tensors, so the storage a captured CUDA graph points at stays valid; the
    state object is kept. Otherwise (first load, or a re-selected channel set whose count
    changed) the state is replaced. Returns True when it was updated in place.
    """
    old = getattr(layer, "foursight_state", None)
    if old is not None and type(old.prepared.backend) is type(new.prepared.backend):
        a, b = state_tensors(old), state_tensors(new)
        if len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b)):
            with torch.no_grad():
                for x, y in zip(a, b):
                    if x.data_ptr() != y.data_ptr():
                        x.copy_(y)
            old.generation = new.generation
            return True
    layer.foursight_state = new
    return False
