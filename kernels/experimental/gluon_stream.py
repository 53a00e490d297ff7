"""Kernel form: the register-streaming fragment SpliceGEMM tile in Gluon (``_stream_kernel``), a decode
candidate for BF16 activations on Hopper (sm_90). Reference: :func:`foursight.layer.reference_linear`;
plain-Triton twin (same tiling, split plan, decode, column MMA and reduction order, run by the
interpreter in CI): :mod:`.gluon_ws_twin` with ``cols_mma``.

``Y[M, N] = deq(A) · deq(W)ᵀ + X[:, S] · W_bf16ᵀ (+ bias)``, computed as ``Yᵀ[BN, BM]`` (swap-AB: the
decoded weight is the register A operand of ``wgmma``, the activation the shared-memory B operand), on
the weight's fragment execution form (:mod:`.fragment_layout`; no other resident form).

Why (issue 36 item 3): at decode the FP4 loop of the fragment form (:mod:`.fragment`) reads DRAM at
1.1–1.6 TB/s on an H100 with about one eligible warp per scheduler (docs/kernels.md): the weight
words go global → shared → registers, and every K step waits on a CTA-wide barrier. Here:

* the program's whole activation slice (``[BM, K/splits]`` bf16, a few tens of KB at decode) and its
  BF16 columns ``X[:, S]`` go to shared memory **once**, by asynchronous copies issued before anything
  else, behind one barrier;
* the fragment words and their E5M3 scale pairs stream from global memory **straight into registers**
  (16-byte loads, the fragment form's load layout), ``DEPTH`` K-steps of 256 columns ahead of the step
  being decoded, with no shared-memory hop and no barrier in the loop;
* each step decodes in registers (the fragment form's word decode and layout chain, shared with
  :mod:`.gluon_ws`; the conversion to the wgmma operand layout is asserted trivial) and issues one
  ``warpgroup_mma``, waited for before the next step; with ``StreamConfig.ring`` the activation comes
  through a ring of that many shared-memory slots instead (one copy group a step, one barrier a step), so
  the split plan is free of the slice's size;
* with 8 warps, two consumer warpgroups each decode and multiply their own 64 of the program's 128 rows
  (the words' load layout, :func:`words_layout`, is a linear layout so that the conversion stays trivial),
  so one warpgroup's decode can issue while the other's ``wgmma`` runs;
* with ``StreamConfig.mma_async`` the steps are unrolled and one ``wgmma`` stays in flight across the next
  step's decode (:func:`_stream_steps_async`; each step's operand is its own value, so nothing is carried
  around a loop while an MMA reads it);
* after the loop: the global scales and ``2^7`` on the fp32 accumulator, then this split's share of the
  BF16 columns as one more ``wgmma`` (``W[:, S]`` loaded from global straight into the register operand,
  ``X[:, S]`` from shared memory), then the ordered split-K reduction of :mod:`.gluon_ws`'s epilogue:
  deterministic, bit-identical across calls.

Not persistent: one program per (tile, split). The split plan (:func:`stream_plan`) is the fragment
forms' whole-wave plan (:func:`.split_k.split_plan`), with at least enough splits that a program's
activation slice fits :data:`STREAM_SMEM_BYTES`. Gluon cannot run under the interpreter; this module
imports on any machine (:func:`.gluon_ws.available` says where it can run).
"""

from __future__ import annotations

import torch
import triton

from ..fragment_layout import FRAG_COLS, fragment_of, scale_view
from .gluon_ws import WS_BLOCK_K, on_cuda, available, gluon  # noqa: F401 - available: the form's support rule
from ..split_k import segment_plan, split_counters, split_plan

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    from .gluon_ws import cta_barrier, ws_epilogue, ws_scale, ws_tile

    #: global -> shared asynchronous copy: ``async_load`` from Triton 3.9, ``async_copy_global_to_shared`` before
    async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

#: shared memory a program may give its activation slice (the split plan adds splits until it fits);
#: two programs of 4 warps then still share an SM by shared memory
STREAM_SMEM_BYTES: int = 64 * 1024
#: registers per thread the plan assumes for a program without ``max_regs`` (occupancy estimate; offline sm_90a,
#: Triton 3.6: 125-167, benchmarks/results/sass_stream), and for the 16-row depth-2 ring tile (171 there)
STREAM_REGS_GUESS: int = 168
STREAM_REGS_GUESS_RING16: int = 176
#: ... and with one wgmma in flight (two decoded operands live; offline 244-255)
STREAM_REGS_GUESS_ASYNC: int = 248


