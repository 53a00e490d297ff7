"""Shared ``@triton.jit`` NVFP4 primitives of the FourSight kernels: one home for the numerics.

One subject: the device-side building blocks every kernel form shares (and the constants they read);
the runtime facts in Python (interpreter, PDL, occupancy) are :mod:`.runtime`.

* **Decoding** (exact): E2M1 codes to fp16 ``e2m1 · 2^-14`` (:func:`_e2m1_f16`, code 1 is an fp16
  subnormal), E4M3 scale bytes to fp16/fp32 (:func:`_e4m3_f16`, :func:`e4m3_f32`), whole packed
  tiles (:func:`fp4_tile`) and 32-bit words of 8 codes (:func:`word_nibbles_asm` in PTX, with its
  portable twin :func:`word_nibble` for the interpreter).
* **Quantization** (bit-exact with :func:`foursight.layer.quantize_activation`, i.e. with
  compressed-tensors): E4M3 rounding (:func:`e4m3_round`), E2M1 rounding (:func:`e2m1_round`),
  block scales and element codes (:func:`block_scales`, :func:`quant_elems`, :func:`quant_block`
  and its 2-D form), the dynamic global scale (:func:`global_scale`).
* **Plumbing**: the MMA wrapper (:func:`mma`), BF16 round-to-nearest-even that the interpreter
  honours (:func:`rne_bf16`, :func:`bf16_rne`), the grouped tile order (:func:`tile_ids`), the L2
  prefetch (:func:`prefetch_l2`).

The tile steps the GEMM forms share, built on these, are :mod:`.tile_steps`.

Every kernel form (one file each: :mod:`.act_quant`, :mod:`.fragment`, :mod:`.gemv`, :mod:`.swap`,
:mod:`.ss`, :mod:`.dequant`) builds on these; the PyTorch references are in :mod:`foursight.layer` and
:mod:`foursight.nvfp4`. Why each primitive is written the way it is (instruction counts, the
interpreter's conversion quirks) is in docs/kernels.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Rows up to this many elements are quantized from registers in a single read of X.
MAX_ONEPASS_K: int = 16384
#: Match PyTorch-on-CUDA's ``tensor / 6.0`` (multiplication by fp32(1/6)) in the block scales, so
#: that the kernel is bit-exact with foursight.layer run on the same CUDA device.
DIV6_RECIP_ON_CUDA: bool = True


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------


@triton.jit
def _e2m1_f16(code):
    """fp16 ``e2m1 * 2^-14`` of int32 E2M1 codes (0..15, sign in bit 3): the 3 magnitude bits go into
    fp16's exponent and top mantissa bit, the sign bit into fp16's sign (code 1 is the subnormal
    2^-15). Exact; the SpliceGEMM decoders use it too."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _e4m3_f16(sb):
    """fp16 value of non-negative E4M3 bytes ``sb`` (int32): the byte shifted into fp16's exponent and
    mantissa fields is the value times 2^-8 (subnormals included), so one exact multiply by 256."""
    return ((sb << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)


@triton.jit
def e4m3_f32(sb):
    """fp32 value of non-negative E4M3 bytes ``sb`` (int32), decoded through fp16 (exact)."""
    return _e4m3_f16(sb).to(tl.float32)


@triton.jit
def _e2m1_f16_pair(p):
    """Decode the two E2M1 codes of each packed byte.

    Args:
        p: int32 tensor of packed bytes (low nibble = even column).
    Returns:
        (lo, hi) float32 tensors of p's shape holding ``e2m1 * 2^-14`` exactly (the 3 magnitude bits
        go into fp16's exponent/mantissa fields, code 1 becomes an fp16 subnormal; the fp16 -> fp32
        conversion is exact).
    """
    return _e2m1_f16(p & 15).to(tl.float32), _e2m1_f16(p >> 4).to(tl.float32)


@triton.jit
def fp4_tile(p, sb, R: tl.constexpr, BK: tl.constexpr):
    """Decode an NVFP4 tile.

    Args:
        p: int32 [R, BK/16, 8] packed bytes (low nibble = even column).
        sb: int32 [R, BK/16] E4M3 scale bytes (non-negative scales).
    Returns:
        fp16 [R, BK] holding ``e2m1 * scale * 2^-14`` exactly.
    """
    s16 = _e4m3_f16(sb)
    lo = (((p << 9) & 0x0E00) | ((p << 12) & 0x8000)).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((p << 5) & 0x0E00) | ((p << 8) & 0x8000)).to(tl.int16).to(tl.float16, bitcast=True)
    v = tl.interleave(lo, hi)  # [R, BK/16, 16]
    v = (v * s16[:, :, None]).to(tl.float16)
    return tl.reshape(v, (R, BK))


