"""Fused shards and tensor parallelism of a FourSight linear layer (engine-neutral).

Engine shard ids and the checkpoint names of a fused layer's shards, the K-shard of a channel
set, the slice of a layer that one TP rank holds, the fusion of shards along N, and the engine's
TP collectives as :class:`TPContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch

from foursight.layer import QuantizedWeight
from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error
from foursight.schema import CheckpointError

_QKV_IDS = {"q": 0, "k": 1, "v": 2}


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def shard_index(shard_id: Any, num_shards: int, layer: str = "layer") -> int:
    """Map an engine shard id (``None``, ``"q"``/``"k"``/``"v"``, or an int) to 0..num_shards-1."""
    if shard_id is None:
        idx = 0
    elif isinstance(shard_id, str):
        if shard_id not in _QKV_IDS:
            raise CheckpointError(f"{layer}: unknown shard id {shard_id!r}")
        idx = _QKV_IDS[shard_id]
    elif isinstance(shard_id, int):
        idx = shard_id
    else:
        raise CheckpointError(f"{layer}: unsupported shard id {shard_id!r} (already-fused tensors on disk are not supported)")
    if not 0 <= idx < num_shards:
        raise CheckpointError(f"{layer}: shard id {shard_id!r} out of range for {num_shards} shard(s)")
    return idx


def shard_names(prefix: str, packed_modules_mapping: dict[str, list[str]] | None) -> list[str]:
    """Checkpoint module names of the shards of engine layer ``prefix``.

    ``model.layers.0.self_attn.qkv_proj`` with ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``
    gives ``[model.layers.0.self_attn.q_proj, ...k_proj, ...v_proj]``; an unfused layer gives
    ``[prefix]``.
    """
    parent, _, last = prefix.rpartition(".")
    mapping = packed_modules_mapping or {}
    if last in mapping:
        return [f"{parent}.{s}" if parent else s for s in mapping[last]]
    return [prefix]


def localize_channels(channels: torch.Tensor, k_start: int, k_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict a global channel set to one K shard and re-index it locally.

    Args:
        channels: int [k] sorted global indices in [0, K).
        k_start: first global column of this rank's K shard.
        k_local: width of the shard.
    Returns:
        ``(local, keep)``: int32 [k_r] local indices in [0, k_local) (sorted), and int64 [k_r]
        positions in ``channels`` of the kept entries (to select columns of ``weight_bf16``).
    """
    ch = channels.to(torch.int64).reshape(-1)
    mask = (ch >= k_start) & (ch < k_start + k_local)
    keep = torch.nonzero(mask, as_tuple=False).reshape(-1)
    return (ch[keep] - k_start).to(torch.int32), keep


def shard_quantized_weight(qw: QuantizedWeight, tp_rank: int, tp_size: int, dim: Literal["N", "K"]) -> QuantizedWeight:
    """The part of an unsharded layer that TP rank ``tp_rank`` of ``tp_size`` holds.

    ``dim="N"`` (column parallel): rows ``[r*N/tp, (r+1)*N/tp)`` of every [N, ...] tensor, all
    channels, per-row global scales sliced (a [1] scale stays shared).
    ``dim="K"`` (row parallel): columns of the packed weight and block scales of the K shard,
    the BF16 channels inside that shard re-indexed locally (:func:`localize_channels`), the
    global scale unchanged (shared). This is the same slicing the engines' loaders plus
    :meth:`LayerPlan.process` perform; it exists to test them against the unsharded reference.
    """
    n, k_dim = qw.out_features, qw.in_features
    if dim == "N":
        if n % tp_size:
            raise NVFP4Error(f"N={n} not divisible by tp_size={tp_size}")
        step = n // tp_size
        rows = slice(tp_rank * step, (tp_rank + 1) * step)
        gs = qw.weight_global_scale
        gs = gs if gs.numel() == 1 else gs.reshape(-1)[rows]
        return QuantizedWeight(qw.weight_packed[rows], qw.weight_scale[rows], gs, qw.bf16_channels, qw.weight_bf16[rows])
    if k_dim % (tp_size * BLOCK_SIZE):
        raise NVFP4Error(f"K={k_dim} not divisible into {tp_size} shards of whole {BLOCK_SIZE}-blocks")
    kl = k_dim // tp_size
    k0 = tp_rank * kl
    local, keep = localize_channels(qw.bf16_channels, k0, kl)
    return QuantizedWeight(
        qw.weight_packed[:, k0 // 2 : (k0 + kl) // 2].contiguous(),
        qw.weight_scale[:, k0 // BLOCK_SIZE : (k0 + kl) // BLOCK_SIZE].contiguous(),
        qw.weight_global_scale,
        local,
        qw.weight_bf16[:, keep].contiguous(),
    )


def concat_shards(parts: Sequence[QuantizedWeight], layer: str = "layer") -> QuantizedWeight:
    """Fuse shards (q/k/v or gate/up) of one input into one layer along N.

    Each part's global scale ([1] or [rows]) becomes a per-row vector, so every shard keeps its
    own scale: the result has ``weight_global_scale`` float32 [sum N] (or [1] if a single part
    with a [1] scale). All parts must have identical ``bf16_channels`` (same input).
    """
    if not parts:
        raise CheckpointError(f"{layer}: no shards")
    ch0 = parts[0].bf16_channels
    for i, p in enumerate(parts[1:], 1):
        if p.bf16_channels.shape != ch0.shape or not torch.equal(p.bf16_channels.cpu(), ch0.cpu()):
            raise CheckpointError(
                f"{layer}: bf16_channels differ between fused shards 0 and {i} "
                f"({ch0.tolist()[:8]}... vs {p.bf16_channels.tolist()[:8]}...); shards that share an input must share S"
            )
    if len(parts) == 1:
        return parts[0]
    gs = torch.cat([p.weight_global_scale.float().reshape(-1).expand(p.out_features) if p.weight_global_scale.numel() == 1 else p.weight_global_scale.float().reshape(-1) for p in parts])
    return QuantizedWeight(
        torch.cat([p.weight_packed for p in parts]),
        torch.cat([p.weight_scale for p in parts]),
        gs.contiguous(),
        ch0,
        torch.cat([p.weight_bf16 for p in parts]),
    )


@dataclass
class TPContext:
    """The engine's tensor-parallel group as seen by the core.

    Attributes:
        rank, size: this rank and the TP world size (0, 1 without TP).
        all_reduce_max: in-place max all-reduce over the TP group of a float32 tensor
            (only called when size > 1).
        all_gather_cat: concatenation along dim 0 of a tensor from every rank, in rank order
            (only called when size > 1).
    """

    rank: int = 0
    size: int = 1
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_gather_cat: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1 or self.all_reduce_max is None:
            return t
        return self.all_reduce_max(t)

    def gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1 or self.all_gather_cat is None:
            return t
        return self.all_gather_cat(t)
