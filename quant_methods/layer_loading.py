"""Loading a FourSight engine layer: the weight loaders the engine calls, the bookkeeping of what
they loaded, and the RL weight update of a checkpoint-mode layer (a BF16 shard quantized into its
checkpoint tensors). Part of the per-layer plan (:mod:`foursight.quant_methods.plan`).

Every loader checks the tensor's dtype, names the checkpoint tensor in every error, records the
load and marks the layer stale; the post-load processing (:mod:`foursight.quant_methods.plan`)
rebuilds the execution state from what was loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from foursight.quant_methods.layer_layout import WEIGHT, ParamSpec
from foursight.quant_methods.sharding import shard_index
from foursight.schema import BF16_CHANNELS, ENV_ONLINE_KEEP_BF16, INPUT_GLOBAL_SCALE, WEIGHT_BF16, WEIGHT_PACKED, WEIGHT_SCALE, CheckpointError


@dataclass
class LayerLoading:
    """The loaders of a layer and their bookkeeping (a base of :class:`~foursight.quant_methods.plan.LayerPlan`,
    whose layout attributes it reads, and whose ``quantize_shard`` quantizes a BF16 shard:
    :func:`foursight.quant_methods.requantize.quantize_shard`, bound there so that this module stays
    below the kernels in the import graph).

    Attributes:
        loaded: ``(tensor suffix, shard index)`` pairs seen by the loaders (for missing-tensor checks).
        generation: number of :meth:`process` calls so far.
        load_events: number of tensors loaded so far (a weight update compares it before/after
            to find the layers it touched).
        stale: True when a tensor was loaded after the last :meth:`process`: the execution state
            no longer matches the parameters (the adapter re-processes before the next forward).
        pending_weight: shard indices that received a BF16 ``weight`` since the last process; when
            it covers every shard the adapter re-processes at once, inside the loader.
        requantized: checkpoint mode: shard indices whose checkpoint tensors were last written by
            :meth:`load_bf16_shard` (our own quantizer, from a finite weight, with the layer's
            validated channels), so :meth:`process` does not check them again as it checks a
            checkpoint's; loading any checkpoint tensor of the shard directly removes it.
        released: the execution form the layer's ``weight_packed`` / ``weight_scale`` parameters were
            freed against (their storage resized to 0 bytes, shapes kept; ``LayerPlan.release``), or
            None while they hold their values. :meth:`restore_released` rebuilds them from it before
            anything writes into them or reads them.
        released_bytes: the storage size of each freed parameter (what :meth:`restore_released` gives back).
        bf16_released: online mode with ``FOURSIGHT_ONLINE_KEEP_BF16=0``: the BF16 ``weight`` was freed after
            quantization (``LayerPlan.release``); its loader then refuses every write, naming the setting.
    """

    loaded: set[tuple[str, int]] = field(default_factory=set)
    generation: int = 0
    load_events: int = 0
    stale: bool = False
    pending_weight: set[int] = field(default_factory=set)
    requantized: set[int] = field(default_factory=set)
    released: Any = None
    released_bytes: dict[str, int] = field(default_factory=dict)
    bf16_released: bool = False

    # ---- loading --------------------------------------------------------------------------

    def make_loader(self, spec: ParamSpec, engine_loader: Callable | None,
                    layer_params: Callable[[], dict[str, torch.Tensor]] | None = None) -> Callable:
        """Weight loader for ``spec``: ``loader(param, loaded_weight, shard_id=None)``.

        Checks the checkpoint dtype (``weight`` accepts any float dtype), records the load, marks
        the layer stale, and delegates: per-shard parameters are copied into their shard row here;
        the checkpoint-mode ``weight`` (``spec.update_only``) quantizes a BF16 shard into the
        layer's checkpoint tensors (:meth:`load_bf16_shard`, which needs ``layer_params``); others
        go to ``engine_loader`` (the engine's column/row/fused loader). Shape errors become
        :class:`CheckpointError` naming the checkpoint tensor.
        """
        plan = self

        def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None, *args: Any, **kw: Any) -> None:
            if plan.bf16_released:
                raise CheckpointError(f"{plan.prefix}: this engine freed its BF16 weights after quantizing them "
                                      f"({ENV_ONLINE_KEEP_BF16}=0, a serving engine), so it takes no weight update; start it "
                                      f"without that setting (the default keeps them) to sync weights")
            if plan.released is not None:
                # the first write after a release: the whole layer gets its checkpoint tensors back first, so
                # the shards this update does not (or not yet) write keep their values, not zeros
                if layer_params is None:
                    raise RuntimeError(f"{plan.prefix}: checkpoint tensors released and no parameters to rebuild them into")
                plan.restore_released(layer_params())
            idx = shard_index(shard_id, plan.num_shards, plan.prefix)
            name = plan.tensor_name(spec.name, idx if (shard_id is not None or plan.num_shards == 1) else None)
            if spec.name == WEIGHT:
                if not loaded_weight.is_floating_point():
                    raise CheckpointError(f"tensor {name} has dtype {loaded_weight.dtype}, expected a float dtype")
            elif loaded_weight.dtype != spec.dtype:
                raise CheckpointError(f"tensor {name} has dtype {loaded_weight.dtype}, expected {spec.dtype}")
            if spec.update_only:
                if layer_params is None:
                    raise RuntimeError(f"{plan.prefix}: no parameters to quantize {name} into")
                plan.load_bf16_shard(layer_params(), loaded_weight, shard_id)
            elif spec.per_shard:
                plan._load_per_shard(param, loaded_weight, idx, name)
                plan.requantized.discard(idx)
            else:
                if engine_loader is None:
                    raise RuntimeError(f"{plan.prefix}: no engine loader for {spec.name}")
                try:
                    if shard_id is None:
                        engine_loader(param, loaded_weight, *args, **kw)
                    else:
                        engine_loader(param, loaded_weight, shard_id, *args, **kw)
                except (AssertionError, RuntimeError, IndexError) as e:
                    raise CheckpointError(
                        f"tensor {name} has shape {list(loaded_weight.shape)}, which does not fit parameter "
                        f"{plan.prefix}.{spec.name} of local shape {list(param.shape)} (shard {shard_id!r}): {e}"
                    ) from None
                if shard_id is None:
                    plan.requantized.clear()
                else:
                    plan.requantized.discard(idx)
            plan.stale = True
            if spec.name == WEIGHT:
                plan.pending_weight.update(range(plan.num_shards) if shard_id is None else (idx,))
            if spec.update_only:
                return  # the checkpoint tensors' own loaders recorded the load
            plan.load_events += 1
            if shard_id is None and plan.num_shards > 1 and not spec.per_shard:
                plan.loaded.update((spec.name, i) for i in range(plan.num_shards))
            else:
                plan.loaded.add((spec.name, idx))

        return loader

    def load_bf16_shard(self, params: dict[str, torch.Tensor], weight: torch.Tensor, shard_id: Any = None) -> None:
        """Checkpoint mode: quantize one BF16 shard ``<shard>.weight`` (the learner's full, unsharded
        HF tensor, as ``load_weights`` passes it) with the layer's current channel set into the
        checkpoint tensors of that shard, and load those through the layer's own loaders (so TP
        slicing is the engine's, as for a fresh checkpoint load). The static activation scale
        (``input_global_scale``) is calibration, not weight: it is kept. The result equals a fresh
        load of a checkpoint quantized from the same weights with the same channels.

        Raises CheckpointError naming the tensor for a non-2-D or non-finite weight, a wrong K,
        a layer whose channels were never loaded, or a fused tensor given whole (give the shards).
        """
        from foursight.schema import encode_module

        if shard_id is None and self.num_shards > 1:
            raise CheckpointError(f"tensor {self.prefix}.weight: a fused weight given whole; load its shards "
                                  f"({', '.join(n.rpartition('.')[2] for n in self.shard_names)}) by their own names")
        idx = shard_index(shard_id, self.num_shards, self.prefix)
        shard = self.shard_names[idx]
        if weight.dim() != 2 or weight.shape[1] != self.input_size:
            raise CheckpointError(f"tensor {shard}.weight has shape {list(weight.shape)}; layer {self.prefix} expects [rows, {self.input_size}]")
        if (BF16_CHANNELS, idx) not in self.loaded:
            raise CheckpointError(f"tensor {shard}.weight: layer {self.prefix} has no channel set loaded yet (load the checkpoint first)")
        channels = params[BF16_CHANNELS].data[idx].to(weight.device)
        # a fresh load casts a checkpoint's tensors to the engine's dtype before anything else; a float32
        # learner (TRL colocate hands its parameters over as they are) must be rounded the same way
        qw = self.quantize_shard(weight.to(params[WEIGHT_BF16].dtype), channels, name=shard)
        for key, t in encode_module(shard, qw).items():
            p = params[key.rpartition(".")[2]]
            if shard_id is None:
                p.weight_loader(p, t)
            else:
                p.weight_loader(p, t, shard_id)
        self.requantized.add(idx)

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
        """True when every shard received a BF16 ``weight`` since the last :meth:`process`."""
        return len(self.pending_weight) == self.num_shards

    def _load_per_shard(self, param: torch.Tensor, loaded: torch.Tensor, idx: int, name: str) -> None:
        row = param.data[idx]
        if row.dim() == 0:  # per-shard scalar: the checkpoint holds [1] (or a bare scalar)
            if tuple(loaded.shape) not in ((), (1,)):
                raise CheckpointError(f"tensor {name} has shape {list(loaded.shape)}, expected [1]")
            row.copy_(loaded.reshape(()))
            return
        if tuple(loaded.shape) != tuple(row.shape):
            raise CheckpointError(f"tensor {name} has shape {list(loaded.shape)}, expected {list(row.shape)}")
        row.copy_(loaded)

    def missing(self, specs: Sequence[ParamSpec]) -> list[str]:
        """Checkpoint names of tensors no loader has seen (empty when complete).

        ``input_global_scale`` is only required when static activation scales are used.
        """
        out = []
        for spec in specs:
            if spec.update_only or (spec.name == INPUT_GLOBAL_SCALE and not self.static_act_scale):
                continue
            for i in range(self.num_shards):
                if (spec.name, i) not in self.loaded:
                    out.append(self.tensor_name(spec.name, i))
        return out
