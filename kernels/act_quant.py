"""Fused NVFP4 activation quantization (Triton).

One program per row (or per ``ROWS`` rows) reads the row of ``X`` once (the whole row is held in
registers when ``K <= MAX_ONEPASS_K``), zeroes the BF16 channels ``S``, takes the 16-element block
amaxes and from them the row amax (dynamic global scale), rounds the block scales to E4M3, rounds
the elements to E2M1 and writes, as asked:

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
does that for a CPU-scalar divisor; ``DIV6_RECIP``), IEEE round-to-nearest division (``div_rn``,
not Triton's approximate ``/``) for ``eff = s / gs``, the operation orders ``gs * (amax / 6)`` and
``x / (s / gs)``, an explicit round-to-nearest-even to E4M3 done with integer arithmetic (so the
interpreter and the GPU agree), a zero scale replaced by 0.125, and E2M1 rounding with ties to even
and the sign of -0 kept.

Per element the work is: the load and conversion to fp32, the S select, one ``|x|`` max for the
block amax (the row amax is the max of the block amaxes), the IEEE ``div_rn(x, eff)``, and the
E2M1 rounding of :func:`_e2m1_round`: about 8 instructions for the code (two min/max, one AND, one
FMA, four integer ops), 3 more for ``deq``, then the nibble packing. There is no compare chain and
no ``tl.where`` chain: the code and the value come from one fp32 add that rounds onto the E2M1
grid. Per 16-element block: the E4M3 rounding (integer ops) and ``eff = sv / gs``.

Static count of the SASS (Triton 3.9 with its bundled ptxas, sm_90, K = 4096, 8 warps, 16 elements
per thread, main path, the division's slow-path calls not taken): about 34 instructions issued per
element writing ``packed`` (51 before this version) and 31 writing ``deq`` (68 before). About 10 of
them are the ``div_rn`` (MUFU.RCP, 5 FFMA, FCHK and the BSSY/BRA/BSYNC around its slow-path call):
ptxas does not hoist the reciprocal although the 16 elements of a thread share their divisor.

Why ``div_rn`` stays per element: a cheaper quotient ``x * RN(1/eff)`` is within 3 ulps of the
oracle's ``RN(x / eff)``, which gives the same code except within a few ulps of an E2M1 decision
point (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), and with bf16 activations and dynamic scales such
near-ties are common (``x/amax`` and ``2688/s`` are short fractions). On Gaussian bf16 rows
(K = 4096, per-channel spread) ``x * RN(1/eff)`` gives a different code for 0.013 % of the
elements (28 % of the rows), and 0.13 % of the elements (91 % of the rows) lie within 4 ulps of a
decision point: a per-program fallback to ``div_rn`` would run on most programs, and an exact
per-element tie-break (an FMA residual against the nearest decision point) costs about as much
as the division.

``ROWS`` > 1 (optional, trailing constexpr with the runtime row count ``M``) puts several rows in
one program ([ROWS, BLOCK_K] tiles, the S mask decoded once for all of them): for small K, where
one row leaves most of a 4-warp program idle and the per-row work (reductions, barrier, ``1/amax``)
dominates. Same static SASS count per element, 4 warps: K = 256 95 -> 40 (ROWS = 8), K = 512
60 -> 40 (ROWS = 4), K = 1024 44 -> 39 (ROWS = 2); at K = 2048 ROWS = 2 is slightly worse (34 -> 36).
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
def _e2m1_round(q):
    """Round fp32 ``q`` (any shape, any finite value) to E2M1 exactly as the oracle does.

    The oracle clamps to [-6, 6], rounds the magnitude to {0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties to
    even (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4) and keeps the sign bit (-0 and
    negative values that round to 0 give code 8).

    Returns ``(code, val)``: ``code`` int32 0..15 (sign in bit 3) and ``val`` fp32, the signed
    E2M1 value (``-0.0`` for code 8).

    How: on [0, 2), [2, 4) and [4, 6] the E2M1 grid step is ``g = 0.5, 1, 2``, i.e. ``g = ef / 2``
    with ``ef = 2^floor(log2(max(mag, 1)))`` = 1, 2, 4 (the exponent bits of ``max(mag, 1)``,
    ``mag = min(|q|, 6)``). ``M = ef * 2^22`` is a power of two whose fp32 ulp is exactly ``g``
    and ``mag + M < 2M``, so the IEEE sum ``t = mag + M`` is ``M + k*g`` with ``k*g`` the
    round-to-nearest-even of ``mag`` on that grid: ``M/g = 2^23`` is even, so the parity of ``k`` is
    the parity of the grid point, and ``k`` even <=> the E2M1 mantissa bit is 0, which is exactly
    the oracle's tie rule. ``k = bits(t) & 7`` (0..4) and ``bits(t) >> 22 = 298 + 2j`` for
    ``ef = 2^j``, so ``code = k + 2j`` (0..4 for 0..2, 4..6 for 2..4, 6..7 for 4, 6); adding ``2j``
    to ``k | sign`` never carries into the sign bit because ``k + 2j <= 7``. ``v = t - M`` is exact
    (both in [M, 2M)). The products ``ef * 2^22`` are exact, so contracting them into FMAs changes
    nothing. Every value involved is a normal number, so nothing depends on subnormal handling (a
    subnormal ``q`` gives code 0 or 8 whether or not it is flushed to a zero of the same sign).
    About 8 instructions for the code (2 min/max, 1 AND, 1 FMA, 4 integer) and 3 more for the
    value (FMA, OR of the sign, and the caller's multiply by the scale).
    """
    qb = q.to(tl.int32, bitcast=True)
    mag = tl.minimum(tl.abs(q), 6.0)
    ef = (tl.maximum(mag, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = mag + ef * 4194304.0  # RN onto the E2M1 grid of mag's binade (ties to even)
    tb = t.to(tl.int32, bitcast=True)
    code = ((tb & 7) | ((qb >> 28) & 8)) + ((tb >> 22) - 298)
    v = t - ef * 4194304.0  # exact: the rounded E2M1 magnitude
    val = (v.to(tl.int32, bitcast=True) | (qb & -2147483648)).to(tl.float32, bitcast=True)
    return code, val


@triton.jit
def _e2m1_code(q):
    """E2M1 code (int32, 0..15) of fp32 ``q``; clamps to [-6, 6], ties to even, -0 keeps its sign."""
    code, _val = _e2m1_round(q)
    return code


@triton.jit
def _e2m1_value(code):
    """fp32 E2M1 value of int32 ``code`` (sign in bit 3), built from the code's bits.

    The 4 code bits are exactly an fp16 number scaled by 2^-14 when put in fp16's sign, exponent
    and top mantissa bit (``(code & 7) << 9``, sign ``(code & 8) << 12``): code 1 is the fp16
    subnormal 2^-15. The fp16 -> fp32 conversion is exact for every fp16 value (subnormals included:
    the flush-to-zero mode of fp32 arithmetic does not apply to an fp16 source), so the result is
    exact; the final ``* 2^14`` is exact too. Callers multiplying by a scale can fold the 2^14
    into the scale instead.
    """
    return _e2m1_f16(code).to(tl.float32) * 16384.0


@triton.jit
def _e2m1_f16(code):
    """fp16 ``e2m1 * 2^-14`` of int32 E2M1 codes (0..15, sign in bit 3): the 3 magnitude bits go into
    fp16's exponent and top mantissa bit, the sign bit into fp16's sign (code 1 is the subnormal
    2^-15). Exact; the SpliceGEMM decoders use it too."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _block_scales(bamax, gs, DIV6_RECIP: tl.constexpr):
    """Per-block ``(sv fp32, scale byte int32, eff fp32 = sv / gs)`` from block amaxes (any shape;
    ``gs`` a scalar or broadcastable to ``bamax``)."""
    if DIV6_RECIP:
        # PyTorch on CUDA divides by a Python scalar as a multiplication by its fp32 reciprocal
        s = gs * (bamax * 0.16666666666666666)
    else:
        s = gs * tl.math.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32))
    s = tl.minimum(s, 448.0)
    sv, sbyte = _e4m3_round(s)
    eff = tl.math.div_rn(sv, tl.full(sv.shape, 1.0, tl.float32) * gs)
    return sv, sbyte, eff


