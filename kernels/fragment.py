"""Kernel form: the fragment-layout swap-AB SpliceGEMM tile (``_fragment_gemm_kernel``), the decode
datapath for BF16 activations. Reference: :func:`foursight.layer.reference_linear`.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``, computed as ``Yᵀ[BN, BM]`` with the
decoded weight as the register operand of ``wgmma`` (swap-AB, tokens on the narrow side).

Why this form exists: in the plain swap form the weight is decoded in the layout the load chose and
then moved through shared memory into the wgmma fragment layout; that conversion costs more than
the decode. Here the weight's execution form (:mod:`.fragment_layout`: built once, offline) puts
every thread's codes where its fragment needs them, so the decoded tile *is* the fragment
(:func:`~.fragment_layout.fragment_tile`). The activation operand is the exact bf16 ``q · s`` of
:mod:`.act_quant` (W4A4) or X itself (W4A16); the global scales and the ``2^7`` are applied once to
the fp32 accumulator, then the BF16 channel segment is added into it, then the bias: the
reference's order. The split-K plan is :mod:`.split_k`; the in-kernel reduction is
:func:`~.tile_steps.split_k_epilogue`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import static_global_scale
from .fragment_layout import FRAG_COLS, fragment_of, fragment_tile, scale_view
from .primitives import DIV6_RECIP_ON_CUDA, mma, prefetch_l2, quant_xb_2d, tile_ids
from .runtime import interpreting, resident_programs
from .split_k import segment_plan, split_counters, split_plan
from .tile_steps import split_k_epilogue


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _a_tile(a_ptr, stride_am, smask_ptr, q_gs, k0, K, rm, offs_m, ok, M, BLOCK_M: tl.constexpr, A_ROWS: tl.constexpr,
            QUANT_IN: tl.constexpr, DIV6_RECIP: tl.constexpr, A_ZFILL: tl.constexpr):
    """The activation tile [BLOCK_M, BLOCK_K] of columns ``k0 + ok``: ``BLOCK_M`` rows loaded (``A_ROWS``
    0), or only ``A_ROWS`` rows (the first ``A_ROWS`` >= M) loaded and repeated to ``BLOCK_M`` (row r is
    row r % A_ROWS; rows >= M are never stored). ``QUANT_IN``: ``a_ptr`` is X and the rows are
    quantized here with the static global scale ``q_gs``, with the standalone quantizer's primitives
    (bit-identical ``q * s``), S columns zeroed from ``smask_ptr``. ``A_ZFILL`` (with ``A_ROWS`` 0): the
    rows ``offs_m`` >= M are masked, so their copies zero-fill shared memory instead of re-reading row 0;
    the tile goes straight from the loads into the MMA operand (no store of its own, no extra barrier)."""
    kmask = (k0 + ok) < K
    if A_ZFILL:
        a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 + ok)[None, :], mask=(offs_m < M)[:, None] & kmask[None, :],
                    other=0.0)
    elif A_ROWS == 0:
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
def _xs_tile(x_ptr, stride_xm, ch_ptr, rm, offs_m, k0, hi, M, BLOCK_M: tl.constexpr, BLOCK_KS: tl.constexpr,
             A_ROWS: tl.constexpr, DENSE: tl.constexpr, A_ZFILL: tl.constexpr):
    """``X[:, S]`` columns ``k0 .. k0 + BLOCK_KS`` (< ``hi``) gathered from X by channel index: [BLOCK_M, BLOCK_KS]
    (``A_ROWS`` > 0: those rows loaded and repeated, as :func:`_a_tile`). ``DENSE``: ``x_ptr`` is ``X[:, S]``
    itself, contiguous [M, KS] (the quantizer's copy): read by column, no channel index. ``A_ZFILL``: rows
    ``offs_m`` >= M masked (zero-filled), as :func:`_a_tile`'s."""
    offs_c = tl.arange(0, BLOCK_KS)
    cm = (k0 + offs_c) < hi
    if DENSE:
        ch = (k0 + offs_c).to(tl.int64)
    else:
        ch = tl.load(ch_ptr + k0 + offs_c, mask=cm, other=0).to(tl.int64)
    if A_ZFILL:
        xs = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :], mask=(offs_m < M)[:, None] & cm[None, :], other=0.0)
    elif A_ROWS == 0:
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
    DIV6_RECIP: tl.constexpr = False,  # QUANT_IN: the block-scale division as on CUDA (primitives.DIV6_RECIP_ON_CUDA)
    PERSISTENT: tl.constexpr = False,  # grid axis 0 walks the TILES x SPLITS work items with stride num_programs
    SEG_LATE: tl.constexpr = False,  # the BF16 columns' loads follow the FP4 loop (W[:, S] prefetched into L2 before it)
    XS_DENSE: tl.constexpr = False,  # x_ptr is X[:, S] contiguous [M, KS] (the quantizer's copy), not X
    A_ZFILL: tl.constexpr = False,  # the activation rows >= M masked: zero-filled copies (see _a_tile)
):
    if PERSISTENT:
        for work in range(tl.program_id(0), TILES * SPLITS, tl.num_programs(0)):
            _fragment_work(work % TILES, work // TILES,
                           a_ptr, stride_am, a_gs_ptr, x_ptr, stride_xm, ch_ptr, wf_ptr, stride_wfn, sf_ptr, stride_sfn,
                           w_gs_ptr, wb_ptr, stride_wbn, bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLITS,
                           M, N, K, KS, CHUNKS_PER_SPLIT, FIRST_CHUNKS, KCP, NP, smask_ptr, SEG_PER_SPLIT,
                           A_QUANT, HAS_BIAS, HAS_KS, SPLIT, SCALE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_KS, GROUP_M,
                           INTERP, GDC_WAIT, PREFETCH_CHUNKS, A_ROWS, QUANT_IN, DIV6_RECIP, SEG_LATE, XS_DENSE, A_ZFILL)
    else:
        _fragment_work(tl.program_id(0), tl.program_id(1),
                       a_ptr, stride_am, a_gs_ptr, x_ptr, stride_xm, ch_ptr, wf_ptr, stride_wfn, sf_ptr, stride_sfn,
                       w_gs_ptr, wb_ptr, stride_wbn, bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, SPLITS,
                       M, N, K, KS, CHUNKS_PER_SPLIT, FIRST_CHUNKS, KCP, NP, smask_ptr, SEG_PER_SPLIT,
                       A_QUANT, HAS_BIAS, HAS_KS, SPLIT, SCALE_BF16, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_KS, GROUP_M,
                       INTERP, GDC_WAIT, PREFETCH_CHUNKS, A_ROWS, QUANT_IN, DIV6_RECIP, SEG_LATE, XS_DENSE, A_ZFILL)


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
    SEG_LATE: tl.constexpr, XS_DENSE: tl.constexpr, A_ZFILL: tl.constexpr,
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
        if SEG_LATE:
            # nothing here that the FP4 stream would wait for: Triton stores a dot operand to shared memory
            # where it is loaded, so a column tile loaded here holds the loop's first copies until it has
            # arrived (and X[:, S]'s gather first waits for the channel indices). Only this split's W[:, S]
            # rows are pulled into L2 (a hint, no register); the loads follow the loop, next to the scales'
            if not INTERP:
                if seg_lo < seg_hi:
                    w_row = wb_ptr + rn * stride_wbn
                    prefetch_l2(w_row + seg_lo)
                    prefetch_l2(w_row + seg_hi - 1)
        else:
            wb0 = tl.load(wb_ptr + rn[:, None] * stride_wbn + (seg_lo + offs_c)[None, :],
                          mask=((seg_lo + offs_c) < seg_hi)[None, :], other=0.0)
            xs0 = _xs_tile(x_ptr, stride_xm, ch_ptr, rm, offs_m, seg_lo, seg_hi, M, BLOCK_M, BLOCK_KS, A_ROWS, XS_DENSE, A_ZFILL)

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
        a = _a_tile(a_ptr, stride_am, smask_ptr, q_gs, c0 * 128, K, rm, offs_m, ok, M, BLOCK_M, A_ROWS, QUANT_IN, DIV6_RECIP,
                    A_ZFILL)
        acc = mma(w, tl.trans(a), acc, INTERP)
        w_ptrs += WB
        s_ptrs += G

    if HAS_KS:
        if SEG_LATE:  # issued together with the global scales' loads below: one round trip for all
            xs0 = _xs_tile(x_ptr, stride_xm, ch_ptr, rm, offs_m, seg_lo, seg_hi, M, BLOCK_M, BLOCK_KS, A_ROWS, XS_DENSE, A_ZFILL)
            wb0 = tl.load(wb_ptr + rn[:, None] * stride_wbn + (seg_lo + offs_c)[None, :],
                          mask=((seg_lo + offs_c) < seg_hi)[None, :], other=0.0)
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
            xs = _xs_tile(x_ptr, stride_xm, ch_ptr, rm, offs_m, k0, seg_hi, M, BLOCK_M, BLOCK_KS, A_ROWS, XS_DENSE, A_ZFILL)
            wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (k0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
            acc = mma(wb, tl.trans(xs), acc, INTERP)

    split_k_epilogue(acc, pid, pid_k, offs_m, offs_n, rn, M, N, SPLITS, ws_ptr, cnt_ptr, bias_ptr, out_ptr, stride_om,
                     SPLIT, HAS_BIAS, BLOCK_M, BLOCK_N, INTERP)


#: resident programs of each compiled variant of the kernel, by (device, variant key)
RESIDENT_SLOTS: dict = {}


def _resident_slots(device, key, compile_fn, num_warps: int = 4) -> int:
    """:func:`~.runtime.resident_programs` of one compiled variant (``compile_fn`` compiles it
    without launching it), cached per device and ``key``."""
    ck = (str(device), key)
    if ck not in RESIDENT_SLOTS:
        RESIDENT_SLOTS[ck] = resident_programs(device, compile_fn, num_warps)
    return RESIDENT_SLOTS[ck]



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


def fragment_launch(cfg, a, a_gs, x, pw, bias, out, a_quant: bool, pdl: bool = False, quant_in: bool = False,
                    xs=None):
    """Launch the fragment kernel (one launch; with split-K the last split of each tile reduces).

    ``a``: the bf16 ``q*s`` activation (``a_quant``, ``a_gs`` its per-row global scales) or X itself
    (W4A16, bf16); ``x``: the source of the BF16 segment's columns (bf16, unit stride along K), read by
    channel index (loaded before the FP4 loop). ``quant_in``: ``a`` is X and the kernel quantizes it
    (``a_gs`` the static global scale, fp32 [1]; at most :data:`QUANT_IN_MAX_M` rows).
    ``pdl`` (opt-in, ``FOURSIGHT_PDL=1``): launched with programmatic dependent launch right after the
    activation quantizer (which called ``gdc_launch_dependents``): each program prefetches its first
    weight chunks into L2 and then waits for the quantizer (``gdc_wait``) before it reads ``a``.
    ``cfg.narrow``: only ``a_rows_for(M)`` activation rows are loaded; ``cfg.zfill``: the rows >= M are masked
    loads (zero-filled copies straight into the MMA operand); ``cfg.persistent``: as many
    programs as fit at once walk the (tile, split) work items. ``cfg.cols_late``: the BF16 columns are
    loaded after the FP4 loop, their W[:, S] rows prefetched into L2 before it, one step per split where
    the share allows (:func:`~.split_k.segment_plan`). ``xs``: ``X[:, S]`` contiguous [M, k] (the
    quantizer's ``write_xs`` copy), read densely instead of gathered from ``x`` by channel index."""
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
    xs_dense = xs is not None and kk > 0
    if xs_dense and (xs.dtype != torch.bfloat16 or tuple(xs.shape) != (m, kk) or xs.stride(1) != 1):
        raise ValueError(f"fragment_launch: xs must be X[:, S] as bf16 [{m}, {kk}] with unit column stride, "
                         f"got {xs.dtype} {tuple(xs.shape)} strides {xs.stride()}")
    consts = dict(A_QUANT=a_quant, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SCALE_BF16=fw.scale_bf16,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_KS=16,
                  GROUP_M=8, INTERP=interpreting(), A_ROWS=a_rows, QUANT_IN=quant_in,
                  DIV6_RECIP=DIV6_RECIP_ON_CUDA if x.is_cuda else False, PERSISTENT=cfg.persistent)
    if cfg.cols_late or xs_dense:  # only then: the other tiles' compiled variants keep their cache keys
        consts.update(SEG_LATE=cfg.cols_late, XS_DENSE=xs_dense)
    if cfg.zfill:
        consts["A_ZFILL"] = True
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
                xs if xs_dense else x, xs.stride(0) if xs_dense else x.stride(0),
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
    consts["BLOCK_KS"], seg = segment_plan(kk, splits, late=cfg.cols_late)
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else dummy
    cnt = split_counters(out.device, tiles) if splits > 1 else dummy
    grid = (min(tiles * splits, slots), 1) if cfg.persistent else (tiles, splits)
    return _fragment_gemm_kernel[grid](*args(ws, cnt, splits, cps, first, seg), SPLIT=splits > 1, **consts, **opts)


def launch(cfg, ops, pw, bias, out, pdl: bool = False):
    """The form's launch in the kernel-form table's signature (:class:`~.forms.Operands` ``ops``)."""
    return fragment_launch(cfg, ops.a.contiguous(), ops.a_gs, ops.x.contiguous(), pw, bias, out, ops.a_quant, pdl=pdl,
                           xs=ops.xs)


def quant_in_linear(cfg, x2, pw, bias, input_global_scale, out) -> bool:
    """W4A4 with ``cfg.quant_in``, a static activation scale and M <= :data:`QUANT_IN_MAX_M`: no quantizer launch,
    every GEMM program quantizes the activation slice it reads. Whether it ran (False where that does not apply)."""
    if not (cfg.quant_in and input_global_scale is not None and x2.shape[0] <= QUANT_IN_MAX_M):
        return False
    xc = x2.contiguous()
    fragment_launch(cfg, xc, static_global_scale(input_global_scale, x2.device), xc, pw, bias, out, True, quant_in=True)
    return True
