"""SpliceGEMM (Triton): NVFP4 x NVFP4 (or BF16/FP16 x NVFP4) GEMM with the BF16 channel segment
spliced into the same K loop and the same fp32 accumulator.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``

Kernel forms (the autotuner in :mod:`foursight.kernels.api` picks one per shape; docs/kernels.md)
-------------------------------------------------------------------------------------------------
* ``_splice_gemm_kernel`` ("swap"): the swap-AB tile described below (decode with 2..16 rows, mid).
* ``_splice_gemm_ss_kernel`` ("ss"): ``Y[BM, BN]`` tile, decoded weight through shared memory (prefill).
* ``_splice_gemv1_kernel`` ("gemv", M = 1): no MMA, weight read as 32-bit words, PTX decode.
* ``_splice_gemv_kernel`` ("gemv", M = 2..4): the FMA form on bytes.

Layout and numerics (swap form)
-------------------------------
* The kernel computes the transposed tile ``Yᵀ[BN, BM]`` ("swap AB"): the weight, dequantized in
  registers, is the left operand of the MMA (on Hopper the register operand of ``wgmma``), the
  activation tile the right operand. For decode (M <= 16) this puts the large dimension N on the
  MMA's M side, so a 16-row activation costs no padding to 64.
* FP4 tiles are decoded with integer ops into fp16 holding ``e2m1 * 2^-14`` (E2M1 bits placed in
  fp16's exponent/mantissa; the code 1 becomes an fp16 subnormal), then multiplied by the E4M3
  block scale (decoded the same way). All of these products are exact in fp16: the MMA sees the
  exact ``q * s`` values (times a power of two) and accumulates in fp32.
* The global scales (per-row activation ``gs_a[m]``, per-output-row weight ``gs_w[n]``) are
  applied once to the accumulator after the FP4 K-tiles; the loop then continues over the BF16
  channel segment (``k`` gathered columns of X against ``W_bf16``) into the same accumulator;
  the bias is added last. The order of operations is the reference's (FP4 part, + BF16 part,
  + bias, in fp32).

Operand modes (constexpr)
-------------------------
* ``A_QUANT and A_FP4``: A is the packed NVFP4 activation (uint8 [M, K/2] + E4M3 [M, K/16]),
  decoded in registers like W (decode datapath).
* ``A_QUANT and not A_FP4``: A is the dequantized activation ``q * s`` in fp16 [M, K] written by the
  activation-quantization kernel (exact values; prefill datapath, where re-decoding A in every
  N tile would double the decode work).
* ``not A_QUANT``: W4A16, A is X itself (bf16 or fp16; the FP4 weight is decoded to X's dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act_quant import _e2m1_f16, _global_scale, _quant_block


@triton.jit
def _e4m3_f16(sb):
    """fp16 value of non-negative E4M3 bytes ``sb`` (int32): the byte shifted into fp16's exponent and
    mantissa fields is the value times 2^-8 (subnormals included), so one exact multiply by 256."""
    return ((sb << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0).to(tl.float16)


@triton.jit
def _fp4_tile(p, sb, R: tl.constexpr, BK: tl.constexpr):
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
def _mma(a, b, acc, INTERP: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation. Triton's CPU interpreter multiplies bf16 operands as
    raw integers (triton 3.9), so under the interpreter the (exact) operands are widened to fp32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bf16_rne(x, INTERP: tl.constexpr):
    """Round fp32 ``x`` to bf16 (nearest, ties to even). Triton's interpreter (3.9) truncates in
    ``.to(tl.bfloat16)``, so there the rounding is done on the bits (finite inputs) and the result
    is returned as the fp32 value; on the GPU the native conversion is used."""
    if INTERP:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in the grouped order of Triton's matmul tutorial: GROUP_M
    M-tiles walk the N-tiles together, so their weight tiles are reused from L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % gsize, (pid % per_group) // gsize


@triton.jit
def _splice_gemm_kernel(
    a_ptr, stride_am, stride_ak,  # A: fp16 deq / X [M, K], or packed uint8 [M, K/2] (A_FP4)
    as_ptr, stride_asm,  # A scale bytes uint8 [M, K/16] (A_FP4)
    a_gs_ptr,  # fp32 [M] activation global scale (A_QUANT)
    x_ptr, stride_xm, stride_xk,  # X [M, K], source of the BF16 segment
    ch_ptr,  # int32 [KS] channel indices
    wp_ptr, stride_wpn,  # W packed uint8 [N, K/2]
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N] weight global scale per output row
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,  # [N]
    out_ptr, stride_om, stride_on,  # [M, N] (or the fp32 split-K workspace [SPLIT, M, N] when SPLIT)
    M, N, K, KS,
    GROUPS_PER_SPLIT,  # K/16-groups per split (a multiple of BLOCK_K/16); grid axis 1 = split index
    A_QUANT: tl.constexpr,
    A_FP4: tl.constexpr,
    DOT_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)  # wrapped rows: loads need no mask along M/N
    rn = (offs_n % N).to(tl.int64)

    G: tl.constexpr = BLOCK_K // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    KG = K // 16
    kg_start = pid_k * GROUPS_PER_SPLIT
    kg_end = tl.minimum(KG, kg_start + GROUPS_PER_SPLIT)

    w_ptrs = wp_ptr + rn[:, None, None] * stride_wpn + g[None, :, None] * 8 + j8[None, None, :]
    ws_ptrs = ws_ptr + rn[:, None] * stride_wsn + g[None, :]
    w_ptrs += kg_start * 8
    ws_ptrs += kg_start
    if A_FP4:
        a_ptrs = a_ptr + rm[:, None, None] * stride_am + g[None, :, None] * 8 + j8[None, None, :] + kg_start * 8
        as_ptrs = as_ptr + rm[:, None] * stride_asm + g[None, :] + kg_start
    else:
        k16 = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rm[:, None] * stride_am + (kg_start * 16 + k16)[None, :] * stride_ak

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kg0 in range(kg_start, kg_end, G):
        if EVEN_K:
            p = tl.load(w_ptrs).to(tl.int32)
            sb = tl.load(ws_ptrs).to(tl.int32)
        else:
            gm = (kg0 + g) < KG
            p = tl.load(w_ptrs, mask=gm[None, :, None], other=0).to(tl.int32)
            sb = tl.load(ws_ptrs, mask=gm[None, :], other=0).to(tl.int32)
        w = _fp4_tile(p, sb, BLOCK_N, BLOCK_K)
        if A_FP4:
            if EVEN_K:
                pa = tl.load(a_ptrs).to(tl.int32)
                sa = tl.load(as_ptrs).to(tl.int32)
            else:
                pa = tl.load(a_ptrs, mask=gm[None, :, None], other=0).to(tl.int32)
                sa = tl.load(as_ptrs, mask=gm[None, :], other=0).to(tl.int32)
            a = _fp4_tile(pa, sa, BLOCK_M, BLOCK_K)
            a_ptrs += G * 8
            as_ptrs += G
        else:
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(kg0 * 16 + k16)[None, :] < K, other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            if DOT_BF16:
                w = w.to(tl.bfloat16)
        acc = _mma(w, tl.trans(a), acc, INTERP)
        w_ptrs += G * 8
        ws_ptrs += G

    # global scales, once per tile: products carried 2^-14 per FP4-decoded operand
    wgs = tl.load(w_gs_ptr + rn)
    if A_QUANT:
        ags = tl.load(a_gs_ptr + rm)
        if A_FP4:
            acc = acc * (268435456.0 / (wgs[:, None] * ags[None, :]))
        else:
            acc = acc * (16384.0 / (wgs[:, None] * ags[None, :]))
    else:
        acc = acc * (16384.0 / wgs)[:, None]

    # the spliced BF16 channel segment: more K-steps into the same accumulator
    if HAS_KS:
        if pid_k == 0:
            offs_c = tl.arange(0, BLOCK_KS)
            for c0 in range(0, KS, BLOCK_KS):
                cm = (c0 + offs_c) < KS
                ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
                xs = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :] * stride_xk, mask=cm[None, :], other=0.0)
                wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
                acc = _mma(wb, tl.trans(_bf16_rne(xs.to(tl.float32), INTERP)), acc, INTERP)

    omask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if SPLIT:
        # fp32 partial of this K split; _split_reduce_kernel sums the splits, adds the bias, casts
        part = out_ptr + pid_k.to(tl.int64) * M * N + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(part, acc, mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None].to(tl.int64) * stride_on
        if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
            acc = _bf16_rne(acc, INTERP)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)

@triton.jit
def _split_reduce_kernel(ws_ptr, bias_ptr, out_ptr, stride_om, stride_on, M, N, SPLITS,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """out[m, n] = sum_s ws[s, m, n] (+ bias[n]), cast to out's dtype. ws: fp32 [SPLITS, M, N]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    m = offs // N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _bf16_rne(acc, INTERP)
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# decode datapath, GEMV form (M <= 4): no MMA, the weight streamed straight into registers
# ---------------------------------------------------------------------------------------------


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
def _e4m3_f32(sb):
    """fp32 value of non-negative E4M3 bytes ``sb`` (int32), decoded through fp16 (exact)."""
    return _e4m3_f16(sb).to(tl.float32)