def regs_guess(cfg) -> int:
    """Registers per thread of ``cfg``'s program, for the occupancy estimate."""
    if cfg.max_regs:
        return cfg.max_regs
    if cfg.mma_async:
        return STREAM_REGS_GUESS_ASYNC
    return STREAM_REGS_GUESS_RING16 if cfg.ring and cfg.block_m >= 16 and cfg.depth == 2 else STREAM_REGS_GUESS


def max_steps(block_m: int) -> int:
    """256-column K steps whose activation slice ``[block_m, 256·steps]`` bf16 fits :data:`STREAM_SMEM_BYTES`."""
    return max(1, STREAM_SMEM_BYTES // (block_m * WS_BLOCK_K * 2))


def stream_programs_per_sm(cfg) -> int:
    """Programs of ``cfg`` resident on one Hopper SM, by the CUDA occupancy rule (threads, registers at
    ``max_regs`` or :data:`STREAM_REGS_GUESS`, shared memory at the largest activation slice)."""
    threads = 32 * cfg.num_warps
    by_regs = 65536 // (threads * regs_guess(cfg))
    smem = (cfg.ring or max_steps(cfg.block_m)) * cfg.block_m * WS_BLOCK_K * 2 + 128 * cfg.block_m * 2 + 1024
    return max(1, min(by_regs, 232448 // smem, 2048 // threads))


def stream_plan(cfg, m: int, pw) -> dict:
    """Split plan and tiling of a launch (the twin takes the same, so both reduce in the same order):
    ``splits``, ``cps`` (128-column chunks per split, even), ``seg`` (BF16 columns per split),
    ``segp`` (the columns' MMA width: a power of two >= 16), ``tiles``, ``kcp``."""
    fw = fragment_of(pw)
    n = pw.out_features
    kcp = fw.words.shape[1] // 16
    bm, bn = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    step = WS_BLOCK_K // FRAG_COLS
    slots = 8
    if on_cuda(pw):
        slots = torch.cuda.get_device_properties(pw.weight_global_scale.device).multi_processor_count * stream_programs_per_sm(cfg)
    steps = triton.cdiv(kcp, step)
    least = 1 if cfg.ring else triton.cdiv(steps, max_steps(bm))  # the fewest splits whose slices fit
    splits, cps, _ = split_plan(m, n, kcp, pw.num_channels, bm, bn, step, max(cfg.split_k, least) if cfg.split_k else 0, slots)
    if not cfg.split_k and splits < least:  # the whole-wave plan's slices would not fit
        splits, cps, _ = split_plan(m, n, kcp, pw.num_channels, bm, bn, step, least, slots)
    _, seg = segment_plan(pw.num_channels, splits)
    segp = max(16, triton.next_power_of_2(seg)) if pw.num_channels else 16
    return dict(splits=splits, cps=cps, seg=seg, segp=segp, tiles=tiles, kcp=kcp)


if gluon is not None:

    @gluon.jit
    def _stream_step_mma(wq, pr, b_smem, acc, BLOCK_N: gl.constexpr, dot_layout: gl.constexpr):
        """Decode one step's words in registers and multiply-accumulate them with its activation slot. The
        ``wgmma`` is waited for before the registers of its operand can be reused: leaving it in flight
        across steps (the operand carried to the next step's wait) raced on the H100, the loop-carried
        copy freeing the registers the MMA still read (NaN in repeated calls, docs/kernels.md)."""
        w = gl.convert_layout(ws_tile(wq, pr, BLOCK_N), dot_layout, assert_trivial=True)
        acc = warpgroup_mma(w, b_smem.permute((1, 0)), acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    @gluon.jit
    def _stream_wcols(wb_ptr, stride_wbn, off_n, seg_lo, seg_hi, N, BLOCK_N: gl.constexpr, SEGP: gl.constexpr,
                      dot_layout: gl.constexpr):
        """This split's ``W[:, S]`` columns ``[seg_lo, seg_hi)`` of the tile's rows, straight from global memory
        into the wgmma register operand (zeros past the share and past N)."""
        wn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dot_layout))
        wc = seg_lo + gl.arange(0, SEGP, layout=gl.SliceLayout(0, dot_layout))
        return gl.load(wb_ptr + gl.expand_dims((wn % N).to(gl.int64) * stride_wbn, 1) + gl.expand_dims(wc, 0),
                       mask=gl.expand_dims(wn < N, 1) & gl.expand_dims(wc < seg_hi, 0), other=0.0)

    @gluon.jit
    def _stream_step(wq, pr, a_smem, a_ptrs, a_rmask, ak, i, n_steps, K, acc, BLOCK_N: gl.constexpr,
                     dot_layout: gl.constexpr, RING: gl.constexpr):
        """Step ``i``: its activation slot (the whole slice's ``i``, or with a ring, slot ``i % RING`` once this
        thread's copy group of step i is done and every thread's is visible: one barrier), the MMA, then with a
        ring the copy of step ``i + RING`` into the slot just read (the MMA has completed for the warpgroup)."""
        if RING > 0:
            async_copy.wait_group(RING - 1)
            fence_async_shared()
            cta_barrier()
            slot = a_smem.index(i % RING)
        else:
            slot = a_smem.index(i)
        acc = _stream_step_mma(wq, pr, slot, acc, BLOCK_N, dot_layout)
        if RING > 0:
            nxt = i + RING
            async_load(slot, a_ptrs + nxt * 256, mask=a_rmask & gl.expand_dims(ak + nxt * 256 < K, 0) & (nxt < n_steps))
            async_copy.commit_group()
        return acc

    @gluon.jit
    def _stream_steps_async(wq0, pr0, wq1, pr1, w_ptrs, s_ptrs, wmask, a_smem, n_steps, acc, BLOCK_N: gl.constexpr,
                            STEPS: gl.constexpr, DEPTH: gl.constexpr, dot_layout: gl.constexpr):
        """The FP4 loop with one ``wgmma`` in flight: step i's MMA runs while step i + 1 decodes, and is waited
        for (``num_outstanding=1``) once step i + 1's MMA is issued. The words stream ``DEPTH`` steps ahead as in
        the synchronous loop (``wq0``/``wq1``: steps 0 and 1, step 1 masked to zeros past ``n_steps``). The steps
        are unrolled (all ``STEPS`` of the largest split; past this split's ``n_steps`` the words load as zeros
        and the activation slots hold zeros, so those MMAs add exact zeros), so no operand is carried around a
        loop: each step's decoded operand is its own SSA value, kept live up to the wait that covers its MMA
        (``deps``). The carried form (the operand passed around ``scf.for`` to the next step's wait) raced on
        the H100 (docs/kernels.md)."""
        w_prev = gl.zeros([BLOCK_N, 256], gl.bfloat16, dot_layout)
        for i in gl.static_range(STEPS):
            if DEPTH == 2:
                wq2 = gl.load(w_ptrs + (i + 2) * 32, mask=wmask & (i + 2 < n_steps), other=0)
                pr2 = gl.load(s_ptrs + (i + 2) * 8, mask=wmask & (i + 2 < n_steps), other=0).to(gl.int32)
            else:
                wq2 = gl.load(w_ptrs + (i + 1) * 32, mask=wmask & (i + 1 < n_steps), other=0)
                pr2 = gl.load(s_ptrs + (i + 1) * 8, mask=wmask & (i + 1 < n_steps), other=0).to(gl.int32)
            w = gl.convert_layout(ws_tile(wq0, pr0, BLOCK_N), dot_layout, assert_trivial=True)
            acc = warpgroup_mma(w, a_smem.index(i).permute((1, 0)), acc, is_async=True)
            if i > 0:
                acc, w_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w_prev))
            w_prev = w
            if DEPTH == 2:
                wq0 = wq1
                pr0 = pr1
                wq1 = wq2
                pr1 = pr2
            else:
                wq0 = wq2
                pr0 = pr2
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_prev))[0]

    @gluon.jit
    def _stream_kernel(
        a_ptr, stride_am,  # A bf16 [M, K] (q*s for W4A4, X for W4A16), unit stride along K
        wf_ptr, stride_wfn,  # fragment codes int32 [Np, Kp/8]
        sf_ptr, stride_sfn,  # scale pairs int16 [Np, Kp/32] (two E5M3 bytes), rows in stored order
        a_gs_ptr,  # fp32 [M] activation global scale (A_QUANT)
        x_ptr, stride_xm,  # X [M, K] bf16 (BF16 columns' source when not XS_DENSE)
        ch_ptr,  # int32 [KS] channel indices
        w_gs_ptr,  # fp32 [N]
        wb_ptr, stride_wbn,  # W_bf16 [N, KS]
        bias_ptr,  # [N]
        out_ptr, stride_om,  # [M, N]
        ws_ptr,  # fp32 [SPLITS, M, N] split-K partials (SPLIT)
        cnt_ptr,  # int32 per-tile arrival counters, zero between calls (SPLIT)
        xs_ptr,  # X[:, S] [M, KS] contiguous (XS_DENSE)
        SPLITS, M, N, K, KS, NP, KCP,
        CHUNKS_PER_SPLIT,  # 128-column chunks per split, even
        SEG_PER_SPLIT,  # BF16-segment columns per split
        A_QUANT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        HAS_KS: gl.constexpr,
        SPLIT: gl.constexpr,
        XS_DENSE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STEPS: gl.constexpr,  # 256-column steps of the largest split (the activation slice's slots)
        RING: gl.constexpr,  # 0: the whole slice in shared memory; else a ring of this many activation slots
        SEGP: gl.constexpr,  # the BF16 columns' MMA width (>= SEG_PER_SPLIT, a power of two >= 16)
        DEPTH: gl.constexpr,  # K steps of weight words in flight ahead of the one decoded: 1 or 2
        A_LAYOUT: gl.constexpr,  # NVMMA shared layout of one [BLOCK_M, 256] activation slot
        XS_LAYOUT: gl.constexpr,  # NVMMA shared layout of the [BLOCK_M, SEGP] BF16 columns
        W_LAYOUT: gl.constexpr,  # register layout of a step's [BLOCK_N, 32] words (words_layout)
        MMA_ASYNC: gl.constexpr,  # the steps unrolled, one wgmma in flight across the next step's decode
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
        last = n_steps - 1

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                             instr_shape=[16, BLOCK_M, 16])
        dot_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        w_layout: gl.constexpr = W_LAYOUT
        a_ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])

        # 1. the activation slice -> shared memory, asynchronously (rows past M, columns past K: zeros): the
        #    whole slice in one copy group, or the first RING steps, a group each
        am = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_ld))
        ak = c_start * 128 + gl.arange(0, 256, layout=gl.SliceLayout(0, a_ld))
        a_ptrs = a_ptr + gl.expand_dims(am.to(gl.int64) * stride_am, 1) + gl.expand_dims(ak, 0)
        a_rmask = gl.expand_dims(am < M, 1)
        if RING > 0:
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [RING, BLOCK_M, 256], A_LAYOUT)
            for r in gl.static_range(RING):
                async_load(a_smem.index(r), a_ptrs + r * 256,
                           mask=a_rmask & gl.expand_dims(ak + r * 256 < K, 0) & (r < n_steps))
                async_copy.commit_group()
        else:
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [STEPS, BLOCK_M, 256], A_LAYOUT)
            if MMA_ASYNC:  # every slot: the unrolled loop multiplies all STEPS (zeros past this split's steps)
                for j in gl.static_range(STEPS):
                    async_load(a_smem.index(j), a_ptrs + j * 256,
                               mask=a_rmask & gl.expand_dims(ak + j * 256 < K, 0) & (j < n_steps))
            else:
                for j in range(n_steps):
                    async_load(a_smem.index(j), a_ptrs + j * 256, mask=a_rmask & gl.expand_dims(ak + j * 256 < K, 0))
            async_copy.commit_group()

        # 2. the first DEPTH steps of weight words and scale pairs -> registers
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_layout))
        cols = gl.arange(0, 32, layout=gl.SliceLayout(0, w_layout))
        # the scale pair of word column w of a 256-column step: pair 4·(w // 16) + w % 4
        pcol = gl.max_contiguous(gl.multiple_of((cols // 16) * 4 + cols % 4, 4), 4)
        wmask = gl.expand_dims(rows < NP, 1) & gl.expand_dims(cols >= 0, 0)
        w_ptrs = wf_ptr + gl.expand_dims(rows.to(gl.int64) * stride_wfn, 1) + gl.expand_dims(c_start * 16 + cols, 0)
        s_ptrs = sf_ptr + gl.expand_dims(rows.to(gl.int64) * stride_sfn, 1) + gl.expand_dims(c_start * 4 + pcol, 0)
        wq0 = gl.load(w_ptrs, mask=wmask, other=0)
        pr0 = gl.load(s_ptrs, mask=wmask, other=0).to(gl.int32)
        if MMA_ASYNC:  # the unrolled loop takes every step once: step 1 is zeros past n_steps
            wq1 = gl.load(w_ptrs + 32, mask=wmask & (1 < n_steps), other=0)
            pr1 = gl.load(s_ptrs + 8, mask=wmask & (1 < n_steps), other=0).to(gl.int32)
        else:
            j1 = gl.minimum(1, last)
            wq1 = gl.load(w_ptrs + j1 * 32, mask=wmask, other=0)
            pr1 = gl.load(s_ptrs + j1 * 8, mask=wmask, other=0).to(gl.int32)

        # 3. this split's BF16 columns: W[:, S] straight into the register operand, X[:, S] -> shared memory
        if HAS_KS:
            seg_lo = pid_k * SEG_PER_SPLIT
            seg_hi = gl.minimum(KS, seg_lo + SEG_PER_SPLIT)
            if RING == 0:  # before the loop; a ring tile loads them after it (its registers are short)
                wcols = _stream_wcols(wb_ptr, stride_wbn, off_n, seg_lo, seg_hi, N, BLOCK_N, SEGP, dot_layout)
            x_ld: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
            xm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_ld))
            xc = seg_lo + gl.arange(0, SEGP, layout=gl.SliceLayout(0, x_ld))
            xmask = gl.expand_dims(xm < M, 1) & gl.expand_dims(xc < seg_hi, 0)
            if XS_DENSE:
                xv = gl.load(xs_ptr + gl.expand_dims(xm.to(gl.int64) * KS, 1) + gl.expand_dims(xc, 0), mask=xmask, other=0.0)
            else:
                ch = gl.load(ch_ptr + xc, mask=xc < seg_hi, other=0).to(gl.int64)
                xv = gl.load(x_ptr + gl.expand_dims(xm.to(gl.int64) * stride_xm, 1) + gl.expand_dims(ch, 0), mask=xmask, other=0.0)
            xs_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, SEGP], XS_LAYOUT, xv.to(gl.bfloat16))

        if RING == 0:
            async_copy.wait_group(0)
        fence_async_shared()
        cta_barrier()

        # 4. the FP4 loop: step i decodes while steps i+1 .. i+DEPTH are in flight
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
        if MMA_ASYNC:
            acc = _stream_steps_async(wq0, pr0, wq1, pr1, w_ptrs, s_ptrs, wmask, a_smem, n_steps, acc, BLOCK_N, STEPS,
                                      DEPTH, dot_layout)
        elif DEPTH == 1:
            for i in range(n_steps):
                j = gl.minimum(i + 1, last)
                wqn = gl.load(w_ptrs + j * 32, mask=wmask, other=0)
                prn = gl.load(s_ptrs + j * 8, mask=wmask, other=0).to(gl.int32)
                acc = _stream_step(wq0, pr0, a_smem, a_ptrs, a_rmask, ak, i, n_steps, K, acc, BLOCK_N, dot_layout, RING)
                wq0 = wqn
                pr0 = prn
        else:
            for i in range(n_steps):
                j = gl.minimum(i + 2, last)
                wq2 = gl.load(w_ptrs + j * 32, mask=wmask, other=0)
                pr2 = gl.load(s_ptrs + j * 8, mask=wmask, other=0).to(gl.int32)
                acc = _stream_step(wq0, pr0, a_smem, a_ptrs, a_rmask, ak, i, n_steps, K, acc, BLOCK_N, dot_layout, RING)
                wq0 = wq1
                pr0 = pr1
                wq1 = wq2
                pr1 = pr2

        # 5. the reference's order: scales, then the BF16 columns (one MMA), then the ordered reduction
        acc = ws_scale(acc, off_m, off_n, a_gs_ptr, w_gs_ptr, M, N, A_QUANT, BLOCK_M, BLOCK_N, NW)
        if HAS_KS:
            if RING > 0:
                wcols = _stream_wcols(wb_ptr, stride_wbn, off_n, seg_lo, seg_hi, N, BLOCK_N, SEGP, dot_layout)
            acc = warpgroup_mma(wcols, xs_smem.permute((1, 0)), acc)
        ws_epilogue(acc, pid, pid_k, off_m, off_n, a_gs_ptr, x_ptr, stride_xm, ch_ptr, w_gs_ptr, wb_ptr, stride_wbn,
                     bias_ptr, out_ptr, stride_om, ws_ptr, cnt_ptr, xs_ptr, SPLITS, M, N, KS, SEG_PER_SPLIT,
                     A_QUANT, HAS_BIAS, False, SPLIT, XS_DENSE, BLOCK_M, BLOCK_N, NW, True)


