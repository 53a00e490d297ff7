"""The dequantize-then-cuBLAS datapath of SpliceGEMM (prefill, large M).

Hopper has no FP4 tensor-core instruction, so at large M the GEMM runs on BF16 ``wgmma`` whatever
kernel computes it; cuBLAS is the best BF16 GEMM on the machine. This datapath therefore computes

    Y = A' · W'ᵀ (+ bias)     with one cuBLAS call (``torch.mm`` / ``torch.addmm``),

where the two BF16 operands are built by two memory-bound Triton kernels:

* ``W'`` [N, K] (:func:`_dequant_weight_kernel`, then an ``index_copy_``): the NVFP4 weight dequantized
  from the layer's one resident form, the fragment form the decode GEMM reads (:mod:`.fragment_layout`),
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

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .act_quant import act_quant_launch
from .configs import DequantConfig
from .fragment_layout import fragment_tile, scale_view
from .primitives import rne_bf16
from .runtime import interpreting

if TYPE_CHECKING:
    from .prepared import PreparedWeight



@triton.jit
def _dequant_weight_kernel(
    wf_ptr, stride_wfn,  # fragment codes as int32 words [Np, Kp/8] (rows of each 64-row block in load order)
    sf_ptr, stride_sfn,  # fragment scales as int16 ([Np, Kp/32] E5M3 byte pairs, or [Np, Kp/16] bf16 bits with SCALE_BF16)
    w_gs_ptr,  # fp32 [N] weight global scale per output row
    out_ptr, stride_on,  # bf16 [N, K]
    N, K, NP,
    DIV_GS: tl.constexpr,  # divide by the per-row global scale (else the caller folds 1/gs_w into A')
    SCALE_BF16: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``out[n, k] = e2m1(W)[n, k] · s[n, k // 16] (/ gs_w[n])`` (0 at the S columns, whose codes are
    0), read from the fragment form, the same loads and decode as the GEMM's main loop
    (:func:`~.fragment_layout.fragment_tile`), whose value ``e2m1 · s · 2^-7`` is exact in bf16. One program
    per [BN, BK] tile (BN a multiple of the stored 64-row block, BK of the 128-column chunk). The
    caller then writes W[:, S] into the S columns (one ``index_copy_``, stream-ordered after this)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rl = pid_n * BN + tl.arange(0, BN)  # stored rows (load order)
    offs_n = pid_n * BN + tl.arange(0, BN)  # real rows after the layout chain
    WB: tl.constexpr = BK // 8
    G: tl.constexpr = BK // 16 if SCALE_BF16 else BK // 32
    rmask = (rl < NP)[:, None]
    wq = tl.load(wf_ptr + rl.to(tl.int64)[:, None] * stride_wfn + (pid_k * WB + tl.arange(0, WB))[None, :], mask=rmask, other=0)
    sc = tl.load(sf_ptr + rl.to(tl.int64)[:, None] * stride_sfn + (pid_k * G + tl.arange(0, G))[None, :], mask=rmask, other=0)
    w = fragment_tile(wq, sc.to(tl.int32), BN, BK, SCALE_BF16, INTERP).to(tl.float32)
    nmask = offs_n < N
    rn = offs_n.to(tl.int64)
    if DIV_GS:
        f = 128.0 / tl.load(w_gs_ptr + rn, mask=nmask, other=1.0)
        v = rne_bf16(w * f[:, None])  # no-op on the GPU's rounding conversion; the interpreter truncates
    else:
        v = w * 128.0  # exact
    kk = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None] * stride_on + kk[None, :], v.to(tl.bfloat16), mask=nmask[:, None] & (kk < K)[None, :])


def dequant_weight(cfg: DequantConfig, pw: PreparedWeight, div_gs: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """W' [N, K] bf16: the dequantized weight with ``W[:, S]`` spliced in (``div_gs``: divided by the
    per-row weight global scale), from the layer's fragment form."""
    bn, bk, nw = cfg.block_n, cfg.block_k, cfg.num_warps
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    fw = pw.fragment
    sf = scale_view(fw)
    w = torch.empty((n, k_dim), dtype=torch.bfloat16, device=fw.words.device) if out is None else out
    _dequant_weight_kernel[(triton.cdiv(n, bn), triton.cdiv(k_dim, bk))](
        fw.words, fw.words.stride(0),
        sf, sf.stride(0),
        pw.weight_global_scale,
        w, w.stride(0),
        n, k_dim, fw.words.shape[0],
        DIV_GS=div_gs, SCALE_BF16=fw.scale_bf16, BN=bn, BK=bk, INTERP=interpreting(),
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
