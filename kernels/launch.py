"""The weight-side launch arguments the SpliceGEMM forms (:mod:`.gemv`, :mod:`.swap`, :mod:`.ss`) pass
their kernels, from a :class:`~.prepared.PreparedWeight`: the arguments in the kernels' order
(:func:`weight_args`) and the width of one BF16-segment step (:func:`block_ks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

if TYPE_CHECKING:
    from .prepared import PreparedWeight


def weight_args(pw: PreparedWeight, bias, packed: torch.Tensor | None = None) -> tuple:
    """The weight-side arguments every SpliceGEMM kernel takes, in their order: channels, packed codes
    (``packed``: another view of them, e.g. int32 words) and stride, scale bytes and stride, weight
    global scales, W_bf16 and stride, bias. Absent tensors are replaced by a never-read dummy."""
    kk = pw.num_channels
    dummy = pw.weight_global_scale
    wp = pw.weight_packed if packed is None else packed
    return (
        pw.bf16_channels if kk else pw.channel_mask,
        wp, wp.stride(0),
        pw.weight_scale, pw.weight_scale.stride(0),
        pw.weight_global_scale,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
    )


def block_ks(kk: int, cap: int) -> int:
    """Width of one BF16-segment step: the next power of two of k, between 16 and ``cap``."""
    return min(cap, max(16, triton.next_power_of_2(max(kk, 1))))