def stream_layouts(block_m: int, segp: int):
    """The shared-memory layouts: one ``[BM, 256]`` activation slot and the ``[BM, SEGP]`` BF16 columns
    (wgmma's default NVMMA swizzle)."""
    return (gl.NVMMASharedLayout.get_default_for([block_m, WS_BLOCK_K], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([block_m, segp], gl.bfloat16))


def words_layout(num_warps: int):
    """Register layout of one step's words ``[BN, 32]`` int32 (``BN = 16 · num_warps``, stored row order),
    chosen so that the decode's layout chain (:func:`.gluon_ws.ws_tile`) ends in the wgmma register operand
    with no data movement. A thread holds 4 adjacent words (16-byte loads); 4 lanes span a row's 16 words
    and 8 lanes 8 stored rows; the stored row ``s = 64·b + 32·i + 8·j + k`` is real row
    ``64·b + 16·j + 8·i + k`` (:mod:`.fragment_layout`), so ``i`` goes to registers (real rows 8 apart, as
    in wgmma's fragment), ``j`` to warps 0–1 and ``b`` to warp 2: each warp then holds the 16 real rows wgmma
    gives it. For 4 warps (``b`` = 0) this is the blocked layout ``[1, 4] × [8, 4] × [4, 1]``; for 8 warps
    (two consumer warpgroups, 64 rows each) no blocked layout has it, hence the linear form."""
    if num_warps not in (4, 8):
        raise ValueError(f"gluon_stream.words_layout: 4 or 8 warps (one or two warpgroups), got {num_warps}")
    warps = [[8, 0], [16, 0]] + ([[64, 0]] if num_warps == 8 else [])
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 16], [32, 0]],
                                      lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=warps, block_bases=[], shape=[16 * num_warps, 32])