@triton.jit
def word_nibbles_asm(q):
    """The 8 E2M1 codes of each int32 word ``q`` (4 packed bytes) as fp32 ``e2m1 * 2^-14``, in PTX.

    Output k (0..7) is element k of the word (byte k // 2, low nibble for even k). Four fp16x2
    words are built with two shifts and two logic ops each, straight from the packed word (no
    byte unpacking), then converted exactly to fp32 (code 1 is an fp16 subnormal).
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, t2, t3, s0, s1, s2, s3, h0, h1, h2, h3;
        .reg .b16 l0, l1, l2, l3, u0, u1, u2, u3;
        shl.b32 t0, $8, 9;
        and.b32 t0, t0, 0x0E000E00;
        shl.b32 s0, $8, 12;
        and.b32 s0, s0, 0x80008000;
        or.b32 h0, t0, s0;
        shl.b32 t1, $8, 1;
        and.b32 t1, t1, 0x0E000E00;
        shl.b32 s1, $8, 4;
        and.b32 s1, s1, 0x80008000;
        or.b32 h1, t1, s1;
        shl.b32 t2, $8, 5;
        and.b32 t2, t2, 0x0E000E00;
        shl.b32 s2, $8, 8;
        and.b32 s2, s2, 0x80008000;
        or.b32 h2, t2, s2;
        shr.b32 t3, $8, 3;
        and.b32 t3, t3, 0x0E000E00;
        and.b32 s3, $8, 0x80008000;
        or.b32 h3, t3, s3;
        mov.b32 {l0, u0}, h0;
        mov.b32 {l1, u1}, h1;
        mov.b32 {l2, u2}, h2;
        mov.b32 {l3, u3}, h3;
        cvt.f32.f16 $0, l0;
        cvt.f32.f16 $1, l2;
        cvt.f32.f16 $2, l1;
        cvt.f32.f16 $3, l3;
        cvt.f32.f16 $4, u0;
        cvt.f32.f16 $5, u2;
        cvt.f32.f16 $6, u1;
        cvt.f32.f16 $7, u3;
        }
        """,
        constraints="=f,=f,=f,=f,=f,=f,=f,=f,r",
        args=[q],
        dtype=(tl.float32,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def word_nibble(q, SHIFT: tl.constexpr):
    """fp32 ``e2m1 * 2^-14`` of the nibble at bit ``SHIFT`` of int32 words ``q`` (portable twin of
    :func:`word_nibbles_asm`, used by the interpreter)."""
    return _e2m1_f16((q >> SHIFT) & 15).to(tl.float32)

# ---------------------------------------------------------------------------------------------
# quantization
# ---------------------------------------------------------------------------------------------


@triton.jit
def e4m3_round(s):
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
def e2m1_round(q):
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
def e2m1_code(q):
    """E2M1 code (int32, 0..15) of fp32 ``q``; clamps to [-6, 6], ties to even, -0 keeps its sign."""
    code, _val = e2m1_round(q)
    return code


@triton.jit
def e2m1_value(code):
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
def block_scales(bamax, gs, DIV6_RECIP: tl.constexpr):
    """Per-block ``(sv fp32, scale byte int32, eff fp32 = sv / gs, effp, y, p)`` from block amaxes
    (any shape; ``gs`` a scalar or broadcastable to ``bamax``).

    ``effp = eff · p`` and ``y = RN(1 / effp)`` feed :func:`quant_elems`' reciprocal multiply;
    ``p`` is a power of two (2^64, 1 or 2^-64) that keeps ``effp`` and ``y`` normal numbers, so that
    ``x / eff = (x · p) / effp`` as real numbers (the scaling is exact) and the correction steps
    there stay exact."""
    if DIV6_RECIP:
        # PyTorch on CUDA divides by a Python scalar as a multiplication by its fp32 reciprocal
        s = gs * (bamax * 0.16666666666666666)
    else:
        s = gs * tl.math.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32))
    s = tl.minimum(s, 448.0)
    sv, sbyte = e4m3_round(s)
    eff = tl.math.div_rn(sv, tl.full(sv.shape, 1.0, tl.float32) * gs)
    # < 2^-60: times 2^64; > 2^60: times 2^-64
    p = tl.where(eff < 8.673617379884035e-19, 1.8446744073709552e19,
                 tl.where(eff > 1.152921504606847e18, 5.421010862427522e-20, 1.0))
    effp = eff * p
    y = tl.math.div_rn(tl.full(sv.shape, 1.0, tl.float32), effp)
    return sv, sbyte, eff, effp, y, p


