"""Kernel form: the warp-specialized fragment SpliceGEMM tile in Gluon (``_ws_kernel``), a decode/mid
candidate for BF16 activations on Hopper (sm_90). Reference: :func:`foursight.layer.reference_linear`;
plain-Triton twin (same tiling, decode and reduction order, tested under the interpreter):
:mod:`.gluon_ws_twin`.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``, computed as ``Yᵀ[BN, BM]`` (swap-AB: the
decoded weight is the register A operand of ``wgmma``, the activation tile the shared-memory B
operand), on the weight's fragment execution form (:mod:`.fragment_layout`; no other resident form).

Why: the fragment kernel (:mod:`.fragment`) is one warpgroup that loads, decodes and multiplies in
turn; Triton's software pipeline overlaps its loads, but its decode and MMA wait on CTA-wide barriers
and the loop stays latency-bound at M = 64-256 (docs/kernels.md). Here the work is split between
partitions (``gl.warp_specialize``):

* a **producer warp** issues TMA copies of the fragment codes ``[BN, 32]`` int32 (two 128-column
  chunks) and of the activation tile ``[BM, 256]`` bf16 into a ring of ``STAGES`` shared-memory
  slots, each guarded by a ``ready`` and an ``empty`` mbarrier (TMA zero-fills rows past M and
  columns past K);
* the **consumer warpgroup(s)** (the default partition, 4 or 8 warps) wait on ``ready``, read the
  codes into registers, decode them with the fragment form's word decode (the same PTX as
  :func:`.fragment_layout._decode_word_asm_pair`; the E5M3 scale pairs are read from global memory straight
  into the words' layout, one step ahead), run the kernel's layout chain, convert to the wgmma
  register-operand layout and issue ``warpgroup_mma``; when it completes they arrive on ``empty``.
  No CTA-wide barrier is in the loop.

The epilogue runs after the partitions join: global scales and ``2^7`` once on the fp32 accumulator,
then this split's share of the BF16 channel segment (fp32 FMA per channel column, exact products),
then the split-K reduction of :func:`.tile_steps.split_k_epilogue` (every split stores an fp32 partial, the last to
arrive at a per-tile counter sums them in split order, adds the bias, resets the counter): results
are deterministic and bit-identical across calls. Not persistent: one program per (tile, split), the
split plan of :func:`.split_k.split_plan`.

Gluon (``triton.experimental.gluon``) cannot run under the interpreter; its API is that of Triton
3.6 (the H200's). This module imports on any machine: :func:`available` says whether the Gluon
kernel can be built here (CUDA sm_90 with Gluon importable).
"""

from __future__ import annotations

import os

import torch
import triton

from ..fragment_layout import DECODE_WORD_E5M3_PAIR, FRAG_COLS, fragment_of, scale_view
from ..split_k import segment_plan, split_counters, split_plan
from ..runtime import interpreting

try:  # Gluon is optional (Triton >= 3.5 on CUDA); the package must import without it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    #: the CTA-wide barrier: ``gl.barrier`` from Triton 3.9, ``gl.thread_barrier`` before
    cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    #: TMA global -> shared copy: ``tma.async_load`` from Triton 3.9, ``tma.async_copy_global_to_shared`` before
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    GLUON_IMPORT_ERROR: str = ""
except Exception as _e:  # noqa: BLE001 - any import failure means "no Gluon here"
    gluon = None
    GLUON_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

#: K columns of one pipeline step (two stored 128-column chunks; the fragment form pads K to 256)
WS_BLOCK_K: int = 256


def available(device=None) -> bool:
    """True where the Gluon kernel can be built and run: Gluon importable, not the interpreter, a
    CUDA device of compute capability 9.0 (wgmma and TMA as written here), and not switched off with
    ``FOURSIGHT_WS=0``."""
    if gluon is None or interpreting() or os.environ.get("FOURSIGHT_WS", "1") == "0":
        return False
    if not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.get_device_capability(device) == (9, 0)
    except Exception:  # noqa: BLE001
        return False