@triton.jit
def _splice_gemv_kernel(
    x_ptr, stride_xm, stride_xk,  # X [M, K]: the A operand in W4A16 mode, and the BF16 segment's source
    a_ptr, stride_am,  # A_MODE 1: fp16 [M, K] = q*s written by the quantization kernel
    a_gs_ptr,  # A_MODE 1: fp32 [M] activation global scales
    ch_ptr,  # int32 [KS] channel indices
    wp_ptr, stride_wpn,  # W packed uint8 [N, K/2]
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N]
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,  # [N]
    out_ptr, stride_om, stride_on,  # [M, N]
    M, N, K, KS,
    A_MODE: tl.constexpr,  # 0: W4A16 (A = X); 1: A = fp16 q*s + gs
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    INTERP: tl.constexpr,
):
    """``Y[m, n] = sum_k deq(A)[m, k] deq(W)[n, k] (+ X[m, S] . W_bf16[n]) (+ bias)`` for 2..BM rows
    (one row takes :func:`_splice_gemv1_kernel`).

    One program owns BN output rows and all of K (no split: the N/BN programs already cover the
    GPU for N >= 4096). Per K step it loads the packed weight [BN, BK/2] and the scale bytes
    [BN, BK/16] straight into registers, decodes each nibble with integer ops, multiplies by the
    activation in fp32 (exact products, fp32 sums), reduces each 16-element group and scales the
    group sum by its E4M3 block scale: one multiply per 16 weights instead of one per weight.
    """
    pid_n = tl.program_id(0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rn = (offs_n % N).to(tl.int64)
    rows = tl.arange(0, BM)
    rm = (rows % M).to(tl.int64)
    G: tl.constexpr = BK // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    h2 = tl.arange(0, 2)
    KG = K // 16

    w_ptrs = wp_ptr + rn[:, None, None] * stride_wpn + g[None, :, None] * 8 + j8[None, None, :]
    ws_ptrs = ws_ptr + rn[:, None] * stride_wsn + g[None, :]
    acc = tl.zeros((BM, BN, G), dtype=tl.float32)
    # the weight tile of the next step is loaded before this step's arithmetic (register double
    # buffer): the loads of one program then cover two tiles, which the H200 needs in flight
    gm = g < KG
    p_nx = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
    sb_nx = tl.load(ws_ptrs, mask=gm[None, :], other=0)
    for kg0 in range(0, KG, G):
        p8 = p_nx
        sb = sb_nx.to(tl.int32)
        w_ptrs += G * 8
        ws_ptrs += G
        gm = (kg0 + G + g) < KG
        p_nx = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
        sb_nx = tl.load(ws_ptrs, mask=gm[None, :], other=0)
        wlo, whi = _e2m1_f16_pair(p8.to(tl.int32))  # [BN, G, 8]
        # activation chunk as [BM, G, 8, 2] (even/odd columns)
        kk = kg0 * 16 + g[:, None, None] * 16 + j8[None, :, None] * 2 + h2[None, None, :]  # [G, 8, 2]
        if A_MODE == 1:
            a_ptrs = a_ptr + rm[:, None, None, None] * stride_am + kk[None, :, :, :]
            if EVEN_K:
                a = tl.load(a_ptrs).to(tl.float32)
            else:
                a = tl.load(a_ptrs, mask=(kk < K)[None, :, :, :], other=0.0).to(tl.float32)
        else:
            a_ptrs = x_ptr + rm[:, None, None, None] * stride_xm + kk[None, :, :, :] * stride_xk
            if EVEN_K:
                a = tl.load(a_ptrs).to(tl.float32)
            else:
                a = tl.load(a_ptrs, mask=(kk < K)[None, :, :, :], other=0.0).to(tl.float32)
        ae, ao = tl.split(a)  # [BM, G, 8]
        part = tl.sum(wlo[None, :, :, :] * ae[:, None, :, :] + whi[None, :, :, :] * ao[:, None, :, :], axis=3)
        acc += part * _e4m3_f32(sb)[None, :, :]

    y = tl.sum(acc, axis=2)  # [BM, BN]
    wgs = tl.load(w_gs_ptr + rn)
    if A_MODE == 0:
        y = y * (16384.0 / wgs)[None, :]
    else:
        ags = tl.load(a_gs_ptr + rm)
        y = y * (16384.0 / (ags[:, None] * wgs[None, :]))

    if HAS_KS:
        offs_c = tl.arange(0, BLOCK_KS)
        ys = tl.zeros((BM, BN, BLOCK_KS), dtype=tl.float32)
        for c0 in range(0, KS, BLOCK_KS):
            cm = (c0 + offs_c) < KS
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
            xs = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :] * stride_xk, mask=cm[None, :], other=0.0)
            xs = _bf16_rne(xs.to(tl.float32), INTERP).to(tl.float32)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0).to(tl.float32)
            ys += xs[:, None, :] * wb[None, :, :]
        y += tl.sum(ys, axis=2)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    omask = (rows[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        y = _bf16_rne(y, INTERP)
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=omask)


# ---------------------------------------------------------------------------------------------
# decode datapath, one row (M = 1): the packed weight read as 32-bit words
# ---------------------------------------------------------------------------------------------


@triton.jit
def _word_nibbles_asm(q):
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
def _word_nibble(q, SHIFT: tl.constexpr):
    """fp32 ``e2m1 * 2^-14`` of the nibble at bit ``SHIFT`` of int32 words ``q`` (portable twin of
    :func:`_word_nibbles_asm`, used by the interpreter)."""
    return _e2m1_f16((q >> SHIFT) & 15).to(tl.float32)


@triton.jit
def _splice_gemv1_kernel(
    x_ptr, stride_xk,  # X [1, K]: the A operand in W4A16 / fused mode, and the BF16 segment's source
    a_ptr,  # A_MODE 1: fp16 [1, K] = q*s
    a_gs_ptr,  # A_MODE 1: fp32 [1]
    smask_ptr,  # A_MODE 2: uint8 [K]
    gs_in_ptr,  # A_MODE 2 and STATIC_GS: fp32 [1]
    ch_ptr,  # int32 [KS]
    wq_ptr, stride_wqn,  # W packed as int32 words [N, K/8] (the uint8 [N, K/2] bytes, little-endian)
    ws_ptr, stride_wsn,  # W scale bytes uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N]
    wb_ptr, stride_wbn,  # W_bf16 [N, KS]
    bias_ptr,
    out_ptr, stride_on,  # [1, N]
    N, K, KS,
    A_MODE: tl.constexpr,
    STATIC_GS: tl.constexpr,
    DIV6_RECIP: tl.constexpr,
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
    buffer). The activation row is quantized in the kernel when A_MODE is 2.
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

    if A_MODE == 2:
        if STATIC_GS:
            gs = tl.load(gs_in_ptr)
        else:
            ok = tl.arange(0, BK)
            amax_v = tl.zeros((BK,), tl.float32)
            for k0 in range(0, K, BK):
                km = (k0 + ok) < K
                xv = tl.load(x_ptr + (k0 + ok) * stride_xk, mask=km, other=0.0).to(tl.float32)
                sm = tl.load(smask_ptr + k0 + ok, mask=km, other=0)
                amax_v = tl.maximum(amax_v, tl.where(sm != 0, 0.0, tl.abs(xv)))
            gs = _global_scale(tl.max(amax_v, axis=0))

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
        if A_MODE == 2:
            kq = k0 + kb
            sm = tl.load(smask_ptr + kq, mask=kq < K, other=0)
            av = tl.where(sm != 0, 0.0, av)
            _pk, _sbq, av = _quant_block(av, gs, BK, DIV6_RECIP)
        a4, b4 = tl.split(tl.reshape(av, (G2, 4, 4, 2)))  # j even / odd: [G2, 4, 4]
        a40, a42 = tl.split(tl.reshape(a4, (G2, 4, 2, 2)))  # j = 0,4 | 2,6 -> [G2, 4, 2]
        b41, b43 = tl.split(tl.reshape(b4, (G2, 4, 2, 2)))  # j = 1,5 | 3,7
        x0, x4 = tl.split(a40)
        x2, x6 = tl.split(a42)
        x1, x5 = tl.split(b41)
        x3, x7 = tl.split(b43)
        if USE_ASM:
            d0, d1, d2, d3, d4, d5, d6, d7 = _word_nibbles_asm(q)
        else:
            d0 = _word_nibble(q, 0)
            d1 = _word_nibble(q, 4)
            d2 = _word_nibble(q, 8)
            d3 = _word_nibble(q, 12)
            d4 = _word_nibble(q, 16)
            d5 = _word_nibble(q, 20)
            d6 = _word_nibble(q, 24)
            d7 = _word_nibble(q, 28)
        part = d0 * x0[None, :, :]
        part += d1 * x1[None, :, :]
        part += d2 * x2[None, :, :]
        part += d3 * x3[None, :, :]
        part += d4 * x4[None, :, :]
        part += d5 * x5[None, :, :]
        part += d6 * x6[None, :, :]
        part += d7 * x7[None, :, :]  # [BN, G2, 4]: one word's 8 products
        grp = tl.sum(tl.reshape(part, (BN, G2, 2, 2)), axis=3)  # words (0,1) | (2,3) -> [BN, G2, 2]
        acc += grp * _e4m3_f32(sb)

    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    wgs = tl.load(w_gs_ptr + rn)
    if A_MODE == 0:
        y = y * (16384.0 / wgs)
    elif A_MODE == 1:
        y = y * (16384.0 / (tl.load(a_gs_ptr) * wgs))
    else:
        y = y * (16384.0 / (gs * wgs))
    if HAS_KS:
        ys = wb0.to(tl.float32) * _bf16_rne(xs0.to(tl.float32), INTERP).to(tl.float32)[None, :]
        for c0 in range(BLOCK_KS, KS, BLOCK_KS):
            cm = (c0 + offs_c) < KS
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
            xs = _bf16_rne(tl.load(x_ptr + ch * stride_xk, mask=cm, other=0.0).to(tl.float32), INTERP).to(tl.float32)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0).to(tl.float32)
            ys += wb * xs[None, :]
        y += tl.sum(ys, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        y = _bf16_rne(y, INTERP)
    tl.store(out_ptr + offs_n.to(tl.int64) * stride_on, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


# ---------------------------------------------------------------------------------------------
# prefill datapath, SS form: Y[BM, BN] += A[BM, BK] . deq(W)[BN, BK]^T with both MMA operands
# in shared memory (the decoded weight tile is stored once per K step and read by wgmma)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _splice_gemm_ss_kernel(
    a_ptr, stride_am, stride_ak,  # A: fp16 q*s [M, K] (A_QUANT) or X (W4A16)
    a_gs_ptr,  # fp32 [M] (A_QUANT)
    xs_ptr, stride_xsm, stride_xsk,  # BF16 segment source: contiguous X[:, S] [M, KS] (XS_DENSE) or X [M, K]
    ch_ptr,  # int32 [KS] (gather when not XS_DENSE)
    wp_ptr, stride_wpn,
    ws_ptr, stride_wsn,
    w_gs_ptr,
    wb_ptr, stride_wbn,
    bias_ptr,
    out_ptr, stride_om, stride_on,
    M, N, K, KS,
    A_QUANT: tl.constexpr,
    DOT_BF16: tl.constexpr,
    XS_DENSE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    PREFETCH: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Prefill tile ``Y[BM, BN]``: the activation tile is the left MMA operand, the weight tile is
    decoded in registers (``_fp4_tile``: exact ``e2m1*s*2^-14`` in fp16) and becomes the right
    operand through shared memory. The BF16 segment follows as extra K steps on the same
    accumulator, reading X[:, S] from the contiguous copy the quantization kernel wrote."""
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    G: tl.constexpr = BLOCK_K // 16
    g = tl.arange(0, G)
    j8 = tl.arange(0, 8)
    k16 = tl.arange(0, BLOCK_K)
    KG = K // 16

    w_ptrs = wp_ptr + rn[:, None, None] * stride_wpn + g[None, :, None] * 8 + j8[None, None, :]
    ws_ptrs = ws_ptr + rn[:, None] * stride_wsn + g[None, :]
    a_ptrs = a_ptr + rm[:, None] * stride_am + k16[None, :] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        gm = g < KG
        p_nx = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
        sb_nx = tl.load(ws_ptrs, mask=gm[None, :], other=0)
    for kg0 in range(0, KG, G):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(kg0 * 16 + k16)[None, :] < K, other=0.0)
        if PREFETCH:
            # the packed weight of the next step is loaded before this step's decode and MMA
            p = p_nx.to(tl.int32)
            sb = sb_nx.to(tl.int32)
            gm = (kg0 + G + g) < KG
            p_nx = tl.load(w_ptrs + G * 8, mask=gm[None, :, None], other=0)
            sb_nx = tl.load(ws_ptrs + G, mask=gm[None, :], other=0)
        elif EVEN_K:
            p = tl.load(w_ptrs).to(tl.int32)
            sb = tl.load(ws_ptrs).to(tl.int32)
        else:
            gm = (kg0 + g) < KG
            p = tl.load(w_ptrs, mask=gm[None, :, None], other=0).to(tl.int32)
            sb = tl.load(ws_ptrs, mask=gm[None, :], other=0).to(tl.int32)
        w = _fp4_tile(p, sb, BLOCK_N, BLOCK_K)
        if DOT_BF16:
            w = w.to(tl.bfloat16)
        acc = _mma(a, tl.trans(w), acc, INTERP)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += G * 8
        ws_ptrs += G

    wgs = tl.load(w_gs_ptr + rn)
    if A_QUANT:
        ags = tl.load(a_gs_ptr + rm)
        acc = acc * (16384.0 / (ags[:, None] * wgs[None, :]))
    else:
        acc = acc * (16384.0 / wgs)[None, :]

    if HAS_KS:
        offs_c = tl.arange(0, BLOCK_KS)
        for c0 in range(0, KS, BLOCK_KS):
            cm = (c0 + offs_c) < KS
            if XS_DENSE:
                xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + (c0 + offs_c)[None, :] * stride_xsk, mask=cm[None, :], other=0.0)
            else:
                ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
                xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + ch[None, :] * stride_xsk, mask=cm[None, :], other=0.0)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
            acc = _mma(_bf16_rne(xs.to(tl.float32), INTERP).to(tl.bfloat16), tl.trans(wb), acc, INTERP)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _bf16_rne(acc, INTERP)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