@triton.jit
def quant_elems(xb, sv, effp, y, p):
    """E2M1 codes and ``deq = q * s`` of the elements ``xb`` (blocks of 16 on the last axis) given
    their block's ``sv``, ``effp``, ``y`` and ``p`` (:func:`block_scales`; same rank, last dim 1).
    Returns ``(code int32, deq fp32)`` shaped like ``xb``, with ``code = e2m1(clamp(x / eff, -6, 6))``
    exactly as the oracle, whose ``x / eff`` is an IEEE round-to-nearest division.

    No per-element division: ``q0 = RN(x' · y)`` (``x' = x · p``, ``y = RN(1 / effp)``) is within
    1.5 ulp of the quotient, so its E2M1 code can differ from the oracle's only next to an E2M1
    decision point (0.25, 0.75, ..., 5) or at a tie. Two Newton-Markstein steps
    ``q ← RN(q + RN(x' − q · effp) · y)`` (two FMAs each; the residual is exact) make ``q`` the
    correctly rounded quotient everywhere, so the decision points need no separate test: the first
    step brings ``q`` within half an ulp plus O(2^-46) (a faithful rounding), and from a faithful
    ``q`` and ``y = RN(1 / effp)`` one more step gives ``RN(x' / effp)`` (Markstein's theorem; it needs
    no underflow or overflow, which the power-of-two ``p`` ensures for every ``|q| >= 2^-100``; below
    that any such value gives code 0 or 8, and the sign is taken from ``x``). Five floating-point
    instructions per element instead of IEEE division's fast path (about ten, with its range check
    and slow-path call). Tested bit-exact against the oracle at and next to every decision point and
    tie, at subnormal scales and inputs, and on random data (tests/test_kernels_actq.py).
    """
    xp = xb * p
    q0 = xp * y
    q = tl.fma(tl.fma(-q0, effp, xp), y, q0)
    q = tl.fma(tl.fma(-q, effp, xp), y, q)
    q = tl.where(q == q, q, q0)  # x' overflowed (a static scale far off): inf - inf; the quotient clamps to 6
    # the sign of -0 and of quotients that underflow follows x (the oracle's x / eff has x's sign)
    q = ((q.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | (xb.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    code, val = e2m1_round(q)
    return code, val * sv


@triton.jit
def quant_xb(xb, bamax, gs, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """:func:`quant_block` on ``xb`` = x reshaped [BLOCK/16, 16] with its block amaxes [BLOCK/16]."""
    sv, sbyte, _eff, effp, y, p = block_scales(bamax, gs, DIV6_RECIP)
    code, deq = quant_elems(xb, sv[:, None], effp[:, None], y[:, None], p[:, None])
    lo, hi = tl.split(tl.reshape(code, (BLOCK // 2, 2)))
    packed = lo | (hi << 4)
    return packed, sbyte, tl.reshape(deq, (BLOCK,))


@triton.jit
def quant_block(x, gs, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """Quantize a [BLOCK] fp32 chunk (S already zeroed) with global scale ``gs`` (fp32 scalar).

    Returns (packed bytes [BLOCK/2] int32, scale bytes [BLOCK/16] int32, deq [BLOCK] fp32 = q*s).
    """
    xb = tl.reshape(x, (BLOCK // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=1)
    return quant_xb(xb, bamax, gs, BLOCK, DIV6_RECIP)


@triton.jit
def quant_xb_2d(xb, bamax, gs, R: tl.constexpr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """:func:`quant_block_2d` on ``xb`` [R, BLOCK/16, 16] with its block amaxes [R, BLOCK/16]."""
    sv, sbyte, _eff, effp, y, p = block_scales(bamax, gs[:, None], DIV6_RECIP)
    code, deq = quant_elems(xb, sv[:, :, None], effp[:, :, None], y[:, :, None], p[:, :, None])
    lo, hi = tl.split(tl.reshape(code, (R, BLOCK // 2, 2)))
    packed = lo | (hi << 4)
    return packed, sbyte, tl.reshape(deq, (R, BLOCK))


@triton.jit
def quant_block_2d(x, gs, R: tl.constexpr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """Quantize R rows at once: ``x`` fp32 [R, BLOCK] (S already zeroed), ``gs`` fp32 [R].

    Returns (packed bytes [R, BLOCK/2] int32, scale bytes [R, BLOCK/16] int32, deq [R, BLOCK] fp32).
    """
    xb = tl.reshape(x, (R, BLOCK // 16, 16))
    bamax = tl.max(tl.abs(xb), axis=2)
    return quant_xb_2d(xb, bamax, gs, R, BLOCK, DIV6_RECIP)


@triton.jit
def global_scale(amax):
    """``448*6 / amax`` as PyTorch computes it (``2688 * (1/amax)``), 1.0 where it overflows."""
    amax = tl.maximum(amax, 1.1754943508222875e-38)
    gs = 2688.0 * tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), amax)
    return tl.where(gs == float("inf"), 1.0, gs)

# ---------------------------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------------------------


@triton.jit
def prefetch_l2(ptrs):
    """``prefetch.global.L2`` of the lines at ``ptrs`` (not under the interpreter)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation. Triton's CPU interpreter multiplies bf16 operands as
    raw integers (triton 3.9), so under the interpreter the (exact) operands are widened to fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def rne_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value (ties to even), returned as fp32 (finite ``x``), so
    that the following ``.to(tl.bfloat16)`` is exact: Triton's interpreter truncates in that
    conversion, the GPU rounds; with this both give the same bits."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne(x, INTERP: tl.constexpr):
    """Round fp32 ``x`` to bf16 (nearest, ties to even). Triton's interpreter (3.9) truncates in
    ``.to(tl.bfloat16)``, so there the rounding is done on the bits (finite inputs) and the result
    is returned as the fp32 value; on the GPU the native conversion is used."""
    if INTERP:
        return rne_bf16(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in the grouped order of Triton's matmul tutorial: GROUP_M
    M-tiles walk the N-tiles together, so their weight tiles are reused from L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % gsize, (pid % per_group) // gsize
