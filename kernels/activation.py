"""The activation quantizer's entry point: :func:`quantize_activation`, the Triton twin of
:func:`foursight.layer.quantize_activation` (bit-exact), and the check of an activation's shape and dtype
(:func:`check_activation`) the linear entry points share (:mod:`.api`)."""

from __future__ import annotations

import torch

from foursight.layer import QuantizedActivation, channel_mask, check_channels
from foursight.nvfp4 import NVFP4Error, check_k

from .act_quant import act_quant_launch


def check_activation(x: torch.Tensor, name: str) -> None:
    """An activation ``x`` (named ``name`` in the error): [M, K], bf16/fp16/fp32, K a multiple of the block."""
    if x.dim() != 2:
        raise NVFP4Error(f"{name}: expected [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NVFP4Error(f"{name}: unsupported dtype {x.dtype} (bf16, fp16 or fp32)")
    check_k(x.shape[1], name)


def quantize_activation(
    x: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    name: str = "input",
) -> QuantizedActivation:
    """Triton twin of :func:`foursight.layer.quantize_activation` (bit-exact).

    Args:
        x: [M, K] bf16/fp16/fp32, any strides; finite (not checked here, to avoid a host sync).
        channels: int [k] sorted unique indices of the BF16 channels S.
        global_scale: optional static float32 scalar/[1]; None = dynamic ``448*6/rowamax``.
    Returns:
        QuantizedActivation(packed uint8 [M, K/2], scale float8_e4m3fn [M, K/16],
        global_scale float32 [M], x_bf16 [M, k] in x's dtype).
    """
    check_activation(x, name)
    m, k_dim = x.shape
    ch = check_channels(channels, k_dim, f"{name}.channels").to(x.device)
    mask = channel_mask(ch, k_dim)
    packed, scale, _, gs, xs = act_quant_launch(x, mask, ch, global_scale, True, False, True)
    if xs is None:
        xs = torch.empty((m, 0), dtype=x.dtype, device=x.device)
    return QuantizedActivation(packed=packed, scale=scale.view(torch.float8_e4m3fn), global_scale=gs, x_bf16=xs)
