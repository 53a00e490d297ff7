"""Fused NVFP4 activation quantization (Triton).

One program per row reads the row of ``X`` once (the whole row is held in registers when
``K <= MAX_ONEPASS_K``), zeroes the BF16 channels ``S``, takes the row amax (dynamic global
scale) and the 16-element block amaxes, rounds the block scales to E4M3, rounds the elements to
E2M1 and writes, as asked:

* ``packed`` uint8 [M, K/2] and ``scale`` E4M3 [M, K/16] (the :class:`QuantizedActivation` form),
* ``deq`` float16 [M, K] = ``q * s`` (the exact dequantized value *without* the global scale;
  E2M1 x E4M3 products have at most 6 significant bits and lie in [2^-10, 2688], so they are
  exact in fp16 and bf16) — the prefill GEMM reads this instead of re-decoding A in every
  output tile,
* ``gs`` float32 [M] (the per-row global scale, or the static one broadcast),
* ``x_bf16`` [M, k] = ``X[:, S]`` in the input dtype.

Bit-exactness with :func:`foursight.layer.quantize_activation` (compressed-tensors'
convention) *on the same device* rests on: ``448*6/amax`` computed as ``2688 * (1/amax)`` (PyTorch
evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``), ``block_amax / 6`` as a true
division on CPU but as a multiplication by ``fp32(1/6)`` on CUDA (ATen's ``div_true_kernel_cuda``
does that for a CPU-scalar divisor; ``DIV6_RECIP``), IEEE round-to-nearest division (``div_rn``, not Triton's approximate
``/``), the operation orders ``gs * (amax / 6)`` and ``x / (s / gs)``, an explicit
round-to-nearest-even to E4M3 done with integer arithmetic (so the interpreter and the GPU agree),
a zero scale replaced by 0.125, and E2M1 rounding with ties to even and the sign of -0 kept.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Rows up to this many elements are quantized from registers in a single read of X.
MAX_ONEPASS_K: int = 16384


@triton.jit
def _e4m3_round(s):
    """Round non-negative fp32 ``s`` (<= 448) to the nearest E4M3 value, ties to even.

    Returns ``(value_fp32, byte_int32)``; a value of 0 is replaced by 0.125 (byte 0x20).
    """
    bits = s.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits, round half to even on the integer representation
    rn = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    s_norm = rn.to(tl.float32, bitcast=True)
    # subnormal range (< 2^-6): multiples of 2^-9; adding 2^14 rounds to that grid (RNE)
    s_sub = (s + 16384.0) - 16384.0
    is_sub = s < 0.015625
    v = tl.where(is_sub, s_sub, s_norm)
    v = tl.where(v == 0.0, 0.125, v)
    vb = v.to(tl.int32, bitcast=True)
    byte_norm = ((((vb >> 23) & 0xFF) - 120) << 3) | ((vb >> 20) & 7)
    byte_sub = (v * 512.0).to(tl.int32)
    byte = tl.where(v < 0.015625, byte_sub, byte_norm)
    return v, byte


@triton.jit
def _e2m1_code(q):
    """E2M1 code (int32, 0..15) of fp32 ``q`` already clamped to [-6, 6]; ties to even, -0 keeps its sign."""
    mag = tl.abs(q)
    idx = (
        (mag > 0.25).to(tl.int32)
        + (mag >= 0.75).to(tl.int32)
        + (mag > 1.25).to(tl.int32)
        + (mag >= 1.75).to(tl.int32)
        + (mag > 2.5).to(tl.int32)
        + (mag >= 3.5).to(tl.int32)
        + (mag > 5.0).to(tl.int32)
    )
    sign = (q.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 3
    return idx | sign


@triton.jit
def _e2m1_value(code):
    """fp32 E2M1 value of int32 ``code`` (sign in bit 3)."""
    m3 = code & 7
    e = m3 >> 1
    mant = (m3 & 1).to(tl.float32)
    base = 1.0 + 0.5 * mant
    mag = tl.where(e == 0, mant * 0.5, tl.where(e == 1, base, tl.where(e == 2, 2.0 * base, 4.0 * base)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _quant_block(x, gs, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """Quantize a [BLOCK] fp32 chunk (S already zeroed) with global scale ``gs``.

    Returns (packed bytes [BLOCK/2] int32, scale bytes [BLOCK/16] int32, deq [BLOCK] fp32 = q*s).
    """
    xb = tl.reshape(x, (BLOCK // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=1)
    if DIV6_RECIP:
        # PyTorch on CUDA divides by a Python scalar as a multiplication by its fp32 reciprocal
        s = gs * (bamax * 0.16666666666666666)
    else:
        s = gs * tl.math.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32))
    s = tl.minimum(s, 448.0)
    sv, sbyte = _e4m3_round(s)
    eff = tl.math.div_rn(sv, tl.full(sv.shape, 1.0, tl.float32) * gs)
    q = tl.math.div_rn(xb, eff[:, None])
    q = tl.minimum(tl.maximum(q, -6.0), 6.0)
    code = _e2m1_code(q)
    deq = _e2m1_value(code) * sv[:, None]
    pair = tl.reshape(code, (BLOCK // 2, 2))
    lo, hi = tl.split(pair)
    packed = lo | (hi << 4)
    return packed, sbyte, tl.reshape(deq, (BLOCK,))


@triton.jit
def _act_quant_kernel(
    x_ptr, stride_xm, stride_xk,
    smask_ptr,  # uint8 [K]: 1 for columns in S
    ch_ptr,  # int32 [KS]
    gs_in_ptr,  # fp32 [1] static global scale (used when STATIC_GS)
    packed_ptr, scale_ptr,  # uint8 [M, K/2], uint8 [M, K/16] (contiguous)
    deq_ptr,  # fp16 [M, K] (contiguous)
    gs_out_ptr,  # fp32 [M]
    xs_ptr,  # [M, KS] input dtype (contiguous)
    K, KS,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HAS_CH: tl.constexpr,
    STATIC_GS: tl.constexpr,
    WRITE_PACKED: tl.constexpr,
    WRITE_DEQ: tl.constexpr,
    WRITE_XS: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    DIV6_RECIP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if STATIC_GS:
        gs = tl.load(gs_in_ptr)
    if ONE_PASS:
        kmask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=kmask, other=0.0).to(tl.float32)
        if HAS_CH:
            sm = tl.load(smask_ptr + offs, mask=kmask, other=0)
            x = tl.where(sm != 0, 0.0, x)
        if not STATIC_GS:
            amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1.1754943508222875e-38)
            gs = 2688.0 * tl.math.div_rn(tl.full((), 1.0, tl.float32), amax)
            gs = tl.where(gs == float("inf"), 1.0, gs)
        packed, sbyte, deq = _quant_block(x, gs, BLOCK_K, DIV6_RECIP)
        if WRITE_PACKED:
            offs_p = tl.arange(0, BLOCK_K // 2)
            tl.store(packed_ptr + row * (K // 2) + offs_p, packed.to(tl.uint8), mask=offs_p < K // 2)
            offs_s = tl.arange(0, BLOCK_K // 16)
            tl.store(scale_ptr + row * (K // 16) + offs_s, sbyte.to(tl.uint8), mask=offs_s < K // 16)
        if WRITE_DEQ:
            tl.store(deq_ptr + row * K + offs, deq.to(tl.float16), mask=kmask)
    else:
        if not STATIC_GS:
            amax_v = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kmask = (k0 + offs) < K
                x = tl.load(x_row + (k0 + offs) * stride_xk, mask=kmask, other=0.0).to(tl.float32)
                if HAS_CH:
                    sm = tl.load(smask_ptr + k0 + offs, mask=kmask, other=0)
                    x = tl.where(sm != 0, 0.0, x)
                amax_v = tl.maximum(amax_v, tl.abs(x))
            amax = tl.maximum(tl.max(amax_v, axis=0), 1.1754943508222875e-38)
            gs = 2688.0 * tl.math.div_rn(tl.full((), 1.0, tl.float32), amax)
            gs = tl.where(gs == float("inf"), 1.0, gs)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + offs) < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=kmask, other=0.0).to(tl.float32)
            if HAS_CH:
                sm = tl.load(smask_ptr + k0 + offs, mask=kmask, other=0)
                x = tl.where(sm != 0, 0.0, x)
            packed, sbyte, deq = _quant_block(x, gs, BLOCK_K, DIV6_RECIP)
            if WRITE_PACKED:
                offs_p = tl.arange(0, BLOCK_K // 2)
                tl.store(packed_ptr + row * (K // 2) + k0 // 2 + offs_p, packed.to(tl.uint8), mask=(k0 // 2 + offs_p) < K // 2)
                offs_s = tl.arange(0, BLOCK_K // 16)
                tl.store(scale_ptr + row * (K // 16) + k0 // 16 + offs_s, sbyte.to(tl.uint8), mask=(k0 // 16 + offs_s) < K // 16)
            if WRITE_DEQ:
                tl.store(deq_ptr + row * K + k0 + offs, deq.to(tl.float16), mask=kmask)
    tl.store(gs_out_ptr + row, gs)
    if WRITE_XS:
        offs_c = tl.arange(0, BLOCK_KS)
        for c0 in range(0, KS, BLOCK_KS):
            cmask = (c0 + offs_c) < KS
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cmask, other=0)
            xv = tl.load(x_row + ch.to(tl.int64) * stride_xk, mask=cmask, other=0.0)
            tl.store(xs_ptr + row * KS + c0 + offs_c, xv, mask=cmask)
