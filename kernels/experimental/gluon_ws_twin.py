"""Plain-Triton twin of the Gluon kernels, warp-specialized (:mod:`.gluon_ws`) and register-streaming
(:mod:`.gluon_stream`: its split plan, and its BF16 columns as one MMA after the scales): the same tiling
(``Yᵀ[BN, BM]`` tiles, 256-column K steps of the fragment form), the same decode
(:func:`.fragment_layout.fragment_tile`, the word decode in PTX on the GPU and its portable twin in the
interpreter), the same split plan (:func:`.gluon_ws.ws_plan`) and the same epilogue order (global
scales and ``2^7`` on the fp32 accumulator, the split's BF16 columns one at a time, the ordered
split-K reduction, the bias), without warp specialization. Reference:
:func:`foursight.layer.reference_linear`.

Why it exists: Gluon cannot run under Triton's CPU interpreter, so CI checks the arithmetic of the
Gluon kernel's design through this twin (``tests/test_kernels_ws.py``); on the GPU it also runs,
as a plain software-pipelined loop, so the device tests can compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fragment_layout import fragment_of, fragment_tile, scale_view
from ..split_k import split_counters
from .gluon_stream import stream_plan
from .gluon_ws import ws_plan
from ..primitives import mma
from ..tile_steps import split_k_epilogue
from ..runtime import interpreting


@triton.jit
def _ws_twin_kernel(
    a_ptr, stride_am,  # A bf16 [M, K] (q*s for W4A4, X for W4A16)
    wf_ptr, stride_wfn,  # fragment codes int32 [Np, Kp/8]
    sf_ptr, stride_sfn,  # scale pairs int16 [Np, Kp/32]
    a_gs_ptr, x_ptr, stride_xm, ch_ptr, w_gs_ptr, wb_ptr, stride_wbn, bias_ptr,
    out_ptr, stride_om, ws_ptr, cnt_ptr, xs_ptr,
    SPLITS, M, N, K, KS, NP, KCP, CHUNKS_PER_SPLIT, SEG_PER_SPLIT,
    A_QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    SPLIT: tl.constexpr,
    XS_DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    COLS_MMA: tl.constexpr,  # the BF16 columns as one MMA of SEGP columns (the register-streaming form)
    SEGP: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    c_start = pid_k * CHUNKS_PER_SPLIT
    c_end = tl.minimum(KCP, c_start + CHUNKS_PER_SPLIT)

    rl = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # stored rows (load order)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (offs_n % N).to(tl.int64)
    rm = (offs_m % M).to(tl.int64)
    ow = tl.arange(0, 32)
    og = tl.arange(0, 8)
    ok = tl.arange(0, 256)
    rmask = (rl < NP)[:, None]
    w_ptrs = wf_ptr + rl.to(tl.int64)[:, None] * stride_wfn + (c_start * 16 + ow)[None, :]
    s_ptrs = sf_ptr + rl.to(tl.int64)[:, None] * stride_sfn + (c_start * 4 + og)[None, :]
    a_ptrs = a_ptr + rm[:, None] * stride_am + (c_start * 128 + ok)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for c0 in range(c_start, c_end, 2):
        wq = tl.load(w_ptrs, mask=rmask, other=0)
        sc = tl.load(s_ptrs, mask=rmask, other=0).to(tl.int32)
        w = fragment_tile(wq, sc, BLOCK_N, 256, False, INTERP)
        a = tl.load(a_ptrs, mask=((c0 * 128 + ok) < K)[None, :] & (offs_m < M)[:, None], other=0.0)
        acc = mma(w, tl.trans(a), acc, INTERP)
        w_ptrs += 32
        s_ptrs += 8
        a_ptrs += 256

    wgs = tl.load(w_gs_ptr + rn)
    if A_QUANT:
        ags = tl.load(a_gs_ptr + rm)
        acc = acc * (128.0 / (wgs[:, None] * ags[None, :]))
    else:
        acc = acc * (128.0 / wgs)[:, None]
    if HAS_KS and COLS_MMA:
        seg_lo = pid_k * SEG_PER_SPLIT
        seg_hi = tl.minimum(KS, seg_lo + SEG_PER_SPLIT)
        oc = seg_lo + tl.arange(0, SEGP)
        cm = oc < seg_hi
        if XS_DENSE:
            xv = tl.load(xs_ptr + rm[:, None] * KS + oc[None, :], mask=cm[None, :], other=0.0)
        else:
            ch = tl.load(ch_ptr + oc, mask=cm, other=0).to(tl.int64)
            xv = tl.load(x_ptr + rm[:, None] * stride_xm + ch[None, :], mask=cm[None, :], other=0.0)
        wv = tl.load(wb_ptr + rn[:, None] * stride_wbn + oc[None, :], mask=cm[None, :], other=0.0)
        acc = mma(wv.to(tl.bfloat16), tl.trans(xv.to(tl.bfloat16)), acc, INTERP)
    elif HAS_KS:
        seg_lo = pid_k * SEG_PER_SPLIT
        seg_hi = tl.minimum(KS, seg_lo + SEG_PER_SPLIT)
        for kc in range(seg_lo, seg_hi):
            if XS_DENSE:
                xv = tl.load(xs_ptr + rm * KS + kc).to(tl.float32)
            else:
                ch = tl.load(ch_ptr + kc).to(tl.int64)
                xv = tl.load(x_ptr + rm * stride_xm + ch).to(tl.float32)
            wv = tl.load(wb_ptr + rn * stride_wbn + kc).to(tl.float32)
            acc += wv[:, None] * xv[None, :]

    split_k_epilogue(acc, pid, pid_k, offs_m, offs_n, rn, M, N, SPLITS, ws_ptr, cnt_ptr, bias_ptr, out_ptr, stride_om,
                     SPLIT, HAS_BIAS, BLOCK_M, BLOCK_N, INTERP)


def ws_twin_launch(cfg, a, a_gs, x, pw, bias, out, a_quant: bool, xs=None):
    """Launch the twin (arguments as :func:`.gluon_ws.ws_launch`) of ``cfg``'s Gluon form: the
    warp-specialized one (:class:`~.configs.WSConfig`: its split plan, the columns one at a time) or the
    register-streaming one (:class:`~.configs.StreamConfig`: :func:`.gluon_stream.stream_plan`, the
    columns as one MMA)."""
    fw = fragment_of(pw)
    if fw.scale_bf16:
        raise ValueError("gluon_ws_twin: the Gluon form reads E5M3 scale bytes (fragment.SCALES_AS_BF16 = False)")
    sf = scale_view(fw)
    m = x.shape[0]
    n, k_dim, kk = pw.out_features, pw.in_features, pw.num_channels
    cols_mma = cfg.form == "gluon_stream"
    plan = stream_plan(cfg, m, pw) if cols_mma else ws_plan(cfg, m, pw)
    splits = plan["splits"]
    dummy = pw.weight_global_scale
    xs_dense = xs is not None and kk > 0
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else dummy
    cnt = split_counters(out.device, plan["tiles"]) if splits > 1 else dummy
    opts = {} if interpreting() else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _ws_twin_kernel[(plan["tiles"], splits)](
        a, a.stride(0), fw.words, fw.words.stride(0), sf, sf.stride(0),
        a_gs if a_gs is not None else dummy,
        x, x.stride(0),
        pw.bf16_channels if kk else pw.channel_mask,
        pw.weight_global_scale,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
        out, out.stride(0), ws, cnt, xs if xs_dense else dummy,
        splits, m, n, k_dim, kk, fw.words.shape[0], plan["kcp"], plan["cps"], plan["seg"],
        A_QUANT=a_quant, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SPLIT=splits > 1, XS_DENSE=xs_dense,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INTERP=interpreting(), COLS_MMA=cols_mma, SEGP=plan.get("segp", 16),
        **opts,
    )
    return out

