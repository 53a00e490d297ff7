"""The split-K plan of the ``Yᵀ[BN, BM]`` tile forms (:mod:`.fragment`, the Gluon form :mod:`.experimental.gluon_ws` and
its plain-Triton twin :mod:`.experimental.gluon_ws_twin`), in Python: how many splits a launch takes (whole waves,
:func:`split_plan`), how the BF16 channel segment is spread over them (:func:`segment_plan`), and the
per-tile arrival counters the in-kernel reduction uses (:func:`split_counters`; the reduction itself
is the tile step :func:`~.tile_steps.split_k_epilogue`). One subject: how a launch splits K.
"""

from __future__ import annotations

import torch
import triton


#: fixed cost of one program (pipeline fill, epilogue, its share of the split reduction) in units of
#: the time one program takes for the whole K: the split plan trades it against the wave tail
PROGRAM_OVERHEAD: float = 0.02


def wave_split(tiles: int, steps: int, slots: int) -> int:
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
    automatic (:func:`wave_split` over ``slots``, the programs that can be resident at once),
    1 = no split. Every split gets the same number of chunks: the BF16 segment (``kk`` columns) is
    spread over the splits (:func:`segment_plan`), not run by split 0 alone."""
    steps = triton.cdiv(kcp, step)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split == 0:
        split = wave_split(tiles, steps, slots)
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


#: ``late`` segment plan (``FragmentConfig.cols_late``): the largest step, loaded after the FP4 loop where
#: the loop's registers are free (a 64-row tile: 16 registers per thread for W[:, S])
SEGMENT_LATE_MAX: int = 64


def segment_plan(kk: int, splits: int, late: bool = False) -> tuple[int, int]:
    """(BLOCK_KS, columns per split) of the BF16 segment: ``kk`` columns over ``splits`` programs;
    BLOCK_KS (16 or :data:`SEGMENT_PRELOAD`) is the step loaded before the FP4 loop, and every split's
    share is a multiple of it. ``late`` (the columns loaded after the FP4 loop): every split's share is
    the even share rounded up to 16 columns (128 over 3 splits: 48, 48, 32, not 64, 64, 0), in one step
    of the next power of two up to :data:`SEGMENT_LATE_MAX` (masked at the share's end)."""
    if late:
        per = triton.cdiv(triton.cdiv(max(kk, 1), splits), SEGMENT_STEP) * SEGMENT_STEP
        return min(SEGMENT_LATE_MAX, triton.next_power_of_2(per)), per
    per = triton.cdiv(max(kk, 1), splits)
    step = SEGMENT_STEP if per <= SEGMENT_STEP else SEGMENT_PRELOAD
    return step, triton.cdiv(per, step) * step


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
