"""Kernel form: the fragment-layout swap-AB SpliceGEMM tile (``_fragment_gemm_kernel``), the decode
datapath for BF16 activations. Reference: :func:`foursight.layer.reference_linear`.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``, computed as ``Yᵀ[BN, BM]`` with the
decoded weight as the register operand of ``wgmma`` (swap-AB, tokens on the narrow side).

Why this form exists: in the plain swap form the weight is decoded in the layout the load chose and
then moved through shared memory into the wgmma fragment layout; that conversion costs more than
the decode. Here the weight's execution form (:func:`fragment_weight`, built once, offline) puts
every thread's codes where its fragment needs them, so the decoded tile *is* the fragment:

* **Rows.** The tile is loaded as ``[BN, 64]`` bytes per 128 columns; the load's natural layout puts
  rows ``lane/4 + 8·warp + 32·r``, wgmma wants ``lane/4 + 8·a + 16·warp + 64·r``. A reshape/permute
  of the row index (``_FRAG_ROWS``) maps one onto the other, so it is a register relabel; the
  offline form stores each 64-row block's rows in the matching order.
* **Columns.** A thread loads 16 contiguous bytes (one 128-bit load) = its 32 fragment values of one
  row over 128 columns. Each 32-bit word decodes in PTX to four bf16x2 registers
  (:func:`_decode_word_asm`: three are one shift and one AND each, the fourth five operations) whose
  pairs are consecutive columns, as wgmma's register operand wants them; a bit permutation of the
  column index (``_FRAG_COLS``) names which columns they are.
* **Numbers.** A code is stored as bf16 bits (sign at 15, exponent/mantissa at 8..6) so the decoded
  value is ``e2m1 · 2^-126`` exactly (code 1 is a bf16 subnormal); the E4M3 block scale is stored
  re-encoded as an unsigned E5M3 byte whose bf16 bits are ``byte·16 + 224·128`` = ``scale · 2^119``
  (exact, E4M3 subnormals included); their bf16 product ``e2m1 · scale · 2^-7`` is exact (at most 6
  significant bits, far from bf16's range limits). The activation operand is the exact bf16
  ``q · s`` of :mod:`.act_quant` (W4A4) or X itself (W4A16); the global scales and the ``2^7`` are
  applied once to the fp32 accumulator, then the BF16 channel segment is added into it, then the
  bias: the reference's order.

The interpreter cannot run PTX: there the word decode is its portable twin (:func:`_decode_word_ref`),
the same bits with Triton integer ops, and the layout chain is the same reshapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foursight.nvfp4 import BLOCK_SIZE

from .primitives import (
    bf16_rne,
    mma,
    prefetch_l2,
    quant_xb_2d,
    tile_ids,
    interpreting,
    resident_programs,
)

#: Rows of one stored block (one wgmma M=64 tile of 4 warps) and columns of one stored chunk
#: (16 bytes per thread: 4 lanes x 32 values).
FRAG_ROWS: int = 64
FRAG_COLS: int = 128
#: bf16 exponent offset of the stored E5M3 scale byte: bits = byte * 16 + SCALE_BIAS_BITS.
SCALE_BIAS_BITS: int = 224 << 7
#: The decoded weight is ``e2m1 * scale * 2^-7``; the accumulator is multiplied by this once.
WEIGHT_UNSCALE: float = 128.0
#: Store the block scales as the bf16 bits of ``scale * 2^119`` (2 bytes per 16 weights, read by the
#: multiply as they are) instead of the E5M3 byte (1 byte per 16 weights: 0.5625 bytes per weight
#: instead of 0.625). v3 keeps the byte: two scales of a word are widened together by one byte
#: permute and one multiply-add (:func:`_decode_word_asm_pair`, 0.25 instructions per weight value),
#: and the resident weight stays under a third of BF16's (docs/kernels.md).
SCALES_AS_BF16: bool = False


# ---------------------------------------------------------------------------------------------
# the layout chain (the same reshapes run in the kernel and, on index tensors, in the packer)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7, R: tl.constexpr, W: tl.constexpr):
    """Eight [R, W] tensors -> [R, 8W] with element (r, 8w + j) = v_j[r, w] (decoded order)."""
    x = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    # join nests innermost-last: x[r, w, a, b, c] = v_{4a + 2b + c}... reorder to (a, b, c) = j bits 2, 1, 0
    x = tl.permute(x, (0, 1, 4, 3, 2))
    return tl.reshape(x, (R, 8 * W))


@triton.jit
def _frag_cols(x, R: tl.constexpr):
    """Decoded order -> real column order within each 128-column chunk: with d = 8·word + j the
    decoded index (word 0..15, value 0..7 of the word), the real column is the bit permutation
    c = (d4 d3 d2 d1 d6 d5 d0), high bit first. So a thread's four words (its lane = word bits 2-3)
    are 16 contiguous bytes, the value pair j0 is wgmma's register pair, j1/j2 its k+8 / next 16."""
    NC: tl.constexpr = x.shape[1] // 128
    x = tl.reshape(x, (R * NC, 2, 2, 2, 2, 2, 2, 2))  # d6 d5 d4 d3 d2 d1 d0
    x = tl.permute(x, (0, 3, 4, 5, 6, 1, 2, 7))
    return tl.reshape(x, (R, NC * 128))


