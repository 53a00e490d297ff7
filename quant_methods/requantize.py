"""Quantizing a learner's BF16 shard into a FourSight layer during a weight sync, on the device it lives on.

An RL weight sync re-quantizes every FourSight linear of the engine (``plan.OnlinePlan``
from the layer's BF16 ``weight``, ``plan.CheckpointPlan`` from the BF16 shard the trainer hands over).
:func:`quantize_shard` is that one step:

* on CUDA (with Triton), the fused Triton quantizer of :mod:`foursight.kernels.act_quant` with the
  layer's per-tensor global scale given as its static scale: one kernel reads the weight once and
  writes the packed codes, the E4M3 block scales and ``W[:, S]``; the global scale is computed on the
  device. Nothing waits for the host (no ``.item()``, no ``bool(tensor)``): the channel set is the
  layer's own, validated when it was loaded, and the tensors were checked finite before the load
  (``update_check.guard_load_weights`` and the update routes), so the kernel's input is not
  re-checked here. It is bit-identical to :func:`foursight.layer.quantize_weight` run on the same
  device (the kernel's contract with :func:`foursight.layer.quantize_activation`, whose static-scale
  form is the weight quantizer; tests/test_requantize.py checks it in the Triton interpreter and,
  marked ``gpu``, on the device);
* on the CPU, for a BF16 weight, the fused native quantizer of :mod:`foursight.nvfp4_cpu` (two passes of a
  small C routine instead of a dozen eager tensor operations), bit-identical to
  :func:`foursight.layer.quantize_weight`; a weight with a NaN or Inf, or when the native library is
  unavailable (no compiler: logged once) or turned off (``FOURSIGHT_NATIVE_CPU_QUANT=0``), goes to
* :func:`foursight.layer.quantize_weight` (the vectorized PyTorch encoder of :mod:`foursight.nvfp4`),
  which also checks every value finite and names a bad one.
"""

from __future__ import annotations

import torch

from foursight.layer import QuantizedWeight, channel_mask, check_channels, quantize_weight
from foursight.nvfp4 import NVFP4Error, check_k, global_scale_from_amax


def uses_device_kernel(weight: torch.Tensor) -> bool:
    """Whether :func:`quantize_shard` takes the Triton path for ``weight`` (a CUDA tensor, Triton importable)."""
    if not weight.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def quantize_shard(weight: torch.Tensor, channels: torch.Tensor, global_scale: torch.Tensor | None = None,
                   name: str = "weight", device_kernel: bool | None = None) -> QuantizedWeight:
    """The FourSight form of one BF16 shard ``weight`` [N, K] with the channel set ``channels`` (int [k],
    sorted, the layer's own) and a per-tensor ``global_scale`` (float32 [1]; None: ``448*6/amax`` of the
    weight with the S columns zeroed). ``device_kernel``: force (True) or forbid (False) the Triton path;
    None chooses it for CUDA tensors (module docstring). Returns a :class:`QuantizedWeight` on
    ``weight``'s device."""
    if not (uses_device_kernel(weight) if device_kernel is None else device_kernel):
        from foursight import nvfp4_cpu

        if nvfp4_cpu.supports(weight):
            ch = check_channels(channels, weight.shape[1], name)
            out = nvfp4_cpu.quantize_rows(weight, ch, global_scale=global_scale)
            if out is not None:  # None: a NaN or Inf, which quantize_weight names
                packed, scale, gs = out
                return QuantizedWeight(packed, scale, gs, ch, weight.index_select(1, ch.long()))
        return quantize_weight(weight, channels, global_scale=global_scale, name=name)
    from foursight.kernels.act_quant import act_quant_launch

    if weight.dim() != 2:
        raise NVFP4Error(f"{name}: expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    k_dim = weight.shape[1]
    check_k(k_dim, name)
    w = weight if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) else weight.float()
    ch = channels.to(device=w.device, dtype=torch.int32)
    if global_scale is None:
        a = w.abs()
        if ch.numel():
            a.index_fill_(1, ch.long(), 0)
        global_scale = global_scale_from_amax(a.amax().float())
    gs = global_scale.float().reshape(1).to(w.device)
    packed, scale, _, _, xs = act_quant_launch(w, channel_mask(ch, k_dim), ch, gs, True, False, True)
    w_bf16 = xs.to(torch.bfloat16) if xs is not None else torch.empty((w.shape[0], 0), dtype=torch.bfloat16, device=w.device)
    return QuantizedWeight(packed, scale.view(torch.float8_e4m3fn), gs, ch, w_bf16.contiguous())


def quantize_fused(weight: torch.Tensor, channels: torch.Tensor, shard_rows: list[int], names: list[str]) -> QuantizedWeight:
    """All shards of a fused layer (q/k/v, gate/up; ``shard_rows`` rows each, stacked in ``weight``) at
    once, each with its own per-tensor global scale: the concatenation of :func:`quantize_shard` of
    every shard, bit for bit (``weight_global_scale`` is then per output row, float32 [N], as
    :func:`foursight.quant_methods.sharding.concat_shards` makes it).

    On the CPU one quantizer call over the whole layer replaces one per shard (the per-shard scales
    become a per-row scale [N, 1], which the quantizer's arithmetic treats row by row exactly as a
    scalar): the quantizer's cost is mostly a fixed number of tensor operations, so a fused layer
    costs one shard's count of them. On CUDA each shard runs the Triton kernel (its static scale is
    a scalar). A non-finite value is named by its shard."""
    if len(shard_rows) == 1 or uses_device_kernel(weight):
        from foursight.quant_methods.sharding import concat_shards

        parts, off = [], 0
        for rows, name in zip(shard_rows, names):
            parts.append(quantize_shard(weight[off : off + rows], channels, name=name))
            off += rows
        return concat_shards(parts, names[0])
    from foursight import nvfp4_cpu
    from foursight.nvfp4 import block_amax, check_finite, quantize_nvfp4

    k_dim = weight.shape[1]
    ch = check_channels(channels, k_dim, names[0]).to(weight.device)
    idx = ch.long()
    if nvfp4_cpu.supports(weight):
        out = nvfp4_cpu.quantize_rows(weight, ch, shard_rows=list(shard_rows))
        if out is not None:  # None: a NaN or Inf, named below by the eager path
            packed, scale, gs = out
            return QuantizedWeight(packed, scale, gs, ch, weight.index_select(1, idx))
    w0 = weight.float() if weight.dtype != torch.float32 else weight.clone()
    if idx.numel():
        w0.index_fill_(1, idx, 0.0)
    row_amax = block_amax(w0)  # [N]: per row, then per shard (the S columns are zero in w0)
    gs = torch.cat([global_scale_from_amax(a.max()).reshape(1).expand(len(a)) for a in torch.split(row_amax, shard_rows)])
    try:
        if idx.numel():
            check_finite(weight[:, idx], names[0])
        packed, scale = quantize_nvfp4(w0, gs.reshape(-1, 1), names[0])
    except NVFP4Error:
        off = 0
        for rows, name in zip(shard_rows, names):  # name the shard that holds the bad value
            quantize_shard(weight[off : off + rows], channels, name=name)
            off += rows
        raise
    return QuantizedWeight(packed, scale, gs.contiguous(), ch, weight[:, idx].to(torch.bfloat16).contiguous())
