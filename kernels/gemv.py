"""Kernel form: the one-row decode GEMV (``_splice_gemv1_kernel``, M = 1).

``y[n] = sum_k deq(a)[k] · deq(W)[n, k] (+ x[S] · W_bf16[n]) (+ bias)``: no MMA; the memory-bound
case. The packed weight is read as 32-bit words (16-byte vectors per thread) and each word decoded
into 8 fp32 values with inline PTX (:func:`~.primitives.word_nibbles_asm`; the interpreter runs its
portable twin). Products are fp32 FMAs per word; the two words of a 16-element group are added and
scaled by the group's E4M3 scale once; the global scales once per output.

Reference: :func:`foursight.layer.reference_linear` (M = 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .configs import GemvConfig
from .launch import block_ks, weight_args
from .primitives import bf16_rne, e4m3_f32, word_nibble, word_nibbles_asm
from .runtime import interpreting

if TYPE_CHECKING:
    from .prepared import PreparedWeight


@triton.jit
def _splice_gemv1_kernel(
    x_ptr, stride_xk,  # X [1, K]: the A operand in W4A16 mode, and the BF16 segment's source
    a_ptr,  # A_MODE 1: fp16 [1, K] = q*s
    a_gs_ptr,  # A_MODE 1: fp32 [1]
    ch_ptr,  # int32 [KS]
    wq_ptr, stride_wqn,  # W packed as int32 words [N, K/8] (the uint8 [N, K/2] bytes, little-endian)
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N]
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,
    out_ptr, stride_on,  # [1, N]
    N, K, KS,
    A_MODE: tl.constexpr,  # 0: W4A16 (A = X); 1: A = fp16 q*s + its global scale
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    USE_ASM: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``y[n] = sum_k deq(a)[k] deq(W)[n, k] (+ x[S] . W_bf16[n]) (+ bias)`` for one activation row.

    The memory-bound decode case. Each thread reads 16-byte vectors of the packed weight as four
    int32 words (32 elements, two scale groups) and decodes each word into 8 fp32 values (inline
    PTX on the GPU). The products with the activation run as a chain of fp32 FMAs per word; the
    two words of a 16-element group are added and multiplied by the group's E4M3 scale once.
    The next K step's words and scales are loaded before this step's arithmetic (register double
    buffer).
    """
    pid_n = tl.program_id(0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rn = (offs_n % N).to(tl.int64)
    G2: tl.constexpr = BK // 32  # 32-element chunks (4 words, 2 scale groups) per K step
    g2 = tl.arange(0, G2)
    w4 = tl.arange(0, 4)
    h2 = tl.arange(0, 2)
    KW = K // 8  # words per row
    KG = K // 16

    widx = g2[:, None] * 4 + w4[None, :]  # [G2, 4] word index within the step
    sidx = g2[:, None] * 2 + h2[None, :]  # [G2, 2] scale-group index within the step
    q_ptrs = wq_ptr + rn[:, None, None] * stride_wqn + widx[None, :, :]
    s_ptrs = ws_ptr + rn[:, None, None] * stride_wsn + sidx[None, :, :]
    kb = tl.arange(0, BK)
    acc = tl.zeros((BN, G2, 2), dtype=tl.float32)
    # software pipeline in registers: the weight words and scales of the next two K steps and the
    # activation chunk of the next step are in flight while this step is decoded and multiplied
    q_n1 = tl.load(q_ptrs, mask=(widx < KW)[None, :, :], other=0)
    s_n1 = tl.load(s_ptrs, mask=(sidx < KG)[None, :, :], other=0)
    q_n2 = tl.load(q_ptrs + BK // 8, mask=(BK // 8 + widx < KW)[None, :, :], other=0)
    s_n2 = tl.load(s_ptrs + BK // 16, mask=(BK // 16 + sidx < KG)[None, :, :], other=0)
    if A_MODE == 1:
        a_n1 = tl.load(a_ptr + kb, mask=kb < K, other=0.0)
    else:
        a_n1 = tl.load(x_ptr + kb * stride_xk, mask=kb < K, other=0.0)
    if HAS_KS:
        # the BF16 segment's first chunk, too (its latency would otherwise trail the loop)
        offs_c = tl.arange(0, BLOCK_KS)
        cm0 = offs_c < KS
        ch0 = tl.load(ch_ptr + offs_c, mask=cm0, other=0).to(tl.int64)
        xs0 = tl.load(x_ptr + ch0 * stride_xk, mask=cm0, other=0.0)
        wb0 = tl.load(wb_ptr + rn[:, None] * stride_wbn + offs_c[None, :], mask=cm0[None, :], other=0.0)
    for k0 in range(0, K, BK):
        q = q_n1
        sb = s_n1.to(tl.int32)
        av = a_n1.to(tl.float32)
        q_n1 = q_n2
        s_n1 = s_n2
        q_ptrs += BK // 8
        s_ptrs += BK // 16
        q_n2 = tl.load(q_ptrs + BK // 8, mask=((k0 + 2 * BK) // 8 + widx < KW)[None, :, :], other=0)
        s_n2 = tl.load(s_ptrs + BK // 16, mask=((k0 + 2 * BK) // 16 + sidx < KG)[None, :, :], other=0)
        kk = k0 + BK + kb
        if A_MODE == 1:
            a_n1 = tl.load(a_ptr + kk, mask=kk < K, other=0.0)
        else:
            a_n1 = tl.load(x_ptr + kk * stride_xk, mask=kk < K, other=0.0)
        # activation chunk [BK] -> eight [G2, 4] tensors: element 8*w + j of each 32-element chunk
        a4, b4 = tl.split(tl.reshape(av, (G2, 4, 4, 2)))  # j even / odd: [G2, 4, 4]
        a40, a42 = tl.split(tl.reshape(a4, (G2, 4, 2, 2)))  # j = 0,4 | 2,6 -> [G2, 4, 2]
        b41, b43 = tl.split(tl.reshape(b4, (G2, 4, 2, 2)))  # j = 1,5 | 3,7
        x0, x4 = tl.split(a40)
        x2, x6 = tl.split(a42)
        x1, x5 = tl.split(b41)
        x3, x7 = tl.split(b43)
        if USE_ASM:
            d0, d1, d2, d3, d4, d5, d6, d7 = word_nibbles_asm(q)
        else:
            d0 = word_nibble(q, 0)
            d1 = word_nibble(q, 4)
            d2 = word_nibble(q, 8)
            d3 = word_nibble(q, 12)
            d4 = word_nibble(q, 16)
            d5 = word_nibble(q, 20)
            d6 = word_nibble(q, 24)
            d7 = word_nibble(q, 28)
        part = d0 * x0[None, :, :]
        part += d1 * x1[None, :, :]
        part += d2 * x2[None, :, :]
        part += d3 * x3[None, :, :]
        part += d4 * x4[None, :, :]
        part += d5 * x5[None, :, :]
        part += d6 * x6[None, :, :]
        part += d7 * x7[None, :, :]  # [BN, G2, 4]: one word's 8 products
        grp = tl.sum(tl.reshape(part, (BN, G2, 2, 2)), axis=3)  # words (0,1) | (2,3) -> [BN, G2, 2]
        acc += grp * e4m3_f32(sb)

    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    wgs = tl.load(w_gs_ptr + rn)
    if A_MODE == 0:
        y = y * (16384.0 / wgs)
    else:
        y = y * (16384.0 / (tl.load(a_gs_ptr) * wgs))
    if HAS_KS:
        ys = wb0.to(tl.float32) * bf16_rne(xs0.to(tl.float32), INTERP).to(tl.float32)[None, :]
        for c0 in range(BLOCK_KS, KS, BLOCK_KS):
            cm = (c0 + offs_c) < KS
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
            xs = bf16_rne(tl.load(x_ptr + ch * stride_xk, mask=cm, other=0.0).to(tl.float32), INTERP).to(tl.float32)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0).to(tl.float32)
            ys += wb * xs[None, :]
        y += tl.sum(ys, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        y = bf16_rne(y, INTERP)
    tl.store(out_ptr + offs_n.to(tl.int64) * stride_on, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


# ---------------------------------------------------------------------------------------------
# prefill datapath, SS form: Y[BM, BN] += A[BM, BK] . deq(W)[BN, BK]^T with both MMA operands
# in shared memory (the decoded weight tile is stored once per K step and read by wgmma)
# ---------------------------------------------------------------------------------------------


def gemv_launch(cfg: GemvConfig, x: torch.Tensor, a: torch.Tensor | None, a_gs: torch.Tensor | None,
                pw: PreparedWeight, bias, out: torch.Tensor):
    """Run the GEMV on one row: ``a``/``a_gs`` = the fp16 ``q*s`` and global scale (W4A4) or None
    (W4A16: A = ``x``)."""
    if x.shape[0] != 1:
        raise ValueError(f"foursight.kernels: the GEMV form serves one row, got M = {x.shape[0]}")
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    dummy = pw.weight_global_scale
    words = pw._cache.get("words")
    if words is None:
        words = pw._cache["words"] = pw.weight_packed.view(torch.int32)
    return _splice_gemv1_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, x.stride(1),
        a if a is not None else dummy,
        a_gs if a_gs is not None else dummy,
        *weight_args(pw, bias, packed=words),
        out, out.stride(1),
        n, k_dim, kk,
        A_MODE=1 if a is not None else 0,
        HAS_BIAS=bias is not None, HAS_KS=kk > 0,
        BN=cfg.block_n, BK=cfg.block_k,
        BLOCK_KS=block_ks(kk, 256),
        USE_ASM=not interpreting(),
        INTERP=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def launch(cfg, ops, pw, bias, out, pdl: bool = False):
    """The form's launch in the kernel-form table's signature (:class:`~.forms.Operands` ``ops``)."""
    return gemv_launch(cfg, ops.x, ops.a if ops.a_quant else None, ops.a_gs, pw, bias, out)
