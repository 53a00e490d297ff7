"""Checkpoint tensor names -> an engine's parameter names (engine-neutral; vLLM's mapper is read off the model).

A checkpoint names a fused layer's shards (``q_proj``, ``k_proj``, ``v_proj``), the engine holds one
fused parameter (``qkv_proj``): :func:`packed_name_map` maps the one onto the other through the
model's ``packed_modules_mapping`` (:data:`DEFAULT_PACKED_MODULES` when it gives none; the opposite
direction, an engine layer's shard names, is :func:`foursight.quant_methods.sharding.shard_names`).
vLLM renames some checkpoint names first (its ``hf_to_vllm_mapper``): :func:`vllm_name_map`. Some
tensors no engine has a parameter for (:data:`ENGINE_SKIPPED`). The whole-update check
(:mod:`foursight.quant_methods.update_check`) and the checkpoint-load completeness check
(:func:`foursight.quant_methods.config.checked_complete`) compare names through these maps.
"""

from __future__ import annotations

from typing import Callable

import torch

#: The fused-module map of Llama/Qwen-style models, used when an engine gives none.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

#: tensors engines skip by name without a parameter for them (rotary tables some checkpoints carry)
ENGINE_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def packed_name_map(model: torch.nn.Module, packed: dict[str, list[str]] | None = None):
    """Checkpoint name -> engine parameter name through the fused-layer map (``packed`` or the
    model's ``packed_modules_mapping``): ``...self_attn.q_proj.weight`` -> ``...self_attn.qkv_proj.weight``."""
    packed = packed or dict(getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES)
    shard_to_fused = {shard: fused for fused, shards in packed.items() for shard in shards}
    return lambda name: ".".join(shard_to_fused.get(p, p) for p in name.split("."))


def vllm_name_map(model: torch.nn.Module) -> Callable[[str], str | None]:
    """Checkpoint (HF) name -> vLLM parameter name: the model's ``hf_to_vllm_mapper`` (None: a name
    vLLM skips), then the fused-layer map (``q_proj`` -> ``qkv_proj``; a FourSight layer's shards are
    checked by their own rules before the map is consulted)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    packed = packed_name_map(model)

    def map_name(name: str) -> str | None:
        mapped = mapper.map_name(name) if mapper is not None else name
        return None if mapped is None else packed(mapped)

    return map_name
