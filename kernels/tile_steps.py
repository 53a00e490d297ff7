"""``@triton.jit`` tile steps the GEMM forms share, built on the primitives (:mod:`.primitives`).

The global scales once per tile (:func:`global_scales`), the spliced BF16 channel segment
(:func:`bf16_segment`), the split-K reduction of the ``Yᵀ`` tiles in the same launch
(:func:`split_k_epilogue`; the plan is :mod:`.split_k`). A step is shared only where the offline sm_90a
SASS of every default configuration stays the same: an inlined helper adds debug-scope labels to the PTX,
and ptxas can schedule and spill differently around them (the fragment form keeps its own copies).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .primitives import bf16_rne, mma


@triton.jit
def global_scales(acc, a_gs_ptr, w_gs_ptr, rm, rn, UNIT: tl.constexpr, A_QUANT: tl.constexpr, SWAP: tl.constexpr):
    """``acc · UNIT / (gs_w[n] · gs_a[m])`` (``A_QUANT``) or ``acc · UNIT / gs_w[n]`` (W4A16), once per
    tile: ``UNIT`` undoes the power of two the decoded FP4 operands carry (2^14 for the
    ``e2m1 · 2^-14`` decoders, 2^7 for the fragment form). ``SWAP``: ``acc`` is ``Yᵀ[BN, BM]``."""
    wgs = tl.load(w_gs_ptr + rn)
    if SWAP:
        if A_QUANT:
            ags = tl.load(a_gs_ptr + rm)
            acc = acc * (UNIT / (wgs[:, None] * ags[None, :]))
        else:
            acc = acc * (UNIT / wgs)[:, None]
    else:
        if A_QUANT:
            ags = tl.load(a_gs_ptr + rm)
            acc = acc * (UNIT / (ags[:, None] * wgs[None, :]))
        else:
            acc = acc * (UNIT / wgs)[None, :]
    return acc


@triton.jit
def bf16_segment(acc, x_ptr, stride_xm, stride_xk, ch_ptr, wb_ptr, stride_wbn, rm, rn, lo, hi,
                  BLOCK_KS: tl.constexpr, DENSE: tl.constexpr, ROUND: tl.constexpr, SWAP: tl.constexpr,
                  INTERP: tl.constexpr):
    """The spliced BF16 channel segment: columns ``[lo, hi)`` of S as more K steps of ``BLOCK_KS`` into the
    same fp32 accumulator, ``X[:, S] · W_bf16ᵀ``. ``DENSE``: ``x_ptr`` is the contiguous X[:, S]
    (the activation quantizer writes it); else the columns are gathered from X at ``ch_ptr``'s indices. ``ROUND``: the activation is
    rounded to bf16 first (round to nearest even also under the interpreter; fp16/fp32 X). ``SWAP``:
    ``acc`` is ``Yᵀ[BN, BM]`` and W_bf16 the left operand."""
    offs_c = tl.arange(0, BLOCK_KS)
    for c0 in range(lo, hi, BLOCK_KS):
        cm = (c0 + offs_c) < hi
        if DENSE:
            xs = tl.load(x_ptr + rm[:, None] * stride_xm + (c0 + offs_c)[None, :] * stride_xk, mask=cm[None, :], other=0.0)
        else:
            ch = tl.load(ch_ptr + c0 + offs_c, mask=cm, other=0).to(tl.int64)
            xs = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :] * stride_xk, mask=cm[None, :], other=0.0)
        wb = tl.load(wb_ptr + rn[:, None] * stride_wbn + (c0 + offs_c)[None, :], mask=cm[None, :], other=0.0)
        if ROUND:
            xs = bf16_rne(xs.to(tl.float32), INTERP).to(tl.bfloat16)
        if SWAP:
            acc = mma(wb, tl.trans(xs), acc, INTERP)
        else:
            acc = mma(xs, tl.trans(wb), acc, INTERP)
    return acc


@triton.jit
def split_k_epilogue(acc, pid, pid_k, offs_m, offs_n, rn, M, N, SPLITS, ws_ptr, cnt_ptr, bias_ptr, out_ptr, stride_om,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     INTERP: tl.constexpr):
    """The one split-K epilogue of the ``Yᵀ[BN, BM]`` tiles (the fragment kernel and the plain-Triton twin of the
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
