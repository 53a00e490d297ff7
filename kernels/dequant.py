"""The dequantize-then-cuBLAS datapath of SpliceGEMM (prefill, large M).

Hopper has no FP4 tensor-core instruction, so at large M the GEMM runs on BF16 ``wgmma`` whatever
kernel computes it; cuBLAS is the best BF16 GEMM on the machine. This datapath therefore computes

    Y = A' · W'ᵀ (+ bias)     with one cuBLAS call (``torch.mm`` / ``torch.addmm``),

where the two BF16 operands are built by two memory-bound Triton kernels:

* ``W'`` [N, K] (:func:`_dequant_weight_kernel`, then an ``index_copy_``): the NVFP4 weight dequantized,
  ``e2m1 · s`` (exact in BF16: at most 6 significant bits, in [2^-10, 2688]), divided by the
  per-output-row weight global scale unless that scale is one per tensor, with the BF16 weight
  columns ``W[:, S]`` written into the S columns (their FP4 codes are zero in the prepared weight).
* ``A'`` [M, K] (``_act_quant_kernel`` with ``FQ``, :mod:`foursight.kernels.act_quant`): the
  activation quantized exactly as the reference does (bit-exact codes and scales), written as the
  BF16 value ``q · s / gs_a`` (times ``1 / gs_w`` when the weight scale is one per tensor) and
  ``X[:, S]`` at the S columns.

Numerics: the S segment is exact; the FP4 segment's products carry one BF16 rounding of the
activation operand (per-tensor weight scale) or of both operands (per-row weight scale), i.e.
BF16-level noise on the dequantized values, against the fused kernels' exact products. Memory: the
two operands are allocated per call from PyTorch's caching allocator (stream-ordered, so safe on
any stream and inside CUDA graphs); the largest layer's ``W'`` (2·N·K bytes) and ``A'``
(2·M·K bytes) are what it holds at a time.

Reference: :func:`foursight.layer.reference_linear` (the same function the fused kernels compute).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import act_quant_launch
from .configs import DequantConfig
from .prepared import PreparedWeight
from .primitives import _e2m1_f16, _e4m3_f32, _rne_bf16, interpreting



@triton.jit
def _dequant_weight_kernel(
    wp_ptr, stride_wpn,  # W packed uint8 [N, K/2] (S nibbles zero)
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N] weight global scale per output row
    out_ptr, stride_on,  # bf16 [N, K]
    N, K,
    DIV_GS: tl.constexpr,  # divide by the per-row global scale (else the caller folds 1/gs_w into A')
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``out[n, k] = e2m1(W)[n, k] · s[n, k // 16] (/ gs_w[n])`` (0 at the S columns, whose codes are
    0). One program per [BN, BK] tile: many small programs keep enough loads in flight to stream at
    HBM speed, and the unmasked row stores stay 16-byte vectors. The caller then writes W[:, S]
    into the S columns (one ``index_copy_``, stream-ordered after this kernel)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rn = offs_n.to(tl.int64)
    G: tl.constexpr = BK // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    k0 = pid_k * BK
    if DIV_GS:
        inv = 16384.0 / tl.load(w_gs_ptr + rn, mask=nmask, other=1.0)
    else:
        inv = tl.full((BN,), 16384.0, tl.float32)
    gm = (k0 // 16 + g) < K // 16
    m2 = nmask[:, None] & gm[None, :]
    p = tl.load(wp_ptr + rn[:, None, None] * stride_wpn + (k0 // 2 + g * 8)[None, :, None] + j8[None, None, :],
                mask=m2[:, :, None], other=0).to(tl.int32)
    sb = tl.load(ws_ptr + rn[:, None] * stride_wsn + (k0 // 16 + g)[None, :], mask=m2, other=0).to(tl.int32)
    f = _e4m3_f32(sb) * inv[:, None]  # [BN, G]: scale, 2^14 and 1/gs_w folded
    lo = _e2m1_f16(p & 15).to(tl.float32) * f[:, :, None]
    hi = _e2m1_f16(p >> 4).to(tl.float32) * f[:, :, None]
    v = tl.reshape(tl.interleave(lo, hi), (BN, BK))
    if DIV_GS:
        v = _rne_bf16(v)  # no-op on the GPU's rounding conversion; the interpreter truncates
    kk = k0 + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None] * stride_on + kk[None, :], v.to(tl.bfloat16), mask=nmask[:, None] & (kk < K)[None, :])


def dequant_weight(cfg: DequantConfig, pw: PreparedWeight, div_gs: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """W' [N, K] bf16: the dequantized weight with ``W[:, S]`` spliced in (``div_gs``: divided by the
    per-row weight global scale)."""
    bn, bk, nw = cfg.block_n, cfg.block_k, cfg.num_warps
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    w = torch.empty((n, k_dim), dtype=torch.bfloat16, device=pw.weight_packed.device) if out is None else out
    _dequant_weight_kernel[(triton.cdiv(n, bn), triton.cdiv(k_dim, bk))](
        pw.weight_packed, pw.weight_packed.stride(0),
        pw.weight_scale, pw.weight_scale.stride(0),
        pw.weight_global_scale,
        w, w.stride(0),
        n, k_dim,
        DIV_GS=div_gs, BN=bn, BK=bk,
        num_warps=4 if interpreting() else nw,
    )
    if kk:
        ch = pw._cache.get("channels_long")
        if ch is None:
            ch = pw._cache["channels_long"] = pw.bf16_channels.long()
        w.index_copy_(1, ch, pw.weight_bf16)
    return w


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def dequant_linear(cfg: DequantConfig, x2, pw: PreparedWeight, bias, input_global_scale, act_quant, out):
    """The dequantize-then-cuBLAS datapath: W' and A' in bf16, one ``torch.mm``/``torch.addmm``.

    On CUDA the weight dequantization (memory-bound) runs on a side stream concurrently with the
    activation quantization (arithmetic-bound); the GEMM waits for both. Both streams' work is
    stream-ordered, so this is capturable in a CUDA graph."""
    if x2.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        raise ValueError(f"foursight.kernels: the 'dequant' datapath needs bf16 activations, got {x2.dtype}")
    fold = act_quant and pw.uniform_global_scale
    w = torch.empty((pw.out_features, pw.in_features), dtype=torch.bfloat16, device=x2.device)
    concurrent = x2.is_cuda and act_quant and not interpreting()
    if concurrent:
        main = torch.cuda.current_stream(x2.device)
        side = _side_stream(x2.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dequant_weight(cfg, pw, div_gs=not fold, out=w)
    else:
        dequant_weight(cfg, pw, div_gs=not fold, out=w)
    if act_quant:
        post = pw._cache.get("post")
        if post is None:
            post = pw._cache["post"] = (1.0 / pw.weight_global_scale[:1].float()) if fold else torch.ones(1, device=x2.device)
        _, _, a, _, _ = act_quant_launch(x2, pw.channel_mask, pw.bf16_channels, input_global_scale, False, True, False, post=post)
    else:
        a = x2
    if concurrent:
        main.wait_stream(side)
    if bias is not None:
        torch.addmm(bias.to(torch.bfloat16), a, w.t(), out=out)
    else:
        torch.mm(a, w.t(), out=out)
