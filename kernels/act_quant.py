"""Kernel form: fused NVFP4 activation quantization (``_act_quant_kernel``).

Reference: :func:`foursight.layer.quantize_activation` (bit-exact on the same device).

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
* ``x_bf16`` [M, k] = ``X[:, S]`` in the input dtype,
* with ``FQ``, instead of ``deq``: the bf16 fake-quantized activation ``q · s · post / gs`` with
  ``X[:, S]`` at the S columns (the A operand of the dequantize-then-cuBLAS datapath, :mod:`.dequant`).

Bit-exactness with :func:`foursight.layer.quantize_activation` (compressed-tensors'
convention) *on the same device* rests on: ``448*6/amax`` computed as ``2688 * (1/amax)`` (PyTorch
evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``), ``block_amax / 6`` as a true
division on CPU but as a multiplication by ``fp32(1/6)`` on CUDA (ATen's ``div_true_kernel_cuda``
does that for a CPU-scalar divisor; ``DIV6_RECIP``), IEEE round-to-nearest division (``div_rn``,
not Triton's approximate ``/``) for ``eff = s / gs``, the operation orders ``gs * (amax / 6)`` and
``x / (s / gs)``, an explicit round-to-nearest-even to E4M3 done with integer arithmetic (so the
interpreter and the GPU agree), a zero scale replaced by 0.125, and E2M1 rounding with ties to even
and the sign of -0 kept.

The instruction counts behind this design and the reasons for each choice (why ``div_rn`` stays
per element, when several rows per program pay) are in docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error

from .primitives import DIV6_RECIP_ON_CUDA, MAX_ONEPASS_K, global_scale, quant_block, quant_xb, quant_xb_2d, rne_bf16
from .runtime import interpreting

#: up to this many rows (decode batches) one row runs on 32 warps: on the H200 at K = 8192 that took
#: 4.1-4.6 us against 6.0-6.8 us on 8 (benchmarks/kernels/probe_fragment.py; docs/kernels.md)
FEW_ROWS: int = 128


@triton.jit
def _act_quant_kernel(
    x_ptr, stride_xm, stride_xk,
    smask_ptr,  # uint8 [K]: 1 for columns in S
    ch_ptr,  # int32 [KS]
    gs_in_ptr,  # fp32 [1] static global scale (used when STATIC_GS)
    packed_ptr, scale_ptr,  # uint8 [M, K/2], uint8 [M, K/16] (contiguous)
    deq_ptr,  # fp16 or bf16 [M, K] (contiguous)
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
    post_ptr=None,  # FQ: fp32 [1], an extra factor folded into the fake-quantized value (1/gs_w or 1)
    FQ: tl.constexpr = False,  # WRITE_DEQ writes the bf16 fake-quantized row instead of fp16 q*s (ROWS == 1)
    LAUNCH_DEPS: tl.constexpr = False,  # PDL: let the GEMM that reads this output start (it waits for us)
    COLS: tl.constexpr = 1,  # programs per row (grid axis 1; ROWS == 1, ONE_PASS, not FQ): each quantizes BLOCK_K / COLS columns
):
    if LAUNCH_DEPS:
        # the dependent GEMM may be scheduled now; it only prefetches weights until its gdc_wait,
        # which returns once this whole grid has completed and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()
    if COLS > 1:
        _act_quant_row_part(
            x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
            gs_out_ptr, xs_ptr, K, KS, BLOCK_K, HAS_CH, STATIC_GS, WRITE_PACKED, WRITE_DEQ,
            WRITE_XS, BLOCK_KS, DIV6_RECIP, COLS,
        )
    elif ROWS == 1:
        _act_quant_row(
            x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
            gs_out_ptr, xs_ptr, K, KS, BLOCK_K, ONE_PASS, HAS_CH, STATIC_GS, WRITE_PACKED, WRITE_DEQ,
            WRITE_XS, BLOCK_KS, DIV6_RECIP, post_ptr, FQ,
        )
    else:
        _act_quant_rows(
            x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
            gs_out_ptr, xs_ptr, K, KS, M, BLOCK_K, ONE_PASS, HAS_CH, STATIC_GS, WRITE_PACKED, WRITE_DEQ,
            WRITE_XS, BLOCK_KS, DIV6_RECIP, ROWS,
        )


#: the kernel itself, public for the tests that launch it with their own grid (one program's share of
#: a row, the reference launch); its compiled name (ncu, SASS) stays ``_act_quant_kernel``
act_quant_kernel = _act_quant_kernel


@triton.jit
def _act_quant_row(
    x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
    gs_out_ptr, xs_ptr, K, KS,
    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HAS_CH: tl.constexpr, STATIC_GS: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_XS: tl.constexpr, BLOCK_KS: tl.constexpr,
    DIV6_RECIP: tl.constexpr, post_ptr, FQ: tl.constexpr,
):
    """One row per program (``ROWS == 1``). With ``FQ`` the ``deq`` output is the bf16 row
    ``X[:, S]`` at the S columns and ``q * s * post / gs`` elsewhere (the fake-quantized activation
    of the dequantize-then-cuBLAS datapath, :mod:`foursight.kernels.dequant`)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if STATIC_GS:
        gs = tl.load(gs_in_ptr)
    if FQ:
        post = tl.load(post_ptr)
    if ONE_PASS:
        kmask = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=kmask, other=0.0).to(tl.float32)
        x_in = x
        if HAS_CH:
            sm = tl.load(smask_ptr + offs, mask=kmask, other=0)
            x = tl.where(sm != 0, 0.0, x)
        xb = tl.reshape(x, (BLOCK_K // 16, 16))
        bamax = tl.max(tl.abs(xb), axis=1)
        if not STATIC_GS:
            gs = global_scale(tl.max(bamax, axis=0))
        packed, sbyte, deq = quant_xb(xb, bamax, gs, BLOCK_K, DIV6_RECIP)
        if WRITE_PACKED:
            offs_p = tl.arange(0, BLOCK_K // 2)
            tl.store(packed_ptr + row * (K // 2) + offs_p, packed.to(tl.uint8), mask=offs_p < K // 2)
            offs_s = tl.arange(0, BLOCK_K // 16)
            tl.store(scale_ptr + row * (K // 16) + offs_s, sbyte.to(tl.uint8), mask=offs_s < K // 16)
        if WRITE_DEQ:
            if FQ:
                fq = deq * (post / gs)
                if HAS_CH:
                    fq = tl.where(sm != 0, x_in, fq)
                tl.store(deq_ptr + row * K + offs, rne_bf16(fq).to(tl.bfloat16), mask=kmask)
            else:
                tl.store(deq_ptr + row * K + offs, deq.to(deq_ptr.dtype.element_ty), mask=kmask)
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
            gs = global_scale(tl.max(amax_v, axis=0))
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + offs) < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=kmask, other=0.0).to(tl.float32)
            x_in = x
            if HAS_CH:
                sm = tl.load(smask_ptr + k0 + offs, mask=kmask, other=0)
                x = tl.where(sm != 0, 0.0, x)
            packed, sbyte, deq = quant_block(x, gs, BLOCK_K, DIV6_RECIP)
            if WRITE_PACKED:
                offs_p = tl.arange(0, BLOCK_K // 2)
                tl.store(packed_ptr + row * (K // 2) + k0 // 2 + offs_p, packed.to(tl.uint8), mask=(k0 // 2 + offs_p) < K // 2)
                offs_s = tl.arange(0, BLOCK_K // 16)
                tl.store(scale_ptr + row * (K // 16) + k0 // 16 + offs_s, sbyte.to(tl.uint8), mask=(k0 // 16 + offs_s) < K // 16)
            if WRITE_DEQ:
                if FQ:
                    fq = deq * (post / gs)
                    if HAS_CH:
                        fq = tl.where(sm != 0, x_in, fq)
                    tl.store(deq_ptr + row * K + k0 + offs, rne_bf16(fq).to(tl.bfloat16), mask=kmask)
                else:
                    tl.store(deq_ptr + row * K + k0 + offs, deq.to(deq_ptr.dtype.element_ty), mask=kmask)
    tl.store(gs_out_ptr + row, gs)
    if WRITE_XS:
        _store_xs(x_row, stride_xk, ch_ptr, xs_ptr, row, KS, 0, BLOCK_KS, BLOCK_KS)


@triton.jit
def _xs_load(x_row, stride_xk, ch_ptr, c0, KS, BLOCK: tl.constexpr):
    """``X[row, S]`` at channels ``c0 .. c0 + BLOCK`` (masked at ``KS``): the channel indices, then one
    gather by them."""
    offs_c = c0 + tl.arange(0, BLOCK)
    cmask = offs_c < KS
    ch = tl.load(ch_ptr + offs_c, mask=cmask, other=0)
    return tl.load(x_row + ch.to(tl.int64) * stride_xk, mask=cmask, other=0.0)


@triton.jit
def _xs_put(xs_ptr, row, KS, c0, xv, BLOCK: tl.constexpr):
    """Store a tile of :func:`_xs_load` at its place in the dense ``xs`` [M, KS]."""
    offs_c = c0 + tl.arange(0, BLOCK)
    tl.store(xs_ptr + row * KS + offs_c, xv, mask=offs_c < KS)


@triton.jit
def _store_xs(x_row, stride_xk, ch_ptr, xs_ptr, row, KS, start, step, BLOCK: tl.constexpr):
    """``X[row, S]`` gathered by channel index and stored contiguous (the SS form's operand), tiles of
    ``BLOCK`` channels at ``start, start + step, ...`` below ``KS``: the whole row from one program
    (``start = 0, step = BLOCK``) or a part's share of it (:func:`_act_quant_row_part`)."""
    for c0 in range(start, KS, step):
        _xs_put(xs_ptr, row, KS, c0, _xs_load(x_row, stride_xk, ch_ptr, c0, KS, BLOCK), BLOCK)


@triton.jit
def _act_quant_row_part(
    x_ptr, stride_xm, stride_xk, smask_ptr, ch_ptr, gs_in_ptr, packed_ptr, scale_ptr, deq_ptr,
    gs_out_ptr, xs_ptr, K, KS,
    BLOCK_K: tl.constexpr, HAS_CH: tl.constexpr, STATIC_GS: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_DEQ: tl.constexpr, WRITE_XS: tl.constexpr, BLOCK_KS: tl.constexpr,
    DIV6_RECIP: tl.constexpr, COLS: tl.constexpr,
):
    """Part ``program_id(1)`` of ``COLS`` of one row (K <= MAX_ONEPASS_K): the quantization off the
    critical path at decode, where one program per row is a latency chain (issue 36 item 2). A dynamic
    global scale needs the whole row's amax: each part reads the row once for it (2·K bytes, from L2
    after the first part) and quantizes only its ``BLOCK_K / COLS`` columns, with the same primitives as
    :func:`_act_quant_row` (bit-identical). Part 0 writes the global scale.

    The ``X[:, S]`` copy is spread over the parts: part ``p`` copies the ``BLOCK_KS / COLS`` channels at
    ``p · BLOCK_KS / COLS`` (and every ``BLOCK_KS`` after, when ``KS > BLOCK_KS``), each share stored
    contiguous. Its first tile's two dependent loads (channel indices, then the gather) are issued before
    the quantization's loads and stored at the end, so they overlap the quantization instead of
    following it in one part."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    x_row = x_ptr + row * stride_xm
    BC: tl.constexpr = BLOCK_K // COLS
    PB: tl.constexpr = BLOCK_KS // COLS  # the launcher passes BLOCK_KS >= COLS: at least one channel
    if WRITE_XS:
        xs_c0 = part * PB
        xs_v = _xs_load(x_row, stride_xk, ch_ptr, xs_c0, KS, PB)
    if STATIC_GS:
        gs = tl.load(gs_in_ptr)
    else:
        offs_all = tl.arange(0, BLOCK_K)
        km = offs_all < K
        xa = tl.load(x_row + offs_all * stride_xk, mask=km, other=0.0).to(tl.float32)
        if HAS_CH:
            sma = tl.load(smask_ptr + offs_all, mask=km, other=0)
            xa = tl.where(sma != 0, 0.0, xa)
        gs = global_scale(tl.max(tl.abs(xa), axis=0))
    offs = part * BC + tl.arange(0, BC)
    kmask = offs < K
    x = tl.load(x_row + offs * stride_xk, mask=kmask, other=0.0).to(tl.float32)
    if HAS_CH:
        sm = tl.load(smask_ptr + offs, mask=kmask, other=0)
        x = tl.where(sm != 0, 0.0, x)
    xb = tl.reshape(x, (BC // 16, 16))
    packed, sbyte, deq = quant_xb(xb, tl.max(tl.abs(xb), axis=1), gs, BC, DIV6_RECIP)
    if WRITE_PACKED:
        offs_p = part * (BC // 2) + tl.arange(0, BC // 2)
        tl.store(packed_ptr + row * (K // 2) + offs_p, packed.to(tl.uint8), mask=offs_p < K // 2)
        offs_s = part * (BC // 16) + tl.arange(0, BC // 16)
        tl.store(scale_ptr + row * (K // 16) + offs_s, sbyte.to(tl.uint8), mask=offs_s < K // 16)
    if WRITE_DEQ:
        tl.store(deq_ptr + row * K + offs, deq.to(deq_ptr.dtype.element_ty), mask=kmask)
    if part == 0:
        tl.store(gs_out_ptr + row, gs)
    if WRITE_XS:
        _xs_put(xs_ptr, row, KS, xs_c0, xs_v, PB)
        _store_xs(x_row, stride_xk, ch_ptr, xs_ptr, row, KS, xs_c0 + BLOCK_KS, BLOCK_KS, PB)  # KS > BLOCK_KS only


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
    packed, sbyte, deq = quant_xb_2d(xb, bamax, gs, ROWS, BLOCK_K, DIV6_RECIP)
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
        tl.store(deq_ptr + rows64[:, None] * K + k0 + offs[None, :], deq.to(deq_ptr.dtype.element_ty), mask=dm)


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
            gs = global_scale(tl.max(bamax, axis=1))
        _rows_quant_store(xb, bamax, gs, rows64, rmask, 0, K, packed_ptr, scale_ptr, deq_ptr,
                          BLOCK_K, WRITE_PACKED, WRITE_DEQ, DIV6_RECIP, ROWS)
    else:
        if not STATIC_GS:
            amax_v = tl.zeros((ROWS, BLOCK_K), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = _rows_load(x_rows, stride_xk, smask_ptr, k0, K, rmask, offs, HAS_CH)
                amax_v = tl.maximum(amax_v, tl.abs(x))
            gs = global_scale(tl.max(amax_v, axis=1))
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


def static_global_scale(global_scale: torch.Tensor, device) -> torch.Tensor:
    """The static activation global scale as a float32 [1] tensor on ``device`` (scalar or [1] accepted)."""
    gs = global_scale.reshape(-1).to(device=device, dtype=torch.float32)
    if gs.numel() != 1:
        raise NVFP4Error(f"input_global_scale: expected a scalar or [1], got shape {tuple(global_scale.shape)}")
    return gs


def act_quant_launch(
    x: torch.Tensor,
    mask: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None,
    write_packed: bool,
    write_deq: bool,
    write_xs: bool,
    post: torch.Tensor | None = None,
    deq_dtype: torch.dtype = torch.float16,
    num_warps: int | None = None,
    launch_deps: bool = False,
    cols: int = 1,
):
    """Launch ``_act_quant_kernel``; ``post`` (fp32 [1]) selects the FQ output: ``deq`` is then the
    bf16 fake-quantized activation ``q*s*post/gs`` with ``X[:, S]`` at the S columns; otherwise
    ``deq`` is the exact ``q*s`` in ``deq_dtype`` (fp16 or bf16: both hold it exactly). ``launch_deps``:
    the next kernel on the stream is launched with PDL and waits for this one (``gdc_wait``). ``cols``:
    programs per row (:func:`_act_quant_row_part`; one-pass rows without ``post`` only, else 1), each
    with ``num_warps`` (default 4) warps."""
    m, k_dim = x.shape
    kk = channels.numel()
    dev = x.device
    fq = post is not None
    packed = torch.empty((m, k_dim // 2), dtype=torch.uint8, device=dev) if write_packed else None
    scale = torch.empty((m, k_dim // BLOCK_SIZE), dtype=torch.uint8, device=dev) if write_packed else None
    deq = torch.empty((m, k_dim), dtype=torch.bfloat16 if fq else deq_dtype, device=dev) if write_deq else None
    gs_out = torch.empty((m,), dtype=torch.float32, device=dev)
    xs = torch.empty((m, kk), dtype=x.dtype, device=dev) if write_xs else None
    gs_in = static_global_scale(global_scale, dev) if global_scale is not None else gs_out
    one_pass = k_dim <= MAX_ONEPASS_K
    block_k = triton.next_power_of_2(k_dim) if one_pass else 4096
    nw = 4 if block_k <= 2048 else (8 if block_k <= 8192 else 16)
    if m <= FEW_ROWS and block_k >= 4096:
        nw = 32  # few rows: the row's latency chain is the time, so spread it over the most threads
    if num_warps is not None:
        nw = num_warps
    cols = cols if (one_pass and not fq and cols > 1 and block_k // cols >= 16) else 1
    if cols > 1:
        nw = num_warps or 4
    if interpreting():
        nw = 4
    dummy = gs_out
    if m:
        _act_quant_kernel[(m, cols)](
            x, x.stride(0), x.stride(1),
            mask, channels if kk else mask, gs_in,
            packed if write_packed else dummy, scale if write_packed else dummy,
            deq if write_deq else dummy, gs_out, xs if write_xs else dummy,
            k_dim, kk,
            BLOCK_K=block_k, ONE_PASS=one_pass, HAS_CH=kk > 0, STATIC_GS=global_scale is not None,
            WRITE_PACKED=write_packed, WRITE_DEQ=write_deq, WRITE_XS=write_xs and kk > 0,
            BLOCK_KS=max(min(256, max(16, triton.next_power_of_2(max(kk, 1)))), cols),  # >= cols: a share per part
            DIV6_RECIP=DIV6_RECIP_ON_CUDA if x.is_cuda else False,
            post_ptr=post if fq else dummy, FQ=fq,
            LAUNCH_DEPS=launch_deps and not interpreting(),
            COLS=cols,
            num_warps=nw,
        )
    return packed, scale, deq, gs_out, xs
