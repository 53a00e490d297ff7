"""The fragment execution form of a layer's FP4 weight: its layout, built once on the host
(:func:`fragment_weight`, the inverse :func:`unfragment`), and its decode inside a kernel
(:func:`fragment_tile`). One subject: where every code and scale sits, and how a thread gets its
wgmma fragment back from it. The GEMM that reads it is :mod:`.fragment`; the prefill
dequantization :mod:`.dequant` and the Gluon form :mod:`.experimental.gluon_ws` read it too.

Why the layout is what it is:

* **Rows.** The tile is loaded as ``[BN, 64]`` bytes per 128 columns; the load's natural layout puts
  rows ``lane/4 + 8·warp + 32·r``, wgmma wants ``lane/4 + 8·a + 16·warp + 64·r``. A reshape/permute
  of the row index (``_frag_rows``) maps one onto the other, so it is a register relabel; the
  offline form stores each 64-row block's rows in the matching order.
* **Columns.** A thread loads 16 contiguous bytes (one 128-bit load) = its 32 fragment values of one
  row over 128 columns. Each 32-bit word decodes in PTX to four bf16x2 registers
  (:func:`_decode_word_asm`: three are one shift and one AND each, the fourth five operations) whose
  pairs are consecutive columns, as wgmma's register operand wants them; a bit permutation of the
  column index (``_frag_cols``) names which columns they are.
* **Numbers.** A code is stored as bf16 bits (sign at 15, exponent/mantissa at 8..6) so the decoded
  value is ``e2m1 · 2^-126`` exactly (code 1 is a bf16 subnormal); the E4M3 block scale is stored
  re-encoded as an unsigned E5M3 byte whose bf16 bits are ``byte·16 + 224·128`` = ``scale · 2^119``
  (exact, E4M3 subnormals included); their bf16 product ``e2m1 · scale · 2^-7`` is exact (at most 6
  significant bits, far from bf16's range limits).

The interpreter cannot run PTX: there the word decode is its portable twin (:func:`_decode_word_ref`),
the same bits with Triton integer ops, and the layout chain is the same reshapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foursight.nvfp4 import BLOCK_SIZE

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


def tile_map(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def e5m3_of_e4m3(scale_bytes: torch.Tensor) -> torch.Tensor:
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
    srow, word, bits = tile_map(dev)
    nb, nc = np_ // FRAG_ROWS, kp // FRAG_COLS
    c = codes.reshape(nb, FRAG_ROWS, nc, FRAG_COLS)
    code_bits = torch.stack([(c >> 3) & 1, (c >> 2) & 1, (c >> 1) & 1, c & 1], dim=-1)  # [nb, 64, nc, 128, 4]
    contrib = (code_bits << bits[None, :, None, :, :]).sum(-1)  # [nb, 64, nc, 128] disjoint bits
    target = (srow * 16 + word)[None, :, None, :].expand(nb, FRAG_ROWS, nc, FRAG_COLS)  # within (block, chunk)
    out = torch.zeros(nb, nc, FRAG_ROWS * 16, dtype=torch.int64, device=dev)
    out.scatter_add_(2, target.permute(0, 2, 1, 3).reshape(nb, nc, -1), contrib.permute(0, 2, 1, 3).reshape(nb, nc, -1))
    words = out.reshape(nb, nc, FRAG_ROWS, 16).permute(0, 2, 1, 3).reshape(np_, kp // 8)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()
    sc = torch.nn.functional.pad(e5m3_of_e4m3(scale_bytes).to(torch.int64), (0, kp // 16 - k // 16, 0, np_ - n))
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
    srow, word, bits = tile_map(fw.words.device)  # [64, 128], [64, 128], [64, 128, 4]
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

