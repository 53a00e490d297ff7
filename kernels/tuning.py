"""The in-process autotuner of the SpliceGEMM kernels: timing on the GPU and the acceptance rule.

:func:`pick_config` times every candidate configuration of a datapath once per key (layer shape,
M bucket, mode) and caches the fastest in :data:`TUNED`; :data:`TUNE_LOG` keeps every candidate's
time or the reason it was skipped. A candidate is timed only after its output matched the PyTorch
reference on the device and was bit-identical on a second call. Times are medians of CUDA-graph
replays with a cold L2 (:func:`time_gpu`), so small decode kernels are not timed as Python launch
overhead.
"""

from __future__ import annotations

import os

import torch

from .primitives import interpreting

#: chosen configuration per key, filled by the autotuner (the benchmark writes it out)
TUNED: dict = {}
#: every candidate's median time (ms) or the reason it was skipped, per key
TUNE_LOG: dict = {}

_FLUSH: dict = {}


def time_gpu(fn, reps: int = 8, rounds: int = 5) -> float:
    """GPU milliseconds of one ``fn()`` with a cold L2, free of Python launch overhead.

    ``fn`` is run once eagerly (compilation), then captured in a CUDA graph as ``reps`` pairs
    (256 MB L2-flushing memset, fn); a second graph holds the memsets alone. The median over
    ``rounds`` replays of (pairs - memsets) / reps is returned. Eager event timing (``do_bench``)
    measured the launch overhead of the small decode kernels instead of their GPU time.
    """
    fn()
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    buf = _FLUSH[dev]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g_run, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
        with torch.cuda.graph(g_run, stream=stream):
            for _ in range(reps):
                buf.zero_()
                fn()
        with torch.cuda.graph(g_flush, stream=stream):
            for _ in range(reps):
                buf.zero_()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        g_run.replay()
        ev[1].record()
        g_flush.replay()
        ev[2].record()
        torch.cuda.synchronize()
        times.append((ev[0].elapsed_time(ev[1]) - ev[1].elapsed_time(ev[2])) / reps)
    times.sort()
    return max(times[len(times) // 2], 1e-6)


#: a candidate is accepted only if its output is within this relative error of the reference
ACCEPT_REL_ERR: float = 1e-2


def pick_config(key: tuple, run, cands: list, interp_cfg, out: torch.Tensor | None = None, reference=None):
    """Return the cached best config for ``key``; on first use time each candidate (CUDA only).

    With ``out`` (the tensor ``run`` writes) and ``reference`` (a callable returning the fp32
    reference output), a candidate is timed only after its output was finite, within
    :data:`ACCEPT_REL_ERR` of the reference, and bit-identical on a second call; a candidate
    that fails is logged with the reason and never chosen."""
    if interpreting() or not torch.cuda.is_available():
        return interp_cfg
    if key in TUNED:
        return TUNED[key]
    if os.environ.get("FOURSIGHT_KERNELS_AUTOTUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        # no timing runs inside a CUDA-graph capture (an engine capturing a batch size it never ran
        # eagerly): take the first candidate, and keep it so eager and graph calls agree
        TUNED[key] = cands[0]
        return cands[0]
    best, best_t = None, float("inf")
    log = TUNE_LOG.setdefault(key, [])
    ref = None
    for cfg in cands:
        try:
            if out is not None and reference is not None:
                if ref is None:
                    ref = reference()
                run(cfg)
                first = out.clone()
                run(cfg)
                rel = ((first.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                if not torch.isfinite(first).all() or not rel <= ACCEPT_REL_ERR:
                    raise Rejected(f"output off the reference (rel err {rel:.2e})")
                if not torch.equal(first, out):
                    raise Rejected("output changed between two calls on the same input")
            t = time_gpu(lambda: run(cfg))
        except Exception as e:  # does not compile (shared memory, registers), or rejected above
            log.append((cfg, None, f"{type(e).__name__}: {str(e)[:200]}"))
            if os.environ.get("FOURSIGHT_KERNELS_DEBUG"):
                print(f"[foursight.kernels] config {cfg} failed for {key}: {type(e).__name__}: {e}")
            continue
        log.append((cfg, t, None))
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"foursight.kernels: no tile configuration compiled and matched the reference for {key}: {log}")
    TUNED[key] = best
    return best


class Rejected(Exception):
    """A candidate configuration that ran but did not compute the reference function."""