if gluon is not None:

    @gluon.jit
    def _ws_decode_pair(w, pair):
        """The fragment form's word decode (see :func:`.fragment_layout._decode_word_asm_pair`): int32 words
        and their E5M3 scale-byte pairs -> the 8 bf16 values ``e2m1·scale·2^-7`` of every word."""
        return gl.inline_asm_elementwise(
            asm=DECODE_WORD_E5M3_PAIR,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            args=[w, pair],
            dtype=(gl.bfloat16, ) * 8,
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def ws_tile(wq, pr, BLOCK_N: gl.constexpr):
        """Decoded [BN, 256] bf16 tile in real (row, column) order from the words ``wq`` [BN, 32] and
        their scale pairs ``pr`` [BN, 32] (same layout): the layout chain of :mod:`.fragment_layout`
        (``_join8``, ``_frag_cols``, ``_frag_rows``) on the eight decoded values."""
        v0, v1, v2, v3, v4, v5, v6, v7 = _ws_decode_pair(wq, pr)
        x = gl.join(gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7)))
        x = gl.permute(x, (0, 1, 4, 3, 2))
        x = gl.reshape(x, (BLOCK_N, 256))
        x = gl.reshape(x, (BLOCK_N * 2, 2, 2, 2, 2, 2, 2, 2))
        x = gl.permute(x, (0, 3, 4, 5, 6, 1, 2, 7))
        x = gl.reshape(x, (BLOCK_N, 256))
        x = gl.reshape(x, (BLOCK_N // 64, 2, 4, 8, 256))
        x = gl.permute(x, (0, 2, 1, 3, 4))
        return gl.reshape(x, (BLOCK_N, 256))

    @gluon.jit
    def _ws_producer(a_desc, w_desc, a_smem, w_smem, ready, empty, off_m, off_n, c_start, n_steps,
                     STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """One warp: TMA copies of step i's codes and activation tile into slot i % STAGES."""
        nbytes: gl.constexpr = BLOCK_M * 256 * 2 + BLOCK_N * 32 * 4
        for i in range(n_steps):
            s = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(empty.index(s), ph ^ 1)  # a fresh barrier passes parity 1 at once
            mbarrier.expect(ready.index(s), nbytes)
            c = c_start + 2 * i
            tma_load(w_desc, [off_n, c * 16], ready.index(s), w_smem.index(s))
            tma_load(a_desc, [off_m, c * 128], ready.index(s), a_smem.index(s))

    @gluon.jit
    def _ws_consumer(a_smem, w_smem, ready, empty, sf_ptr, stride_sfn, NP, off_n, c_start, n_steps,
                     STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr):
        """The default partition: decode each slot's codes into the wgmma register operand and
        accumulate ``W_tile @ A_tileᵀ``; release the slot when the MMA is done."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        dot_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0])
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, w_layout))
        # the scale pair of word column w of a 256-column step: pair 4·(w // 16) + w % 4
        pcol = gl.max_contiguous(gl.multiple_of((cols // 16) * 4 + cols % 4, 4), 4)  # 4 words -> 4 adjacent pairs
        rmask = gl.expand_dims(rows < NP, 1) & gl.expand_dims(cols >= 0, 0)
        s_ptrs = sf_ptr + gl.expand_dims(rows.to(gl.int64) * stride_sfn, 1) + gl.expand_dims(c_start * 4 + pcol, 0)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
        pr = gl.load(s_ptrs, mask=rmask & (n_steps > 0), other=0).to(gl.int32)
        for i in range(n_steps):
            s = i % STAGES
            pr_cur = pr
            # the next step's scale pairs from global memory, in flight while this step waits and decodes
            pr = gl.load(s_ptrs + (i + 1) * 8, mask=rmask & (i + 1 < n_steps), other=0).to(gl.int32)
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            wq = w_smem.index(s).load(w_layout)
            w = gl.convert_layout(ws_tile(wq, pr_cur, BLOCK_N), dot_layout)
            acc = warpgroup_mma(w, a_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(s), count=1)
        return (acc, )  # a tuple: the partition's results are flattened

    @gluon.jit
    def _ws_kernel(
        a_desc,  # TMA: A bf16 [M, K] (q*s for W4A4, X for W4A16), block [BM, 256]
        w_desc,  # TMA: fragment codes int32 [Np, Kp/8], block [BN, 32]
        sf_ptr, stride_sfn,  # scale pairs int16 [Np, Kp/32] (two E5M3 bytes), rows in stored order
        a_gs_ptr,  # fp32 [M] activation global scale (A_QUANT)
        x_ptr, stride_xm,  # X [M, K] bf16 (BF16 segment source, W4A16)
        ch_ptr,  # int32 [KS] channel indices
        w_gs_ptr,  # fp32 [N]
        wb_ptr, stride_wbn,  # W_bf16 [N, KS]
        bias_ptr,  # [N]
        out_ptr, stride_om,  # [M, N]
        ws_ptr,  # fp32 [SPLITS, M, N] split-K partials (SPLIT)
        cnt_ptr,  # int32 per-tile arrival counters, zero between calls (SPLIT)
        xs_ptr,  # X[:, S] [M, KS] contiguous (XS_DENSE)
        SPLITS, M, N, KS, NP, KCP,
        CHUNKS_PER_SPLIT,  # 128-column chunks per split, even
        SEG_PER_SPLIT,  # BF16-segment columns per split
        A_QUANT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        HAS_KS: gl.constexpr,
        SPLIT: gl.constexpr,
        XS_DENSE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        tiles_n = gl.cdiv(N, BLOCK_N)
        pid_m = pid // tiles_n
        pid_n = pid % tiles_n
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        c_start = pid_k * CHUNKS_PER_SPLIT
        c_end = gl.minimum(KCP, c_start + CHUNKS_PER_SPLIT)
        n_steps = (c_end - c_start) // 2

        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 256], a_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 32], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()

        res = gl.warp_specialize(
            [(_ws_consumer, (a_smem, w_smem, ready, empty, sf_ptr, stride_sfn, NP, off_n, c_start, n_steps,
                             STAGES, BLOCK_M, BLOCK_N, NW)),
             (_ws_producer, (a_desc, w_desc, a_smem, w_smem, ready, empty, off_m, off_n, c_start, n_steps,
                             STAGES, BLOCK_M, BLOCK_N))],
            [1], [24])
        acc = res[0]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))

        ws_epilogue(acc, pid, pid_k, off_m, off_n, a_gs_ptr, x_ptr, stride_xm, ch_ptr, w_gs_ptr, wb_ptr, stride_wbn,
                     bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, xs_ptr, SPLITS, M, N, KS, SEG_PER_SPLIT,
                     A_QUANT, HAS_BIAS, HAS_KS, SPLIT, XS_DENSE, BLOCK_M, BLOCK_N, NW, False)

    @gluon.jit
    def ws_scale(acc, off_m, off_n, a_gs_ptr, w_gs_ptr, M, N, A_QUANT: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, NW: gl.constexpr):
        """The global scales and ``2^7``, once, on the fp32 accumulator ``Yᵀ[BN, BM]`` (wgmma's layout)."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
        wgs = gl.load(w_gs_ptr + (offs_n % N).to(gl.int64))
        if A_QUANT:
            ags = gl.load(a_gs_ptr + (offs_m % M).to(gl.int64))
            acc = acc * (128.0 / (gl.expand_dims(wgs, 1) * gl.expand_dims(ags, 0)))
        else:
            acc = acc * gl.expand_dims(128.0 / wgs, 1)
        return acc

    @gluon.jit
    def ws_epilogue(acc, pid, pid_k, off_m, off_n, a_gs_ptr, x_ptr, stride_xm, ch_ptr, w_gs_ptr, wb_ptr, stride_wbn,
                     bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, xs_ptr, SPLITS, M, N, KS, SEG_PER_SPLIT,
                     A_QUANT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_KS: gl.constexpr, SPLIT: gl.constexpr,
                     XS_DENSE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr,
                     SCALED: gl.constexpr = False):
        """The epilogue of the Gluon forms (all warps of the default partition), the reference's order: global
        scales and ``2^7`` once on the fp32 accumulator ``Yᵀ[BN, BM]`` (:func:`ws_scale`, skipped when the
        caller ran it: ``SCALED``), this split's share of the BF16 channel segment (``HAS_KS``: fp32 FMA per
        channel column, exact products, a fixed order), then the ordered split-K reduction (the last split to
        arrive sums every split's partial in split order and adds the bias) or, unsplit, the bias and the store."""
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
        rn = (offs_n % N).to(gl.int64)
        rm = (offs_m % M).to(gl.int64)
        if not SCALED:
            acc = ws_scale(acc, off_m, off_n, a_gs_ptr, w_gs_ptr, M, N, A_QUANT, BLOCK_M, BLOCK_N, NW)
        if HAS_KS:
            # this split's share of the BF16 columns, one column at a time (bf16 x bf16 products are
            # exact in fp32; the column order is fixed, so the sum is deterministic)
            seg_lo = pid_k * SEG_PER_SPLIT
            seg_hi = gl.minimum(KS, seg_lo + SEG_PER_SPLIT)
            for kc in range(seg_lo, seg_hi):
                if XS_DENSE:
                    xv = gl.load(xs_ptr + rm * KS + kc).to(gl.float32)
                else:
                    ch = gl.load(ch_ptr + kc).to(gl.int64)
                    xv = gl.load(x_ptr + rm * stride_xm + ch).to(gl.float32)
                wv = gl.load(wb_ptr + rn * stride_wbn + kc).to(gl.float32)
                acc += gl.expand_dims(wv, 1) * gl.expand_dims(xv, 0)

        omask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
        out_ptrs = out_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_om, 0) + gl.expand_dims(offs_n.to(gl.int64), 1)
        if SPLIT:
            offs = gl.expand_dims(offs_m.to(gl.int64) * N, 0) + gl.expand_dims(offs_n.to(gl.int64), 1)
            gl.store(ws_ptr + pid_k.to(gl.int64) * M * N + offs, acc, mask=omask)
            cta_barrier()
            arrived = gl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                tot = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
                for sp in range(0, SPLITS):
                    tot += gl.load(ws_ptr + sp * M * N + offs, mask=omask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += gl.expand_dims(gl.load(bias_ptr + rn).to(gl.float32), 1)
                gl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=omask)
                gl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
        else:
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(bias_ptr + rn).to(gl.float32), 1)
            gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def ws_layouts(block_m: int, block_n: int):
    """The shared-memory layouts of the TMA operands (activation ``[BM, 256]`` bf16, codes
    ``[BN, 32]`` int32): wgmma's default NVMMA swizzle for the activation, the same rule for the codes."""
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, WS_BLOCK_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, WS_BLOCK_K // 8], gl.int32)
    return a_layout, w_layout


def ws_programs_per_sm(cfg) -> int:
    """Programs of ``cfg`` resident on one Hopper SM, by the CUDA occupancy rule: threads (the consumer
    warps plus the producer's warpgroup, which Triton pads to 4 warps), registers (``max_regs`` per
    thread, or the whole file), shared memory (the ring plus 1 KB)."""
    threads = 32 * (cfg.num_warps + 4)
    by_regs = 65536 // (threads * cfg.max_regs) if cfg.max_regs else 1
    smem = cfg.num_stages * (cfg.block_m * WS_BLOCK_K * 2 + cfg.block_n * WS_BLOCK_K // 2) + 1024
    return max(1, min(by_regs, 232448 // smem, 2048 // threads))


def ws_plan(cfg, m: int, pw) -> dict:
    """Split plan and tiling of a launch (shared with the twin, so both reduce in the same order):
    ``splits``, ``cps`` (128-column chunks per split, even), ``seg`` (BF16 columns per split), ``tiles``."""
    fw = fragment_of(pw)
    n = pw.out_features
    kcp = fw.words.shape[1] // 16
    bm, bn = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    step = WS_BLOCK_K // FRAG_COLS
    slots = 8
    if on_cuda(pw):
        slots = torch.cuda.get_device_properties(pw.weight_global_scale.device).multi_processor_count * ws_programs_per_sm(cfg)
    splits, cps, _ = split_plan(m, n, kcp, pw.num_channels, bm, bn, step, cfg.split_k, slots)
    _, seg = segment_plan(pw.num_channels, splits)
    return dict(splits=splits, cps=cps, seg=seg, tiles=tiles, kcp=kcp)


def on_cuda(pw) -> bool:
    """The layer lives on a CUDA device and the kernels are not interpreted."""
    return pw.weight_global_scale.is_cuda and not interpreting()


def ws_launch(cfg, a, a_gs, x, pw, bias, out, a_quant: bool, xs=None):
    """Launch the Gluon kernel (one launch; with split-K the last split of each tile reduces).
    Arguments as :func:`.fragment.fragment_launch` (``a`` bf16 ``q*s`` or X, unit stride along K)."""
    if gluon is None:
        raise RuntimeError(f"foursight.kernels.gluon_ws: Gluon is not importable here ({GLUON_IMPORT_ERROR})")
    fw = fragment_of(pw)
    if fw.scale_bf16:
        raise ValueError("gluon_ws: the kernel reads E5M3 scale bytes (fragment_layout.SCALES_AS_BF16 = False)")
    sf = scale_view(fw)
    m = x.shape[0]
    n, kk = pw.out_features, pw.num_channels
    if a.dtype != torch.bfloat16 or a.stride(1) != 1:
        raise ValueError(f"gluon_ws: the activation operand must be bf16 with unit stride along K, got {a.dtype}, {a.stride()}")
    if a.data_ptr() % 16:
        a = a.clone()  # TMA needs a 16-byte aligned base
    plan = ws_plan(cfg, m, pw)
    splits = plan["splits"]
    a_layout, w_layout = ws_layouts(cfg.block_m, cfg.block_n)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, WS_BLOCK_K], a_layout)
    w_desc = TensorDescriptor.from_tensor(fw.words, [cfg.block_n, WS_BLOCK_K // 8], w_layout)
    dummy = pw.weight_global_scale
    xs_dense = xs is not None and kk > 0
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else dummy
    cnt = split_counters(out.device, plan["tiles"]) if splits > 1 else dummy
    _ws_kernel[(plan["tiles"], splits)](
        a_desc, w_desc, sf, sf.stride(0),
        a_gs if a_gs is not None else dummy,
        x, x.stride(0),
        pw.bf16_channels if kk else pw.channel_mask,
        pw.weight_global_scale,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
        out, out.stride(0), ws, cnt,
        xs if xs_dense else dummy,
        splits, m, n, kk, fw.words.shape[0], plan["kcp"], plan["cps"], plan["seg"],
        A_QUANT=a_quant, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SPLIT=splits > 1, XS_DENSE=xs_dense,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
    )
    return out
