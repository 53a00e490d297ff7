"""The layout of a FourSight engine layer: its shards, their sizes, its place in tensor parallelism
and its precision; nothing about how it is loaded (:mod:`~foursight.quant_methods.layer_loading`)
or from what (the checkpoint and online plans, :mod:`~foursight.quant_methods.plan`, with the
parameters of :mod:`~foursight.quant_methods.param_kinds`).

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
from typing import Sequence

from foursight.nvfp4 import BLOCK_SIZE
from foursight.quant_methods.sharding import shard_names
from foursight.schema import CheckpointError, FourSightConfig

#: Name of the BF16 weight parameter (the HF name, so ``load_weights`` finds it): the online weight, and the
#: empty parameter of a checkpoint-mode layer that takes a BF16 weight update
WEIGHT = "weight"


@dataclass
class LayerLayout:
    """What one engine linear layer is: its shards, sizes, TP position and precision.

    Attributes:
        prefix: engine module name (``model.layers.0.self_attn.qkv_proj``).
        shard_names: checkpoint module names of its shards (``[...q_proj, ...k_proj, ...v_proj]``).
        shard_sizes: local output rows of each shard (this rank).
        input_size: global K.
        input_size_per_partition: local K (== K unless the layer is row-parallel with TP>1).
        tp_rank, tp_size: the layer's TP position (0, 1 for replicated layers).
        k: BF16 channels per shard, as the checkpoint's config gives them (0 for a layer quantized at load:
            it resolves its channels when it is processed).
        act_quant: W4A4 or W4A16.
        static_act_scale: use ``input_global_scale`` (checkpoint) / channels-file amax (online).
    """

    prefix: str
    shard_names: list[str]
    shard_sizes: list[int]
    input_size: int
    input_size_per_partition: int
    tp_rank: int = 0
    tp_size: int = 1
    k: int = 0
    act_quant: bool = True
    static_act_scale: bool = False

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
        channels_from_config: bool = False,
    ) -> LayerLayout:
        """The layout of an engine layer. With ``channels_from_config`` (a FourSight checkpoint), k is read from
        ``config.channels`` for every shard name; shards with different k raise :class:`CheckpointError` naming
        the layer."""
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
        if channels_from_config:
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
            k=k,
            act_quant=config.activation_dtype == "nvfp4",
            static_act_scale=config.activation_scale == "static",
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

    def tensor_name(self, suffix: str, shard: int | None) -> str:
        """Checkpoint name of a tensor of this layer, e.g. ``model.layers.0.self_attn.k_proj.weight_scale``."""
        if shard is None:
            base = self.shard_names[0] if self.num_shards == 1 else self.prefix
        else:
            base = self.shard_names[shard]
        return f"{base}.{suffix}"
