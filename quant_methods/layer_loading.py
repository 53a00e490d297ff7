"""Loading a FourSight engine layer: :class:`LayerLoader` makes the weight loaders the engine calls and
keeps the books of what they loaded. Part of the per-layer plan (:mod:`foursight.quant_methods.plan`,
whose :class:`~foursight.quant_methods.plan.LayerPlan` holds one).

Every loader checks the tensor's dtype, names the checkpoint tensor in every error, lets the
parameter's kind write it (:mod:`foursight.quant_methods.param_kinds`: the engine's loader, the shard's
own row, or the BF16 update quantizing into the checkpoint tensors), records the load and marks the
layer stale; the post-load processing (:meth:`~foursight.quant_methods.plan.LayerPlan.process`) rebuilds
the execution state from what was loaded.

The loader also guards the parameters a processed layer released (``LayerPlan.release``): the first
write after a release gives the whole layer its checkpoint tensors back (:meth:`LayerLoader.restore_released`),
and a layer whose BF16 weights were freed refuses every write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from foursight.quant_methods.layer_layout import LayerLayout
from foursight.quant_methods.param_kinds import LoadCall, ParamSpec
from foursight.quant_methods.sharding import shard_index
from foursight.schema import ENV_ONLINE_KEEP_BF16, WEIGHT_PACKED, WEIGHT_SCALE, CheckpointError


@dataclass
class LayerLoader:
    """The loaders of one layer and their bookkeeping.

    Attributes:
        layout: the layer's :class:`~foursight.quant_methods.layer_layout.LayerLayout` (names, shards).
        loaded: ``(tensor suffix, shard index)`` pairs seen by the loaders (for missing-tensor checks).
        load_events: number of tensors loaded so far (a weight update compares it before/after
            to find the layers it touched).
        stale: True when a tensor was loaded after the last processing: the execution state no longer
            matches the parameters (the adapter re-processes before the next forward).
        pending_weight: shard indices that received a BF16 ``weight`` since the last processing; when
            it covers every shard the adapter re-processes at once, inside the loader.
        requantized: checkpoint mode: shard indices whose checkpoint tensors were last written by the
            BF16 update (:class:`~foursight.quant_methods.param_kinds.BF16UpdateParam`: our own quantizer,
            from a finite weight, with the layer's validated channels), so processing does not check them
            again as it checks a checkpoint's; loading any checkpoint tensor of the shard directly removes it.
        released: the execution form the layer's ``weight_packed`` / ``weight_scale`` parameters were
            freed against (their storage resized to 0 bytes, shapes kept; ``LayerPlan.release``), or
            None while they hold their values. :meth:`restore_released` rebuilds them from it before
            anything writes into them or reads them.
        released_bytes: the storage size of each freed parameter (what :meth:`restore_released` gives back).
        bf16_released: online mode with ``FOURSIGHT_ONLINE_KEEP_BF16=0``: the BF16 ``weight`` was freed after
            quantization (``LayerPlan.release``); its loader then refuses every write, naming the setting.
    """

    layout: LayerLayout
    loaded: set[tuple[str, int]] = field(default_factory=set)
    load_events: int = 0
    stale: bool = False
    pending_weight: set[int] = field(default_factory=set)
    requantized: set[int] = field(default_factory=set)
    released: Any = None
    released_bytes: dict[str, int] = field(default_factory=dict)
    bf16_released: bool = False

    def make_loader(self, spec: ParamSpec, engine_loader: Callable | None,
                    layer_params: Callable[[], dict[str, torch.Tensor]] | None = None) -> Callable:
        """Weight loader for ``spec``: ``loader(param, loaded_weight, shard_id=None)``.

        Checks the checkpoint dtype (``spec.check_dtype``), lets the parameter's kind write the tensor
        (``spec.load``: ``engine_loader`` is the engine's column/row/fused loader, ``layer_params`` the
        layer's parameters by name, which the BF16 update and a released layer need), then records the
        load of the shards the kind says it covers and marks the layer stale. Shape errors become
        :class:`CheckpointError` naming the checkpoint tensor.
        """
        lay = self.layout

        def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None, *args: Any, **kw: Any) -> None:
            if self.bf16_released:
                raise CheckpointError(f"{lay.prefix}: this engine freed its BF16 weights after quantizing them "
                                      f"({ENV_ONLINE_KEEP_BF16}=0, a serving engine), so it takes no weight update; start it "
                                      f"without that setting (the default keeps them) to sync weights")
            if self.released is not None:
                # the first write after a release: the whole layer gets its checkpoint tensors back first, so
                # the shards this update does not (or not yet) write keep their values, not zeros
                if layer_params is None:
                    raise RuntimeError(f"{lay.prefix}: checkpoint tensors released and no parameters to rebuild them into")
                self.restore_released(layer_params())
            idx = shard_index(shard_id, lay.num_shards, lay.prefix)
            name = lay.tensor_name(spec.name, idx if (shard_id is not None or lay.num_shards == 1) else None)
            spec.check_dtype(loaded_weight, name)
            spec.load(LoadCall(self, param, loaded_weight, shard_id, idx, name, engine_loader, layer_params, args, kw))
            covered = spec.covers(shard_id, idx, lay.num_shards)
            self.requantized.difference_update(covered)  # a checkpoint tensor written directly is checked again
            self.stale = True
            if spec.bf16_weight:
                self.pending_weight.update(range(lay.num_shards) if shard_id is None else (idx,))
            if covered:
                self.load_events += 1
                self.loaded.update((spec.name, i) for i in covered)

        return loader

    def restore_released(self, params: dict[str, torch.Tensor]) -> None:
        """Give the freed checkpoint parameters (:attr:`released`) their storage and values back, rebuilt
        from the execution form (``checkpoint_codes()``: byte for byte the values every execution form
        reads); a no-op when nothing is released. The parameter objects, and every view of them the
        layer's state holds, stay the same."""
        form = self.released
        if form is None:
            return
        packed, scale = form.checkpoint_codes()
        with torch.no_grad():
            for name, t in ((WEIGHT_PACKED, packed), (WEIGHT_SCALE, scale)):
                p = params[name].data
                p.untyped_storage().resize_(self.released_bytes[name])
                p.copy_(t.view(p.dtype).reshape(p.shape))
        self.released = None
        self.released_bytes = {}

    def weight_complete(self) -> bool:
        """True when every shard received a BF16 ``weight`` since the last processing."""
        return len(self.pending_weight) == self.layout.num_shards

    def mark_processed(self) -> None:
        """The execution state was rebuilt from the parameters: nothing is stale or pending."""
        self.stale = False
        self.pending_weight.clear()

    def missing(self, specs: Sequence[ParamSpec]) -> list[str]:
        """Checkpoint names of required tensors no loader has seen (empty when complete)."""
        lay = self.layout
        return [lay.tensor_name(spec.name, i) for spec in specs if spec.required(lay.static_act_scale)
                for i in range(lay.num_shards) if (spec.name, i) not in self.loaded]