@triton.jit
def _quant_elems(xb, sv, eff):
    """E2M1 codes and ``deq = q * s`` of the elements ``xb`` (blocks of 16 on the last axis) given
    their block's ``sv`` and ``eff`` (same rank, last dim 1). Returns ``(code int32, deq fp32)``
    shaped like ``xb``, with ``code = e2m1(clamp(x / eff, -6, 6))`` exactly as the oracle.

    The division stays an IEEE round-to-nearest ``div_rn`` per element: the codes depend on the
    exact rounding of ``x / eff`` (with bf16 activations and dynamic scales about 0.13 % of the
    elements land within 4 ulps of an E2M1 decision point, so an approximate quotient would need
    the exact one there anyway; see the module notes).
    """
    q = tl.math.div_rn(xb, eff)
    code, val = _e2m1_round(q)
    return code, val * sv


@triton.jit
def _quant_xb(xb, bamax, gs, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """:func:`_quant_block` on ``xb`` = x reshaped [BLOCK/16, 16] with its block amaxes [BLOCK/16]."""
    sv, sbyte, eff = _block_scales(bamax, gs, DIV6_RECIP)
    code, deq = _quant_elems(xb, sv[:, None], eff[:, None])
    lo, hi = tl.split(tl.reshape(code, (BLOCK // 2, 2)))
    packed = lo | (hi << 4)
    return packed, sbyte, tl.reshape(deq, (BLOCK,))


@triton.jit
def _quant_block(x, gs, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """Quantize a [BLOCK] fp32 chunk (S already zeroed) with global scale ``gs`` (fp32 scalar).

    Returns (packed bytes [BLOCK/2] int32, scale bytes [BLOCK/16] int32, deq [BLOCK] fp32 = q*s).
    """
    xb = tl.reshape(x, (BLOCK // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=1)
    return _quant_xb(xb, bamax, gs, BLOCK, DIV6_RECIP)


@triton.jit
def _quant_xb_2d(xb, bamax, gs, R: tl.constexpr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """:func:`_quant_block_2d` on ``xb`` [R, BLOCK/16, 16] with its block amaxes [R, BLOCK/16]."""
    sv, sbyte, eff = _block_scales(bamax, gs[:, None], DIV6_RECIP)
    code, deq = _quant_elems(xb, sv[:, :, None], eff[:, :, None])
    lo, hi = tl.split(tl.reshape(code, (R, BLOCK // 2, 2)))
    packed = lo | (hi << 4)
    return packed, sbyte, tl.reshape(deq, (R, BLOCK))


@triton.jit
def _quant_block_2d(x, gs, R: tl.constexpr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """Quantize R rows at once: ``x`` fp32 [R, BLOCK] (S already zeroed), ``gs`` fp32 [R].

    Returns (packed bytes [R, BLOCK/2] int32, scale bytes [R, BLOCK/16] int32, deq [R, BLOCK] fp32).
    """
    xb = tl.reshape(x, (R, BLOCK // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    return _quant_xb_2d(xb, bamax, gs, R, BLOCK, DIV6_RECIP)


@triton.jit
def _global_scale(amax):
    """``448*6 / amax`` as PyTorch computes it (``2688 * (1/amax)``), 1.0 where it overflows."""
    amax = tl.maximum(amax, 1.1754943508222875e-38)
    gs = 2688.0 * tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax)
    return tl.where(gs == float("inf"), 1.0, gs)


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
    M=0,  # number of rows; only read when ROWS > 1 (then pass it, and launch cdiv(M, ROWS) programs)
    ROWS: tl.constexpr = 1,  # rows per program (a power of two)
):
    if ROWS == 1:
        _act_quant_row(
            x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
            gs_out_ptr, xs_ptr, K, KS, BLOCK_K, ONE_PASS, HAS_CH, STATIC_GS, WRITE_PACKED, WRITE_DEQ,
            WRITE_XS, BLOCK_KS, DIV6_RECIP,
        )
    else:
        _act_quant_rows(
            x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
            gs_out_ptr, xs_ptr, K, KS, M, BLOCK_K, ONE_PASS, HAS_CH, STATIC_GS, WRITE_PACKED, WRITE_DEQ,
            WRITE_XS, BLOCK_KS, DIV6_RECIP, ROWS,
        )


@triton.jit
def _act_quant_row(
    x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
    gs_out_ptr, xs_ptr, K, KS,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HAS_CH: tl.constexpr, STATIC_GS: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_XS: tl.constexpr, BLOCK_KS: tl.constexpr,
    DIV6_RECIP: tl.constexpr,
):
    """One row per program (``ROWS == 1``)."""
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
        xb = tl.reshape(x, (BLOCK_K // 16, 16))
        bamax = tl.max(tl.abs(xb), axis=1)
        if not STATIC_GS:
            gs = _global_scale(tl.max(bamax, axis=0))
        packed, sbyte, deq = _quant_xb(xb, bamax, gs, BLOCK_K, DIV6_RECIP)
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
            gs = _global_scale(tl.max(amax_v, axis=0))
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


@triton.jit
def _rows_load(x_rows, stride_xk, smask_ptr, k0, K, rmask, offs, HAS_CH: tl.constexpr):
    """[ROWS, BLOCK_K] fp32 tile of X at columns ``k0 + offs`` with the S columns zeroed."""
    kmask = (k0 + offs) < K
    x = tl.load(x_rows + (k0 + offs)[None, :] * stride_xk, mask=rmask[:, None] & kmask[None, :], other=0.0)
    x = x.to(tl.float32)
    if HAS_CH:
        sm = tl.load(smask_ptr + k0 + offs, mask=kmask, other=0)
        x = tl.where((sm != 0)[None, :], 0.0, x)
    return x


@triton.jit
def _rows_quant_store(
    xb, bamax, gs, rows64, rmask, k0, K, packed_ptr, scale_ptr, deq_ptr,
    BLOCK_K: tl.constexpr, WRITE_PACKED: tl.constexpr, WRITE_DEQ: tl.constexpr, DIV6_RECIP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Quantize the tile ``xb`` [ROWS, BLOCK_K/16, 16] (columns ``k0 ...``, block amaxes ``bamax``)
    with per-row ``gs`` and store it."""
    packed, sbyte, deq = _quant_xb_2d(xb, bamax, gs, ROWS, BLOCK_K, DIV6_RECIP)
    if WRITE_PACKED:
        offs_p = tl.arange(0, BLOCK_K // 2)
        pm = rmask[:, None] & ((k0 // 2 + offs_p) < K // 2)[None, :]
        tl.store(packed_ptr + rows64[:, None] * (K // 2) + k0 // 2 + offs_p[None, :], packed.to(tl.uint8), mask=pm)
        offs_s = tl.arange(0, BLOCK_K // 16)
        smk = rmask[:, None] & ((k0 // 16 + offs_s) < K // 16)[None, :]
        tl.store(scale_ptr + rows64[:, None] * (K // 16) + k0 // 16 + offs_s[None, :], sbyte.to(tl.uint8), mask=smk)
    if WRITE_DEQ:
        offs = tl.arange(0, BLOCK_K)
        dm = rmask[:, None] & ((k0 + offs) < K)[None, :]
        tl.store(deq_ptr + rows64[:, None] * K + k0 + offs[None, :], deq.to(tl.float16), mask=dm)


@triton.jit
def _act_quant_rows(
    x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
    gs_out_ptr, xs_ptr, K, KS, M,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HAS_CH: tl.constexpr, STATIC_GS: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_XS: tl.constexpr, BLOCK_KS: tl.constexpr,
    DIV6_RECIP: tl.constexpr, ROWS: tl.constexpr,
):
    """``ROWS`` rows per program ([ROWS, BLOCK_K] tiles; the S mask is decoded once for all rows).

    Rows at or past ``M`` are loaded as zeros and not stored.
    """
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_xm  # [ROWS, 1]
    offs = tl.arange(0, BLOCK_K)
    if STATIC_GS:
        gs = tl.full((ROWS,), 1.0, tl.float32) * tl.load(gs_in_ptr)
    if ONE_PASS:
        x = _rows_load(x_rows, stride_xk, smask_ptr, 0, K, rmask, offs, HAS_CH)
        xb = tl.reshape(x, (ROWS, BLOCK_K // 16, 16))
        bamax = tl.max(tl.abs(xb), axis=2)
        if not STATIC_GS:
            gs = _global_scale(tl.max(bamax, axis=1))
        _rows_quant_store(xb, bamax, gs, rows64, rmask, 0, K, packed_ptr, scale_ptr, deq_ptr,
                          BLOCK_K, WRITE_PACKED, WRITE_DEQ, DIV6_RECIP, ROWS)
    else:
        if not STATIC_GS:
            amax_v = tl.zeros((ROWS, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = _rows_load(x_rows, stride_xk, smask_ptr, k0, K, rmask, offs, HAS_CH)
                amax_v = tl.maximum(amax_v, tl.abs(x))
            gs = _global_scale(tl.max(amax_v, axis=1))
        for k0 in range(0, K, BLOCK_K):
            x = _rows_load(x_rows, stride_xk, smask_ptr, k0, K, rmask, offs, HAS_CH)
            xb = tl.reshape(x, (ROWS, BLOCK_K // 16, 16))
            _rows_quant_store(xb, tl.max(tl.abs(xb), axis=2), gs, rows64, rmask, k0, K, packed_ptr, scale_ptr, deq_ptr,
                              BLOCK_K, WRITE_PACKED, WRITE_DEQ, DIV6_RECIP, ROWS)
    tl.store(gs_out_ptr + rows64, gs, mask=rmask)
    if WRITE_XS:
        offs_c = tl.arange(0, BLOCK_KS)
        for c0 in range(0, KS, BLOCK_KS):
            cmask = (c0 + offs_c) < KS
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cmask, other=0)
            cm2 = rmask[:, None] & cmask[None, :]
            xv = tl.load(x_rows + ch.to(tl.int64)[None, :] * stride_xk, mask=cm2, other=0.0)
            tl.store(xs_ptr + rows64[:, None] * KS + c0 + offs_c[None, :], xv, mask=cm2)