@triton.jit
def _frag_rows(x, C: tl.constexpr):
    """Loaded row order -> wgmma row order within each 64-row block."""
    R: tl.constexpr = x.shape[0]
    x = tl.reshape(x, (R // 64, 2, 4, 8, C))  # r' = (rep, bit5, warp bits 3-4, lane bits 0-2)
    x = tl.permute(x, (0, 2, 1, 3, 4))
    return tl.reshape(x, (R, C))


def _torch_chain(t: torch.Tensor) -> torch.Tensor:
    """The kernel's layout chain on a [R, 128·n] tensor in decoded order (the packer runs it on index
    tensors): columns then rows, exactly as in the kernel."""
    r, c2 = t.shape
    nc = c2 // 128
    t = t.reshape(r * nc, 2, 2, 2, 2, 2, 2, 2).permute(0, 3, 4, 5, 6, 1, 2, 7).reshape(r, c2)
    t = t.reshape(r // 64, 2, 4, 8, c2).permute(0, 2, 1, 3, 4).reshape(r, c2)
    return t


# ---------------------------------------------------------------------------------------------
# word decode
# ---------------------------------------------------------------------------------------------
#
# Value j of a word (j = 0..7) is the half (j & 1: low = bits 0-15, high = bits 16-31) of bf16x2
# register k = j >> 1. Its bits (sign, e1, e0, m) go to bf16 bits (15, 8, 7, 6); their sources in
# the half (add 16 for the high half):
#   k = 0: (15, 8, 7, 6)      (w << 0) & 0x81C081C0
#   k = 1: (12, 5, 4, 3)      (w << 3) & 0x81C081C0
#   k = 2: (9, 2, 1, 0)       (w << 6) & 0x81C081C0
#   k = 3: (14, 11, 10, 13)   ((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)
# The scale multiply is folded in: registers 0, 1 are scaled by ``sa``, 2, 3 by ``sb``.
SRC_BITS = (
    (15, 8, 7, 6),
    (12, 5, 4, 3),
    (9, 2, 1, 0),
    (14, 11, 10, 13),
)


#: The PTX both word decoders share after their scale setup: the 8 codes of word ``$8`` put into four
#: bf16x2 registers (bits placed in bf16's sign, exponent and mantissa fields), multiplied by the
#: first group's scale ``s0`` (registers 0, 1) and the second's ``s1`` (2, 3), and written to ``$0``..``$7``.
_DECODE_WORD_TAIL = """\
        and.b32 q0, $8, 0x81C081C0;
        shl.b32 t0, $8, 3;
        and.b32 q1, t0, 0x81C081C0;
        shl.b32 t1, $8, 6;
        and.b32 q2, t1, 0x81C081C0;
        shl.b32 t0, $8, 1;
        and.b32 t0, t0, 0x80008000;
        shr.b32 t1, $8, 3;
        and.b32 t1, t1, 0x01800180;
        shr.b32 t2, $8, 7;
        and.b32 t2, t2, 0x00400040;
        or.b32 t3, t0, t1;
        or.b32 q3, t3, t2;
        mul.rn.bf16x2 q0, q0, s0;
        mul.rn.bf16x2 q1, q1, s0;
        mul.rn.bf16x2 q2, q2, s1;
        mul.rn.bf16x2 q3, q3, s1;
        mov.b32 {$0, $1}, q0;
        mov.b32 {$2, $3}, q1;
        mov.b32 {$4, $5}, q2;
        mov.b32 {$6, $7}, q3;
        }
        """

#: :func:`_decode_word_asm`: the two bf16 scales ``$9``/``$10`` broadcast into bf16x2 registers.
_DECODE_WORD_BF16_SCALES = tl.constexpr("""
        {
        .reg .b32 t0, t1, t2, t3, q0, q1, q2, q3, s0, s1;
        mov.b32 s0, {$9, $9};
        mov.b32 s1, {$10, $10};
""" + _DECODE_WORD_TAIL)

#: :func:`_decode_word_asm_pair`: the E5M3 byte pair ``$9`` widened to the two bf16 scales.
DECODE_WORD_E5M3_PAIR = tl.constexpr("""
        {
        .reg .b32 t0, t1, t2, t3, q0, q1, q2, q3, y, s0, s1;
        .reg .b16 ha, hb;
        prmt.b32 y, $9, 0, 0x4140;
        mad.lo.u32 y, y, 16, 0x70007000;
        mov.b32 {ha, hb}, y;
        mov.b32 s0, {ha, ha};
        mov.b32 s1, {hb, hb};
""" + _DECODE_WORD_TAIL)


@triton.jit
def _decode_word_asm(w, sa, sb):
    """int32 words [R, W] and bf16 scales ``sa``/``sb`` [R, W] -> the 8 bf16 values of every word."""
    return tl.inline_asm_elementwise(
        asm=_DECODE_WORD_BF16_SCALES,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
        args=[w, sa, sb],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _decode_word_asm_pair(w, pair):
    """As :func:`_decode_word_asm`, the two block scales given as one E5M3 byte pair (``pair`` int32:
    byte 0 the first group's, byte 1 the second's). Widening both takes two instructions: a byte
    permute puts them in the two 16-bit halves, one multiply-add shifts them into bf16's exponent and
    mantissa fields and sets the exponent offset bits (``byte·16 + 224·128``; no carry between the
    halves); the half-selects of the multiplies are free operand modifiers."""
    return tl.inline_asm_elementwise(
        asm=DECODE_WORD_E5M3_PAIR,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[w, pair],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _decode_word_ref(w, sa, sb):
    """Portable twin of :func:`_decode_word_asm` (interpreter): the same bits with Triton integer
    ops; fp32 values (``sa``/``sb`` fp32) rounded once to bf16 (exact)."""
    lo = w & 0xFFFF
    hi = (w >> 16) & 0xFFFF
    l0, l1, l2, l3 = _half_values(lo)
    h0, h1, h2, h3 = _half_values(hi)
    return ((l0 * sa).to(tl.bfloat16), (h0 * sa).to(tl.bfloat16), (l1 * sa).to(tl.bfloat16), (h1 * sa).to(tl.bfloat16),
            (l2 * sb).to(tl.bfloat16), (h2 * sb).to(tl.bfloat16), (l3 * sb).to(tl.bfloat16), (h3 * sb).to(tl.bfloat16))


@triton.jit
def _half_values(h):
    """The four fp32 values ``e2m1 * 2^-126`` of a 16-bit half ``h`` (int32), registers k = 0..3."""
    v0 = _code_value((h >> 15) & 1, (h >> 8) & 1, (h >> 7) & 1, (h >> 6) & 1)
    v1 = _code_value((h >> 12) & 1, (h >> 5) & 1, (h >> 4) & 1, (h >> 3) & 1)
    v2 = _code_value((h >> 9) & 1, (h >> 2) & 1, (h >> 1) & 1, h & 1)
    v3 = _code_value((h >> 14) & 1, (h >> 11) & 1, (h >> 10) & 1, (h >> 13) & 1)
    return v0, v1, v2, v3


@triton.jit
def _code_value(s, e1, e0, m):
    """fp32 ``e2m1 * 2^-126`` of a code given by its bits (exact: 2^-126 is an fp32 normal)."""
    e = e1 * 2 + e0
    mf = m.to(tl.float32)
    mag = tl.where(e == 0, mf * 0.5, (1.0 + mf * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    mag = mag * 1.1754943508222875e-38  # 2^-126
    return tl.where(s == 1, -mag, mag)


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def fragment_tile(wq, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BF16: tl.constexpr, INTERP: tl.constexpr):
    """Decode one loaded tile of the fragment form: int32 words ``wq`` [BN, BK/8] and the scales
    ``sc`` (rows in stored/load order): int32 [BN, BK/16] bf16 bits (``SCALE_BF16``), or int32
    [BN, BK/32] E5M3 byte pairs (the two groups of one word: byte 0 and byte 1) -> bf16 [BN, BK]
    ``e2m1 · scale · 2^-7`` in real (row, column) order (for the GEMM: the wgmma register operand's
    layout, a relabel)."""
    WB: tl.constexpr = BLOCK_K // 8
    STEP: tl.constexpr = BLOCK_K // 128
    if SCALE_BF16:  # bf16 bits of scale * 2^119, one per group
        # the scales of a word's two groups: group 2·(w & 3) + {0, 1} of its 128-column chunk
        sc = tl.reshape(sc, (BLOCK_N, STEP, 4, 2))
        s_a, s_b = tl.split(sc)  # [BN, STEP, 4]
        if INTERP:
            s_a = ((s_a & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            s_b = ((s_b & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            s_a = s_a.to(tl.int16).to(tl.bfloat16, bitcast=True)
            s_b = s_b.to(tl.int16).to(tl.bfloat16, bitcast=True)
        s_a = tl.reshape(tl.broadcast_to(s_a[:, :, None, :], (BLOCK_N, STEP, 4, 4)), (BLOCK_N, WB))
        s_b = tl.reshape(tl.broadcast_to(s_b[:, :, None, :], (BLOCK_N, STEP, 4, 4)), (BLOCK_N, WB))
        if INTERP:
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word_ref(wq, s_a, s_b)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word_asm(wq, s_a, s_b)
    else:  # one E5M3 byte per group, a word's two groups as one 16-bit pair
        pr = tl.reshape(sc, (BLOCK_N, STEP, 4))
        pr = tl.reshape(tl.broadcast_to(pr[:, :, None, :], (BLOCK_N, STEP, 4, 4)), (BLOCK_N, WB))
        if INTERP:  # fp32 value of the bf16 bits byte*16 + 224*128 = (1 + m/8) * 2^(E5 + 97)
            b_a = pr & 0xFF
            b_b = (pr >> 8) & 0xFF
            s_a = ((b_a & 7).to(tl.float32) * 0.125 + 1.0) * tl.exp2(((b_a >> 3) + 97).to(tl.float32))
            s_b = ((b_b & 7).to(tl.float32) * 0.125 + 1.0) * tl.exp2(((b_b >> 3) + 97).to(tl.float32))
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word_ref(wq, s_a, s_b)
        else:
            v0, v1, v2, v3, v4, v5, v6, v7 = _decode_word_asm_pair(wq, pr)
    return _frag_rows(_frag_cols(_join8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, WB), BLOCK_N), BLOCK_K)


@triton.jit
def _a_tile(a_ptr, stride_am, smask_ptr, q_gs, k0, K, rm, ok, M, BLOCK_M: tl.constexpr, A_ROWS: tl.constexpr,
            QUANT_IN: tl.constexpr, DIV6_RECIP: tl.constexpr):
    """The activation tile [BLOCK_M, BLOCK_K] of columns ``k0 + ok``: ``BLOCK_M`` rows loaded (``A_ROWS``
    0), or only ``A_ROWS`` rows (the first ``A_ROWS`` >= M) loaded and repeated to ``BLOCK_M`` (row r is
    row r % A_ROWS; rows >= M are never stored). ``QUANT_IN``: ``a_ptr`` is X and the rows are
    quantized here with the static global scale ``q_gs``, with the standalone quantizer's primitives
    (bit-identical ``q * s``), S columns zeroed from ``smask_ptr``."""
    kmask = (k0 + ok) < K
    if A_ROWS == 0:
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + ok)[None, :], mask=kmask[None, :], other=0.0)
    else:
        rr = tl.arange(0, A_ROWS)
        lm = (rr < M)[:, None] & kmask[None, :]
        a = tl.load(a_ptr + rr.to(tl.int64)[:, None] * stride_am + (k0 + ok)[None, :], mask=lm, other=0.0)
        if QUANT_IN:
            BK: tl.constexpr = a.shape[1]
            x = a.to(tl.float32)
            sm = tl.load(smask_ptr + k0 + ok, mask=kmask, other=0)
            x = tl.where((sm != 0)[None, :], 0.0, x)
            xb = tl.reshape(x, (A_ROWS, BK // 16, 16))
            gsv = tl.full((A_ROWS,), 1.0, tl.float32) * q_gs
            _p, _s, deq = quant_xb_2d(xb, tl.max(tl.abs(xb), axis=2), gsv, A_ROWS, BK, DIV6_RECIP)
            a = deq.to(tl.bfloat16)  # exact: e2m1 x e4m3 products have at most 6 significant bits
        if A_ROWS < BLOCK_M:
            BK2: tl.constexpr = a.shape[1]
            a = tl.reshape(tl.broadcast_to(a[None, :, :], (BLOCK_M // A_ROWS, A_ROWS, BK2)), (BLOCK_M, BK2))
    return a


@triton.jit
def _xs_tile(x_ptr, stride_xm, ch_ptr, rm, k0, hi, M, BLOCK_M: tl.constexpr, BLOCK_KS: tl.constexpr, A_ROWS: tl.constexpr):
    """``X[:, S]`` columns ``k0 .. k0 + BLOCK_KS`` (< ``hi``) gathered from X by channel index: [BLOCK_M, BLOCK_KS]
    (``A_ROWS`` > 0: those rows loaded and repeated, as :func:`_a_tile`)."""
    offs_c = tl.arange(0, BLOCK_KS)
    cm = (k0 + offs_c) < hi
    ch = tl.load(ch_ptr + k0 + offs_c, mask=cm, other=0).to(tl.int64)
    if A_ROWS == 0:
        xs = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :], mask=cm[None, :], other=0.0)
    else:
        rr = tl.arange(0, A_ROWS)
        xs = tl.load(x_ptr + rr.to(tl.int64)[:, None] * stride_xm + ch[None, :], mask=(rr < M)[:, None] & cm[None, :], other=0.0)
        if A_ROWS < BLOCK_M:
            xs = tl.reshape(tl.broadcast_to(xs[None, :, :], (BLOCK_M // A_ROWS, A_ROWS, BLOCK_KS)), (BLOCK_M, BLOCK_KS))
    return xs


@triton.jit
def _fragment_gemm_kernel(
    a_ptr, stride_am,  # A: bf16 q*s (A_QUANT), X (W4A16, or QUANT_IN: quantized here) [M, K], unit stride along K
    a_gs_ptr,  # fp32 [M] activation global scale (A_QUANT); QUANT_IN: fp32 [1], the static scale
    x_ptr, stride_xm,  # X [M, K] bf16, source of the BF16 segment
    ch_ptr,  # int32 [KS] channel indices
    wf_ptr, stride_wfn,  # fragment codes as int32 words [Np, Kp/8] (rows of each 64-row block in load order)
    sf_ptr, stride_sfn,  # scales as int16: [Np, Kp/32] E5M3 byte pairs, or [Np, Kp/16] bf16 bits (SCALE_BF16); rows in load order
    w_gs_ptr,  # fp32 [N] weight global scale per output row
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,  # [N]
    out_ptr, stride_om,  # [M, N]
    ws_ptr,  # fp32 split-K workspace [SPLITS, M, N] (SPLIT)
    cnt_ptr,  # int32 [>= tiles] arrival counters, zero between calls (SPLIT)
    SPLITS,
    M, N, K, KS,
    CHUNKS_PER_SPLIT,  # 128-column chunks per split (a multiple of BLOCK_K/128); grid axis 1 = split
    FIRST_CHUNKS,  # chunks of split 0 (equal to CHUNKS_PER_SPLIT: the BF16 segment is spread over the splits)
    KCP,  # 128-column chunks of the padded weight
    NP,  # stored rows (N rounded up to 64)
    smask_ptr,  # uint8 [K], 1 on the S columns (QUANT_IN)
    SEG_PER_SPLIT,  # BF16-segment columns per split (a multiple of BLOCK_KS)
    TILES,  # output tiles (PERSISTENT: the work items are TILES x SPLITS)
    A_QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERP: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,  # launched with PDL after the activation quantizer: wait for it
    PREFETCH_CHUNKS: tl.constexpr = 0,  # with GDC_WAIT: 128-column chunks of weight prefetched into L2 first
    A_ROWS: tl.constexpr = 0,  # > 0: M <= A_ROWS < BLOCK_M, only A_ROWS activation rows are loaded (see _a_tile)
    QUANT_IN: tl.constexpr = False,  # the activation is quantized in this kernel (static scale, A_ROWS > 0)
    DIV6_RECIP: tl.constexpr = False,  # QUANT_IN: the block-scale division as on CUDA (act_quant.DIV6_RECIP_ON_CUDA)
    PERSISTENT: tl.constexpr = False,  # grid axis 0 walks the TILES x SPLITS work items with stride num_programs
):
    if PERSISTENT:
        for work in range(tl.program_id(0), TILES * SPLITS, tl.num_programs(0)):
            _fragment_work(work % TILES, work // TILES,
                           a_ptr, stride_am, a_gs_ptr, x_ptr, stride_xm, ch_ptr, wf_ptr, stride_wfn, sf_ptr, stride_sfn,
                           w_gs_ptr, wb_ptr, stride_wbn, bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLITS,
                           M, N, K, KS, CHUNKS_PER_SPLIT, FIRST_CHUNKS, KCP, NP, smask_ptr, SEG_PER_SPLIT,
                           A_QUANT, HAS_BIAS, HAS_KS, SPLIT, SCALE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_KS, GROUP_M,
                           INTERP, GDC_WAIT, PREFETCH_CHUNKS, A_ROWS, QUANT_IN, DIV6_RECIP)
    else:
        _fragment_work(tl.program_id(0), tl.program_id(1),
                       a_ptr, stride_am, a_gs_ptr, x_ptr, stride_xm, ch_ptr, wf_ptr, stride_wfn, sf_ptr, stride_sfn,
                       w_gs_ptr, wb_ptr, stride_wbn, bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLITS,
                       M, N, K, KS, CHUNKS_PER_SPLIT, FIRST_CHUNKS, KCP, NP, smask_ptr, SEG_PER_SPLIT,
                       A_QUANT, HAS_BIAS, HAS_KS, SPLIT, SCALE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_KS, GROUP_M,
                       INTERP, GDC_WAIT, PREFETCH_CHUNKS, A_ROWS, QUANT_IN, DIV6_RECIP)


@triton.jit
def _fragment_work(
    pid, pid_k,
    a_ptr, stride_am, a_gs_ptr, x_ptr, stride_xm, ch_ptr, wf_ptr, stride_wfn, sf_ptr, stride_sfn,
    w_gs_ptr, wb_ptr, stride_wbn, bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLITS,
    M, N, K, KS, CHUNKS_PER_SPLIT, FIRST_CHUNKS, KCP, NP, smask_ptr, SEG_PER_SPLIT,
    A_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KS: tl.constexpr, SPLIT: tl.constexpr,
    SCALE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr, GROUP_M: tl.constexpr, INTERP: tl.constexpr, GDC_WAIT: tl.constexpr,
    PREFETCH_CHUNKS: tl.constexpr, A_ROWS: tl.constexpr, QUANT_IN: tl.constexpr, DIV6_RECIP: tl.constexpr,
):
    """One (output tile ``pid``, split ``pid_k``) of :func:`_fragment_gemm_kernel`."""
    pid_m, pid_n = tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rl = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # stored rows, in load order
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows (wgmma order = real order)
    rn = (offs_n % N).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = (offs_m % M).to(tl.int64)

    WB: tl.constexpr = BLOCK_K // 8  # words per row per step
    G: tl.constexpr = BLOCK_K // 16 if SCALE_BF16 else BLOCK_K // 32  # int16 scale elements per step
    SPC: tl.constexpr = 8 if SCALE_BF16 else 4  # ... per 128-column chunk
    STEP: tl.constexpr = BLOCK_K // 128
    if pid_k == 0:
        c_start = 0
        c_end = tl.minimum(KCP, FIRST_CHUNKS)
    else:
        c_start = FIRST_CHUNKS + (pid_k - 1) * CHUNKS_PER_SPLIT
        c_end = tl.minimum(KCP, c_start + CHUNKS_PER_SPLIT)
    ow = tl.arange(0, WB)
    og = tl.arange(0, G)
    ok = tl.arange(0, BLOCK_K)
    w_ptrs = wf_ptr + rl.to(tl.int64)[:, None] * stride_wfn + (c_start * 16 + ow)[None, :]
    s_ptrs = sf_ptr + rl.to(tl.int64)[:, None] * stride_sfn + (c_start * SPC + og)[None, :]

    if HAS_KS:
        # the BF16 columns at their byte cost: this split's first BLOCK_KS columns of W[:, S] and X[:, S]
        # are loaded *before* the FP4 loop (their latency hides behind it) and multiplied after it, in
        # the reference's order (FP4 part scaled first, then the segment added); a split with more
        # columns than BLOCK_KS runs the rest as further K steps after that
        seg_lo = pid_k * SEG_PER_SPLIT
        seg_hi = tl.minimum(KS, seg_lo + SEG_PER_SPLIT)
        offs_c = tl.arange(0, BLOCK_KS)
        wb0 = tl.load(wb_ptr + rn[:, None] * stride_wbn + (seg_lo + offs_c)[None, :],
                      mask=((seg_lo + offs_c) < seg_hi)[None, :], other=0.0)
        xs0 = _xs_tile(x_ptr, stride_xm, ch_ptr, rm, seg_lo, seg_hi, M, BLOCK_M, BLOCK_KS, A_ROWS)

    if QUANT_IN:
        q_gs = tl.load(a_gs_ptr)
    else:
        q_gs = 1.0

    if GDC_WAIT:
        # PDL: this program may run while the activation quantizer still does. The weights do not
        # depend on it: pull this program's first chunks (codes and scales) into L2, one line per
        # stored row and chunk, then wait for the quantizer's grid to complete before reading A.
        if PREFETCH_CHUNKS > 0:
            rows64 = tl.minimum(rl, NP - 1).to(tl.int64)
            for c in tl.static_range(PREFETCH_CHUNKS):
                cc = tl.minimum(c_start + c, KCP - 1)
                prefetch_l2(wf_ptr + rows64 * stride_wfn + cc * 16)
                if c % 4 == 0:
                    prefetch_l2(sf_ptr + rows64 * stride_sfn + cc * SPC)
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    rmask = (rl < NP)[:, None]  # a tile may reach past the last stored 64-row block
    for c0 in range(c_start, c_end, STEP):
        wq = tl.load(w_ptrs, mask=rmask, other=0)
        sc = tl.load(s_ptrs, mask=rmask, other=0).to(tl.int32)  # [BN, G] int16 -> int32 (rows in load order)
        w = fragment_tile(wq, sc, BLOCK_N, BLOCK_K, SCALE_BF16, INTERP)
        a = _a_tile(a_ptr, stride_am, smask_ptr, q_gs, c0 * 128, K, rm, ok, M, BLOCK_M, A_ROWS, QUANT_IN, DIV6_RECIP)
        acc = mma(w, tl.trans(a), acc, INTERP)
        w_ptrs += WB
        s_ptrs += G

    wgs = tl.load(w_gs_ptr + rn)
    if QUANT_IN:
        acc = acc * (128.0 / (wgs * q_gs))[:, None]
    elif A_QUANT:
        ags = tl.load(a_gs_ptr + rm)
        acc = acc * (128.0 / (wgs[:, None] * ags[None, :]))
    else:
        acc = acc * (128.0 / wgs)[:, None]

    if HAS_KS:
        acc = mma(wb0, tl.trans(xs0), acc, INTERP)
        for k0 in range(seg_lo + BLOCK_KS, seg_hi, BLOCK_KS):
            cm = (k0 + offs_c) < seg_hi
            xs = _xs_tile(x_ptr, stride_xm, ch_ptr, rm, k0, seg_hi, M, BLOCK_M, BLOCK_KS, A_ROWS)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (k0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
            acc = mma(wb, tl.trans(xs), acc, INTERP)

    split_k_epilogue(acc, pid, pid_k, offs_m, offs_n, rn, M, N, SPLITS, ws_ptr, cnt_ptr, bias_ptr, out_ptr, stride_om,
                     SPLIT, HAS_BIAS, BLOCK_M, BLOCK_N, INTERP)


@triton.jit
def split_k_epilogue(acc, pid, pid_k, offs_m, offs_n, rn, M, N, SPLITS, ws_ptr, cnt_ptr, bias_ptr, out_ptr, stride_om,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     INTERP: tl.constexpr):
    """The one split-K epilogue of the ``Yᵀ[BN, BM]`` tiles (this kernel and the plain-Triton twin of the
    Gluon form, :mod:`.gluon_ws_twin`): with ``SPLIT``, split-K without a second launch or a memset: every
    split stores its fp32 partial, the last to arrive (a per-tile counter) sums all partials in split
    order (deterministic), adds the bias, writes the output and resets the counter to 0 for the next
    call; without, bias and store. The Gluon kernel (:mod:`.gluon_ws`) spells the same steps in Gluon's
    language (a ``@triton.jit`` helper cannot be called from a ``@gluon.jit`` kernel); :mod:`.swap` reduces
    in a second launch (another scheme)."""
    omask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None].to(tl.int64)
    if SPLIT:
        offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tot = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in range(0, SPLITS):
                tot += tl.load(ws_ptr + sp * M * N + offs, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
            if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
                tot = bf16_rne(tot, INTERP)
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
            acc = bf16_rne(acc, INTERP)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


# ---------------------------------------------------------------------------------------------
# the execution form
# ---------------------------------------------------------------------------------------------


@dataclass
class FragmentWeight:
    """The fragment-layout execution form of one layer's FP4 part (built by :func:`fragment_weight`).

    Attributes:
        words: int32 [Np, Kp/8], Np = N rounded up to 64, Kp = K rounded up to 256; the codes of
            each 64-row x 128-column block placed so that the kernel's loads and layout chain
            deliver each thread its wgmma fragment (zero codes in the padding and the S columns).
        scales: [Np, Kp/16], rows in the same stored order as ``words``: uint8, the block scales
            re-encoded as unsigned E5M3 (bf16 bits ``byte·16 + 224·128`` = ``scale·2^119``), or
            (``scale_bf16``) int16, those bf16 bits themselves.
    """

    words: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    scale_bf16: bool = False


_TILE_MAP: dict = {}


def _tile_map(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one 64 x 128 block, per real (row, col): stored row, word of the chunk, and the four word
    bit positions of (sign, e1, e0, m)."""
    key = str(device)
    if key not in _TILE_MAP:
        idx = torch.arange(FRAG_ROWS * FRAG_COLS, dtype=torch.int64).reshape(FRAG_ROWS, FRAG_COLS)
        t = _torch_chain(idx)  # t[row, col] = stored_row * 128 + d
        srow, d = t // FRAG_COLS, t % FRAG_COLS
        word, j = d // 8, d % 8
        src = torch.tensor(SRC_BITS, dtype=torch.int64)  # [4 registers, 4 bits]
        bits = src[j // 2] + 16 * (j % 2)[..., None]  # [64, 128, 4]
        _TILE_MAP[key] = (srow.to(device), word.to(device), bits.to(device))
    return _TILE_MAP[key]


def _e5m3_of_e4m3(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 scale bytes (non-negative) -> unsigned E5M3 bytes whose bf16 bits byte·16 + 224·128 are
    exactly ``scale · 2^119`` (a zero scale gives byte 0; its block's codes must be zeroed)."""
    v = scale_bytes.view(torch.float8_e4m3fn).float()
    s = (v * 2.0**119).to(torch.bfloat16)
    bits = s.view(torch.int16).to(torch.int32)
    u = (bits - SCALE_BIAS_BITS) >> 4
    ok = (v == 0) | ((bits & 15) == 0) & (u >= 0) & (u <= 255) & (s.float() == v * 2.0**119)
    if not bool(ok.all()):
        raise ValueError("fragment_weight: a block scale is negative, NaN or not an E4M3 value")
    return torch.where(v == 0, torch.zeros_like(u), u).to(torch.uint8)


def fragment_weight(packed: torch.Tensor, scale_bytes: torch.Tensor, scale_bf16: bool | None = None) -> FragmentWeight:
    """Build the fragment execution form from the compressed-tensors tensors.

    Args:
        packed: uint8 [N, K/2] (low nibble = even column), with the S columns' codes already 0.
        scale_bytes: uint8 [N, K/16], E4M3 bytes of the block scales.
        scale_bf16: the scale encoding (default :data:`SCALES_AS_BF16`).
    """
    if scale_bf16 is None:
        scale_bf16 = SCALES_AS_BF16
    n, kh = packed.shape
    k = kh * 2
    dev = packed.device
    np_, kp = -(-n // FRAG_ROWS) * FRAG_ROWS, -(-k // 256) * 256
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n, k).to(torch.int64)
    zero_block = (scale_bytes == 0).repeat_interleave(BLOCK_SIZE, dim=1)
    codes = torch.where(zero_block, torch.zeros_like(codes), codes)
    codes = torch.nn.functional.pad(codes, (0, kp - k, 0, np_ - n))
    srow, word, bits = _tile_map(dev)
    nb, nc = np_ // FRAG_ROWS, kp // FRAG_COLS
    c = codes.reshape(nb, FRAG_ROWS, nc, FRAG_COLS)
    code_bits = torch.stack([(c >> 3) & 1, (c >> 2) & 1, (c >> 1) & 1, c & 1], dim=-1)  # [nb, 64, nc, 128, 4]
    contrib = (code_bits << bits[None, :, None, :, :]).sum(-1)  # [nb, 64, nc, 128] disjoint bits
    target = (srow * 16 + word)[None, :, None, :].expand(nb, FRAG_ROWS, nc, FRAG_COLS)  # within (block, chunk)
    out = torch.zeros(nb, nc, FRAG_ROWS * 16, dtype=torch.int64, device=dev)
    out.scatter_add_(2, target.permute(0, 2, 1, 3).reshape(nb, nc, -1), contrib.permute(0, 2, 1, 3).reshape(nb, nc, -1))
    words = out.reshape(nb, nc, FRAG_ROWS, 16).permute(0, 2, 1, 3).reshape(np_, kp // 8)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    sc = torch.nn.functional.pad(_e5m3_of_e4m3(scale_bytes).to(torch.int64), (0, kp // 16 - k // 16, 0, np_ - n))
    # stored row order: stored row srow[r, :] of a block holds real row r
    perm = torch.empty(FRAG_ROWS, dtype=torch.int64, device=dev)
    perm[srow[:, 0]] = torch.arange(FRAG_ROWS, device=dev)  # perm[stored] = real
    sc = sc.reshape(nb, FRAG_ROWS, -1)[:, perm].reshape(np_, kp // 16)
    if scale_bf16:
        sc = torch.where(sc == 0, sc, sc * 16 + SCALE_BIAS_BITS).to(torch.int16)
    sc = (sc.to(torch.int16) if scale_bf16 else sc.to(torch.uint8)).contiguous()
    return FragmentWeight(words=words, scales=sc, out_features=n, in_features=k, scale_bf16=scale_bf16)


def unfragment(fw: FragmentWeight, rows_per_pass: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed-tensors tensors back from the fragment form: ``(packed uint8 [N, K/2], E4M3
    scale bytes uint8 [N, K/16])``, the inverse of :func:`fragment_weight` (codes of zero-scale
    blocks come back as 0, which dequantizes to the same 0). Used where a reference or another form
    needs the packed layout (the autotuner's on-device check builds it as a temporary); it is not kept
    on the device by the default paths. ``rows_per_pass`` bounds the temporary memory."""
    n, k = fw.out_features, fw.in_features
    np_, kw = fw.words.shape
    kp = kw * 8
    nc = kp // FRAG_COLS
    srow, word, bits = _tile_map(fw.words.device)  # [64, 128], [64, 128], [64, 128, 4]
    shifts = bits.to(torch.int64)
    packed_parts = []
    step = max(FRAG_ROWS, rows_per_pass // FRAG_ROWS * FRAG_ROWS)
    for r0 in range(0, np_, step):
        w = fw.words[r0:r0 + step].to(torch.int64) & 0xFFFFFFFF
        nb = w.shape[0] // FRAG_ROWS
        w = w.reshape(nb, FRAG_ROWS, nc, 16)
        g = w[:, srow, :, word]  # [64, 128, nb, nc] (advanced indices first): the word of (real row, col)
        g = g.permute(2, 0, 3, 1)  # [nb, 64, nc, 128]
        b = (g[..., None] >> shifts[None, :, None, :, :]) & 1  # [nb, 64, nc, 128, 4] = (s, e1, e0, m)
        codes = (b[..., 0] << 3) | (b[..., 1] << 2) | (b[..., 2] << 1) | b[..., 3]
        codes = codes.reshape(nb * FRAG_ROWS, kp).to(torch.uint8)
        packed_parts.append(codes[:, 0::2] | (codes[:, 1::2] << 4))
    packed = torch.cat(packed_parts)[:n, : k // 2].contiguous()
    sc = fw.scales.to(torch.int32)
    if fw.scale_bf16:
        bits16 = sc & 0xFFFF
    else:
        bits16 = torch.where(sc == 0, sc, sc * 16 + SCALE_BIAS_BITS)
    sc = bits16.reshape(np_ // FRAG_ROWS, FRAG_ROWS, -1)[:, srow[:, 0]].reshape(np_, -1)  # stored -> real rows
    val = (sc.to(torch.int16).view(torch.bfloat16).float() * 2.0**-119)
    scale = torch.where(bits16.reshape(np_ // FRAG_ROWS, FRAG_ROWS, -1)[:, srow[:, 0]].reshape(np_, -1) == 0,
                        torch.zeros_like(val), val)
    scale = scale.to(torch.float8_e4m3fn).view(torch.uint8)[:n, : k // BLOCK_SIZE].contiguous()
    return packed, scale


def scale_view(fw: FragmentWeight) -> torch.Tensor:
    """The scales as the kernels load them: int16 elements (bf16 bits, or two E5M3 bytes)."""
    return fw.scales if fw.scale_bf16 else fw.scales.view(torch.int16)


def fragment_bytes(fw: FragmentWeight) -> int:
    """Bytes of the fragment form on its device (codes and scales, padding included)."""
    return fw.words.numel() * fw.words.element_size() + fw.scales.numel() * fw.scales.element_size()


def fragment_of(pw) -> FragmentWeight:
    """The fragment form of a :class:`~foursight.kernels.prepared.PreparedWeight` (built by
    ``prepare_weight``: the layer's one resident weight form)."""
    return pw.fragment


#: fixed cost of one program (pipeline fill, epilogue, its share of the split reduction) in units of
#: the time one program takes for the whole K: the split plan trades it against the wave tail
PROGRAM_OVERHEAD: float = 0.02


def _wave_split(tiles: int, steps: int, slots: int) -> int:
    """The split count that minimizes ``waves(s) * (1/s + PROGRAM_OVERHEAD)``, waves(s) = the
    number of rounds ``tiles * s`` programs need on ``slots`` resident programs (the smallest such s
    on ties). A split count that leaves a partial last wave costs a whole wave: with 3 resident
    programs per SM, 128 tiles x 5 splits took 1.6 waves (Nsight Compute, docs/kernels.md)."""
    if tiles >= slots:  # a full wave without splitting: the split's traffic would not pay
        return 1
    best, best_cost = 1, float("inf")
    for s in range(1, max(1, min(steps, 64)) + 1):
        cost = triton.cdiv(tiles * s, slots) * (1.0 / s + PROGRAM_OVERHEAD)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def split_plan(m: int, n: int, kcp: int, kk: int, bm: int, bn: int, step: int, split: int, slots: int) -> tuple[int, int, int]:
    """(splits, chunks per split, chunks of split 0) for ``kcp`` 128-column chunks. ``split`` 0 =
    automatic (:func:`_wave_split` over ``slots``, the programs that can be resident at once),
    1 = no split. Every split gets the same number of chunks: the BF16 segment (``kk`` columns) is
    spread over the splits (:func:`segment_plan`), not run by split 0 alone."""
    steps = triton.cdiv(kcp, step)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split == 0:
        split = _wave_split(tiles, steps, slots)
        split = max(1, min(split, (256 * 2**20) // max(1, 4 * m * n)))  # workspace <= 256 MB
    split = max(1, min(split, steps))
    if split == 1:
        return 1, steps * step, steps * step
    cps = triton.cdiv(steps, split) * step
    splits = triton.cdiv(kcp, cps)
    return splits, cps, cps


#: columns of the smallest BF16-segment step (the bf16 MMA's K)
SEGMENT_STEP: int = 16
#: at most this many BF16-segment columns of a split are loaded before its FP4 loop (one MMA after it);
#: a split with more runs the rest as further steps after that one. 32 columns cost a 64-row tile 8
#: registers per thread for W[:, S] (16 at block_n 128), and keep at most two compiled variants.
SEGMENT_PRELOAD: int = 32


def segment_plan(kk: int, splits: int) -> tuple[int, int]:
    """(BLOCK_KS, columns per split) of the BF16 segment: ``kk`` columns over ``splits`` programs;
    BLOCK_KS (16 or :data:`SEGMENT_PRELOAD`) is the step loaded before the FP4 loop, and every split's
    share is a multiple of it."""
    per = triton.cdiv(max(kk, 1), splits)
    step = SEGMENT_STEP if per <= SEGMENT_STEP else SEGMENT_PRELOAD
    return step, triton.cdiv(per, step) * step


_SLOTS: dict = {}


def _resident_slots(device, key, compile_fn, num_warps: int = 4) -> int:
    """:func:`~.primitives.resident_programs` of one compiled variant (``compile_fn`` compiles it
    without launching it), cached per device and ``key``."""
    ck = (str(device), key)
    if ck not in _SLOTS:
        _SLOTS[ck] = resident_programs(device, compile_fn, num_warps)
    return _SLOTS[ck]


_COUNTERS: dict = {}
_COUNTERS_KEEP: list = []  # earlier, smaller counter buffers stay alive (a CUDA graph may hold them)


def split_counters(device, tiles: int) -> torch.Tensor:
    """The per-tile arrival counters of the split-K reduction on ``device``: zeroed once when
    allocated; every call leaves them at zero (the last split resets its tile's counter). Calls that
    use them must not run concurrently on two streams."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        if buf is not None:
            _COUNTERS_KEEP.append(buf)
        buf = torch.zeros(max(tiles, 8192), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


#: chunks of weight each program prefetches into L2 while it waits for the quantizer (PDL)
PDL_PREFETCH_CHUNKS: int = 4


#: the activation is quantized inside the GEMM (``FragmentConfig.quant_in``) up to this many rows, with
#: a static activation scale only (a dynamic one needs the row's amax before any block)
QUANT_IN_MAX_M: int = 4


def a_rows_for(m: int, bm: int) -> int:
    """Activation rows a narrow tile loads (``A_ROWS``): the power of two >= ``m`` when that is below the
    token tile ``bm``, else 0 (the whole tile)."""
    r = triton.next_power_of_2(max(m, 1))
    return r if r < bm else 0


def fragment_launch(cfg, a, a_gs, x, pw, bias, out, a_quant: bool, pdl: bool = False, quant_in: bool = False):
    """Launch the fragment kernel (one launch; with split-K the last split of each tile reduces).

    ``a``: the bf16 ``q*s`` activation (``a_quant``, ``a_gs`` its per-row global scales) or X itself
    (W4A16, bf16); ``x``: the source of the BF16 segment's columns (bf16, unit stride along K), read by
    channel index (loaded before the FP4 loop). ``quant_in``: ``a`` is X and the kernel quantizes it
    (``a_gs`` the static global scale, fp32 [1]; at most :data:`QUANT_IN_MAX_M` rows).
    ``pdl`` (opt-in, ``FOURSIGHT_PDL=1``): launched with programmatic dependent launch right after the
    activation quantizer (which called ``gdc_launch_dependents``): each program prefetches its first
    weight chunks into L2 and then waits for the quantizer (``gdc_wait``) before it reads ``a``.
    ``cfg.narrow``: only ``a_rows_for(M)`` activation rows are loaded; ``cfg.persistent``: as many
    programs as fit at once walk the (tile, split) work items."""
    from .act_quant import DIV6_RECIP_ON_CUDA

    fw = fragment_of(pw)
    sf = scale_view(fw)
    m = x.shape[0]
    n, k_dim = pw.out_features, pw.in_features
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    kk = pw.num_channels
    kcp = fw.words.shape[1] // 16
    step = bk // FRAG_COLS
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    dummy = pw.weight_global_scale
    a_rows = a_rows_for(m, bm) if (cfg.narrow or quant_in) else 0
    if quant_in and (a_rows == 0 or m > QUANT_IN_MAX_M or not a_quant):
        raise ValueError(f"fragment_launch: quantizing inside the GEMM needs W4A4 and M <= {QUANT_IN_MAX_M}, got M = {m}")
    consts = dict(A_QUANT=a_quant, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SCALE_BF16=fw.scale_bf16,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_KS=16,
                  GROUP_M=8, INTERP=interpreting(), A_ROWS=a_rows, QUANT_IN=quant_in,
                  DIV6_RECIP=DIV6_RECIP_ON_CUDA if x.is_cuda else False, PERSISTENT=cfg.persistent)
    nw = cfg.num_warps
    opts = dict(num_warps=nw, num_stages=cfg.num_stages)
    if cfg.max_regs and not interpreting():
        opts["maxnreg"] = cfg.max_regs
    pdl = pdl and not interpreting()
    if pdl:
        consts.update(GDC_WAIT=True, PREFETCH_CHUNKS=PDL_PREFETCH_CHUNKS)
        opts["launch_pdl"] = True

    def args(ws, cnt, splits, cps, first, seg=16):
        return (a, a.stride(0),
                a_gs if a_gs is not None else dummy,
                x, x.stride(0),
                pw.bf16_channels if kk else pw.channel_mask,
                fw.words, fw.words.stride(0),
                sf, sf.stride(0),
                pw.weight_global_scale,
                pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
                bias if bias is not None else dummy,
                out, out.stride(0), ws, cnt, splits,
                m, n, k_dim, kk, cps, first, kcp, fw.words.shape[0],
                pw.channel_mask, seg, tiles)

    slots = 8
    if cfg.split_k == 0 or cfg.persistent:
        key = (str(cfg), tuple(sorted(consts.items())), a.dtype, out.dtype, bias.dtype if bias is not None else None)
        slots = _resident_slots(out.device, key, lambda: _fragment_gemm_kernel.warmup(
            *args(dummy, split_counters(out.device, 1), 2, 16, 16), SPLIT=True, **consts, **opts, grid=(1, 1)), nw)
    splits, cps, first = split_plan(m, n, kcp, kk, bm, bn, step, cfg.split_k, slots)
    consts["BLOCK_KS"], seg = segment_plan(kk, splits)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else dummy
    cnt = split_counters(out.device, tiles) if splits > 1 else dummy
    grid = (min(tiles * splits, slots), 1) if cfg.persistent else (tiles, splits)
    return _fragment_gemm_kernel[grid](*args(ws, cnt, splits, cps, first, seg), SPLIT=splits > 1, **consts, **opts)
