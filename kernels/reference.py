"""Plain-PyTorch references used by the kernel tests and the benchmark.

The oracle is :mod:`foursight.layer` (re-exported here). :func:`naive_emulation` is the
"dequantize, then matmul" baseline the benchmark times: what a user without kernels would write.
"""

from __future__ import annotations

import torch

from foursight.layer import (  # noqa: F401  (re-exported)
    QuantizedActivation,
    QuantizedWeight,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
    reference_linear,
)
from foursight.nvfp4 import BLOCK_SIZE, block_scales, dequantize_nvfp4, global_scale_from_amax, round_to_e2m1


def naive_emulation(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize X [M, K] (dynamic per-row scale), dequantize the FP4 weight to bf16 on every
    call, two bf16 matmuls (+ bias). Equals :func:`reference_linear` up to the bf16 rounding of the
    dequantized operands. Returns [M, N] in bf16 (for bf16 x)."""
    ch = qw.bf16_channels.long()
    x0 = x.clone()
    x0[:, ch] = 0
    gs = global_scale_from_amax(x0.float().abs().amax(dim=1, keepdim=True))
    s = block_scales(x0, gs).float()
    eff = (s / gs).repeat_interleave(BLOCK_SIZE, dim=1)
    xd = (round_to_e2m1(torch.clamp(x0.float() / eff, -6, 6)) * eff).to(torch.bfloat16)
    wd = dequantize_nvfp4(qw.weight_packed, qw.weight_scale, qw.weight_global_scale, torch.bfloat16)
    y = xd @ wd.t()
    if ch.numel():
        y = y + x[:, ch].to(torch.bfloat16) @ qw.weight_bf16.t()
    if bias is not None:
        y = y + bias
    return y