def stream_constexprs(cfg, plan: dict, a_quant: bool, has_bias: bool, xs_dense: bool, kk: int) -> dict:
    """The constexprs of ``cfg``'s launch under ``plan`` (:func:`stream_plan`): what the launch passes and the
    offline SASS tool compiles."""
    a_layout, xs_layout = stream_layouts(cfg.block_m, plan["segp"])
    return dict(A_QUANT=a_quant, HAS_BIAS=has_bias, HAS_KS=kk > 0, SPLIT=plan["splits"] > 1, XS_DENSE=xs_dense,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STEPS=plan["cps"] // 2, RING=cfg.ring, SEGP=plan["segp"],
                DEPTH=cfg.depth, A_LAYOUT=a_layout, XS_LAYOUT=xs_layout, W_LAYOUT=words_layout(cfg.num_warps),
                MMA_ASYNC=cfg.mma_async)


def stream_launch(cfg, a, a_gs, x, pw, bias, out, a_quant: bool, xs=None):
    """Launch the Gluon kernel (one launch; with split-K the last split of each tile reduces). Arguments
    as :func:`.gluon_ws.ws_launch` (``a`` bf16 ``q*s`` or X, unit stride along K)."""
    from .gluon_ws import GLUON_IMPORT_ERROR

    if gluon is None:
        raise RuntimeError(f"foursight.kernels.gluon_stream: Gluon is not importable here ({GLUON_IMPORT_ERROR})")
    fw = fragment_of(pw)
    if fw.scale_bf16:
        raise ValueError("gluon_stream: the kernel reads E5M3 scale bytes (fragment_layout.SCALES_AS_BF16 = False)")
    sf = scale_view(fw)
    m = x.shape[0]
    n, k_dim, kk = pw.out_features, pw.in_features, pw.num_channels
    if a.dtype != torch.bfloat16 or a.stride(1) != 1:
        raise ValueError(f"gluon_stream: the activation operand must be bf16 with unit stride along K, got {a.dtype}, {a.stride()}")
    plan = stream_plan(cfg, m, pw)
    splits = plan["splits"]
    dummy = pw.weight_global_scale
    xs_dense = xs is not None and kk > 0
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else dummy
    cnt = split_counters(out.device, plan["tiles"]) if splits > 1 else dummy
    _stream_kernel[(plan["tiles"], splits)](
        a, a.stride(0), fw.words, fw.words.stride(0), sf, sf.stride(0),
        a_gs if a_gs is not None else dummy,
        x, x.stride(0),
        pw.bf16_channels if kk else pw.channel_mask,
        pw.weight_global_scale,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
        out, out.stride(0), ws, cnt,
        xs if xs_dense else dummy,
        splits, m, n, k_dim, kk, fw.words.shape[0], plan["kcp"], plan["cps"], plan["seg"],
        **stream_constexprs(cfg, plan, a_quant, bias is not None, xs_dense, kk), num_warps=cfg.num_warps,
        **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
    )
    return out
