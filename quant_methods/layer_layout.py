"""The layout of a FourSight engine layer: the parameters it registers, their shapes and how the
engine's loaders split them. Part of the per-layer plan (:mod:`foursight.quant_methods.plan`).

Two load modes (``LayerPlan.mode``):

* ``"checkpoint"``: a FourSight checkpoint. Parameters per fused layer, derived from the
  checkpoint format's table (``schema.expected_shapes``; N = sum of the local
  output shards, K_loc = the local input size, k = BF16 channels, S = number of shards, e.g.
  3 for q/k/v):

  ============================  ====================  ===========  ===================================
  name                          shape                 dtype        loading
  ============================  ====================  ===========  ===================================
  ``weight_packed``             [N, K_loc/2]          uint8        engine loader (output_dim 0,
                                                                   input_dim 1, packed_dim 1, factor 2)
  ``weight_scale``              [N, K_loc/16]         float8_e4m3  engine loader (output_dim 0, input_dim 1)
  ``weight_bf16``               [N, k]                bfloat16     engine loader (output_dim 0; never
                                                                   split along K: kept whole, see TP)
  ``weight_global_scale``       [S]                   float32      per-shard row (``shard_id``)
  ``input_global_scale``        [S]                   float32      per-shard row
  ``bf16_channels``             [S, k]                int32        per-shard row; all rows must match
  ============================  ====================  ===========  ===================================

* ``"online"``: a BF16 checkpoint quantized at load (``--quantization foursight`` on a plain HF
  model, and the RL weight-update path). One parameter ``weight`` [N, K_loc] in the model dtype,
  loaded by the engine's loader; :meth:`LayerPlan.process` quantizes each shard with its own
  global scale and the shared channel set from a channels file or, failing that, the weight.

Fused layers: each shard keeps its own per-tensor ``weight_global_scale`` (as in the checkpoint);
the execution form gets a per-output-row vector (``QuantizedWeight.weight_global_scale`` [N]).
All shards of a fused layer share one input, so they must have identical ``bf16_channels``; a
mismatch is a :class:`~foursight.schema.CheckpointError` naming the layer.

Tensor parallelism:

* column-parallel layers (q/k/v, gate/up) split N: nothing special, every rank keeps all k
  channels and the rows of ``weight_bf16`` of its N shard;
* row-parallel layers (o_proj, down_proj) split K: rank r holds K columns
  ``[r*K_loc, (r+1)*K_loc)``; it keeps only the BF16 channels that fall into its K shard,
  re-indexed locally (``localize_channels``), and the matching columns of ``weight_bf16``. The
  global scales stay shared (they are per tensor). The rank outputs sum (engine all-reduce)
  to the unsharded result; with dynamic activation scales each rank's per-row activation global
  scale is taken over its own K shard (the FP4 block scales do not change), so TP>1 is within
  NVFP4 rounding of TP=1 rather than bit-identical; with static scales it is exact up to
  float32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self, Sequence

import torch

from foursight.nvfp4 import BLOCK_SIZE
from foursight.quant_methods.sharding import shard_names
from foursight.schema import (
    BF16_CHANNELS,
    INPUT_GLOBAL_SCALE,
    WEIGHT_BF16,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    CheckpointError,
    FourSightConfig,
    expected_shapes,
)

if TYPE_CHECKING:  # annotations only: the layout carries the online settings to LayerPlan.process and reads none of them
    from foursight.quant_methods.online import OnlineSettings

#: Name of the BF16 weight parameter in online mode (the HF name, so ``load_weights`` finds it).
WEIGHT = "weight"

LoadMode = Literal["checkpoint", "online"]


#: engine weight attributes of the checkpoint tensors with one row per output row (the others are per shard)
_ENGINE_ATTRS: dict[str, dict[str, int]] = {
    WEIGHT_PACKED: {"input_dim": 1, "output_dim": 0, "packed_dim": 1, "packed_factor": 2},
    WEIGHT_SCALE: {"input_dim": 1, "output_dim": 0},
    WEIGHT_BF16: {"output_dim": 0},  # never split along K: kept whole (module docstring, TP)
}
#: the checkpoint's per-tensor [1] scales: one value per shard, a [S] parameter
_PER_TENSOR_SCALARS = (WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE)
#: the order the parameters are registered in (and missing tensors named in)
_CHECKPOINT_ORDER = (WEIGHT_PACKED, WEIGHT_SCALE, WEIGHT_BF16, WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE, BF16_CHANNELS)


@dataclass
class ParamSpec:
    """One parameter an engine must register in ``create_weights``.

    Attributes:
        name: attribute name on the layer (= checkpoint tensor suffix).
        shape, dtype: allocation.
        attrs: engine weight attributes (``input_dim``, ``output_dim``, ``packed_dim``,
            ``packed_factor``); the engine adds its ``weight_loader``.
        per_shard: True if the parameter holds one row per fused shard and is filled by the
            core's own per-shard loader (the engine loader is not used).
        update_only: True for the empty ``weight`` parameter of a checkpoint-mode layer: it holds
            nothing and is never part of the checkpoint; it exists so that the engine's own
            ``load_weights`` finds a parameter for a BF16 ``<module>.weight`` (an RL weight sync)
            and calls its loader, which quantizes the shard into the checkpoint tensors
            (:meth:`LayerPlan.load_bf16_shard`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    attrs: dict[str, Any]
    per_shard: bool = False
    update_only: bool = False


@dataclass
class LayerLayout:
    """What one engine linear layer is: its shards, sizes, TP position, load mode and precision, and
    from those the parameters it registers (:meth:`param_specs`).

    Attributes:
        prefix: engine module name (``model.layers.0.self_attn.qkv_proj``).
        shard_names: checkpoint module names of its shards (``[...q_proj, ...k_proj, ...v_proj]``).
        shard_sizes: local output rows of each shard (this rank).
        input_size: global K.
        input_size_per_partition: local K (== K unless the layer is row-parallel with TP>1).
        tp_rank, tp_size: the layer's TP position (0, 1 for replicated layers).
        mode: ``"checkpoint"`` or ``"online"``.
        k: BF16 channels per shard (checkpoint mode; online mode resolves it at process time).
        act_quant: W4A4 or W4A16.
        static_act_scale: use ``input_global_scale`` (checkpoint) / channels-file amax (online).
        online: online settings (online mode only).
    """

    prefix: str
    shard_names: list[str]
    shard_sizes: list[int]
    input_size: int
    input_size_per_partition: int
    tp_rank: int = 0
    tp_size: int = 1
    mode: LoadMode = "checkpoint"
    k: int = 0
    act_quant: bool = True
    static_act_scale: bool = False
    online: OnlineSettings | None = None

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def for_layer(
        cls,
        prefix: str,
        output_partition_sizes: Sequence[int],
        input_size: int,
        input_size_per_partition: int,
        config: FourSightConfig,
        packed_modules_mapping: dict[str, list[str]] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        mode: LoadMode = "checkpoint",
        online: OnlineSettings | None = None,
    ) -> Self:
        """The layout (a :class:`~foursight.quant_methods.plan.LayerPlan` when called on it) of an engine
        layer. In checkpoint mode, k is read from ``config.channels`` for
        every shard name; shards with different k raise :class:`CheckpointError` naming the layer."""
        names = shard_names(prefix, packed_modules_mapping)
        sizes = list(output_partition_sizes)
        if len(names) != len(sizes):
            if len(sizes) == 1:
                names = [prefix]
            else:
                raise CheckpointError(f"{prefix}: {len(sizes)} output shards but packed_modules_mapping gives {names}")
        if input_size % BLOCK_SIZE or input_size_per_partition % BLOCK_SIZE:
            raise CheckpointError(
                f"{prefix}: input size {input_size} (local {input_size_per_partition}) is not a multiple of {BLOCK_SIZE}; "
                "NVFP4 needs whole 16-blocks per TP shard"
            )
        k = 0
        if mode == "checkpoint":
            ks = {n: config.channels_for(n) for n in names}
            if len(set(ks.values())) > 1:
                raise CheckpointError(f"{prefix}: fused shards have different channel counts in quantization_config.channels: {ks}")
            k = next(iter(ks.values()))
            if k >= input_size:
                raise CheckpointError(f"{prefix}: quantization_config.channels gives k={k} but K={input_size}")
        return cls(
            prefix=prefix,
            shard_names=names,
            shard_sizes=sizes,
            input_size=input_size,
            input_size_per_partition=input_size_per_partition,
            tp_rank=tp_rank,
            tp_size=tp_size,
            mode=mode,
            k=k,
            act_quant=config.activation_dtype == "nvfp4",
            static_act_scale=config.activation_scale == "static",
            online=online,
        )

    @property
    def num_shards(self) -> int:
        return len(self.shard_sizes)

    @property
    def out_local(self) -> int:
        return sum(self.shard_sizes)

    @property
    def k_split(self) -> bool:
        """True if K is split across ranks (row-parallel with TP>1)."""
        return self.input_size_per_partition != self.input_size

    @property
    def k_start(self) -> int:
        return self.tp_rank * self.input_size_per_partition if self.k_split else 0

    def param_specs(self, params_dtype: torch.dtype = torch.bfloat16) -> list[ParamSpec]:
        """Parameters to register (see the module docstring's table)."""
        n, kl, s = self.out_local, self.input_size_per_partition, self.num_shards
        if self.mode == "online":
            return [ParamSpec(WEIGHT, (n, kl), params_dtype, {"input_dim": 1, "output_dim": 0})]
        # the checkpoint format's own table (schema.expected_shapes) for the fused local rows: a tensor
        # with a row per output row is loaded by the engine's loader (the attributes say how it is
        # split); the others ([1] scales, [k] channels) hold one row per fused shard
        shapes = expected_shapes(n, self.input_size, self.k, self.prefix, local_in_features=kl)
        specs = [ParamSpec(WEIGHT, (0,), params_dtype, {}, update_only=True)]
        for name in _CHECKPOINT_ORDER:
            shape, dtype = shapes[name]
            if name in _ENGINE_ATTRS:
                specs.append(ParamSpec(name, shape, dtype, dict(_ENGINE_ATTRS[name])))
            else:
                specs.append(ParamSpec(name, (s,) + (() if name in _PER_TENSOR_SCALARS else shape), dtype, {}, per_shard=True))
        return specs

    def init_value(self, spec: ParamSpec) -> float:
        """Fill value for a fresh parameter (scales 1.0 so an unloaded layer is still finite)."""
        return 1.0 if spec.name in (WEIGHT_GLOBAL_SCALE, INPUT_GLOBAL_SCALE) else 0.0

    def initial_tensor(self, spec: ParamSpec) -> torch.Tensor:
        """A fresh tensor for ``spec`` filled with :meth:`init_value`, for the engine to wrap as a parameter."""
        return torch.full(spec.shape, self.init_value(spec), dtype=torch.float32).to(spec.dtype)

    def tensor_name(self, suffix: str, shard: int | None) -> str:
        """Checkpoint name of a tensor of this layer, e.g. ``model.layers.0.self_attn.k_proj.weight_scale``."""
        if shard is None:
            base = self.shard_names[0] if self.num_shards == 1 else self.prefix
        else:
            base = self.shard_names[shard]
        return f"{base}.{suffix}"
