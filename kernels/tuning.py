"""The in-process autotuner of the SpliceGEMM kernels: timing on the GPU and the acceptance rule.

:func:`pick_config` times every candidate configuration of a datapath once per key (layer shape,
M bucket, mode) and caches the fastest in :data:`TUNED`; :data:`TUNE_LOG` keeps every candidate's
time or the reason it was skipped. A candidate is timed only after its output matched the PyTorch
reference on the device and was bit-identical on a second call. Times are medians of CUDA-graph
replays with the operands out of the L2 (:func:`time_gpu`, a read flush: why not a memset is in its
docstring), so small decode kernels are not timed as Python launch overhead.

The choices are also kept on disk (:class:`DiskCache`), per card, kernels source, Triton and torch: an engine
times its candidates once, at its first start on a card, instead of at every start. On the H100 vLLM's CUDA-graph
capture of an 8B-shaped FourSight model spent 20-27 s on some batch sizes timing candidates, about 90 s in all
(benchmarks/results/engine-h100-2026-12-07). ``FOURSIGHT_TUNE_CACHE`` names the folder (default
``~/.cache/foursight/autotune``); ``0`` turns it off (the test suite and the kernel benchmarks do, to time afresh).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import triton

from .runtime import interpreting

#: chosen configuration per key, filled by the autotuner (the benchmark writes it out)
TUNED: dict = {}
#: every candidate's median time (ms) or the reason it was skipped, per key
TUNE_LOG: dict = {}

_FLUSH: dict = {}

#: How :func:`time_gpu` leaves the L2 before each timed call (``FOURSIGHT_TIMER_FLUSH`` overrides):
#: ``read`` (default) reads a buffer of twice the L2's size, so the next call finds its operands in
#: device memory and the L2 full of *clean* lines; ``memset`` writes a 256 MB buffer (the timer of
#: issue 27; see :func:`time_gpu` for why it is biased); ``none`` flushes nothing (an L2 benchmark
#: unless the caller rotates weight copies).
FLUSH_MODES: tuple = ("read", "memset", "none")
DEFAULT_FLUSH: str = "read"


def _flush_fn(mode: str):
    """The flush of ``mode`` on the current device, as a callable (None for ``none``)."""
    if mode not in FLUSH_MODES:
        raise ValueError(f"time_gpu: flush {mode!r} is not one of {FLUSH_MODES}")
    if mode == "none":
        return None
    dev = torch.cuda.current_device()
    key = (dev, mode)
    if key not in _FLUSH:
        if mode == "memset":
            _FLUSH[key] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
        else:
            l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20)
            _FLUSH[key] = torch.ones(2 * l2 // 2, dtype=torch.float16, device="cuda")
    buf = _FLUSH[key]
    if mode == "memset":
        return buf.zero_
    return lambda: buf.sum(dtype=torch.float32)


def time_gpu(fn, reps: int = 8, rounds: int = 5, flush: str | None = None) -> float:
    """GPU milliseconds of one ``fn()`` with its operands out of the L2, free of Python launch overhead.

    ``fn`` is run once eagerly (compilation), then captured in a CUDA graph as ``reps`` pairs
    (flush, fn); a second graph holds the flushes alone. The median over ``rounds`` replays of
    (pairs - flushes) / reps is returned. Eager event timing (``do_bench``) measured the launch
    overhead of the small decode kernels instead of their GPU time.

    Why the read flush is the default: a memset flush (the timer before issue 36) leaves the L2 full of
    *dirty* lines, which are written back to device memory while the timed call runs, so a call that
    streams at the bandwidth limit pays for the flush's write-back too: on the H200 this timer put cuBLAS
    at 43-45 µs where rotated weight copies without a memset measured 33.4 µs, while a slower FP4 tile
    lost only about 2 µs, so it under-rewarded the fastest candidates
    (benchmarks/results/h200-2026-12-05-ws/bench_ws.md against benchmarks/results/h200-2026-12-05/splice_gemm.md).
    A read of twice the L2 leaves clean lines only, which is what a layer of a decode step meets (the
    layers before it read their weights; nothing wrote 256 MB). Rotated weight copies (the benchmarks
    pass one ``fn`` that runs the op on several copies whose bytes exceed the L2, :func:`common.ms_per_call`)
    need no flush at all, but need the copies; the autotuner has one weight, so it uses the read flush.
    ``flush``: ``read``, ``memset`` or ``none`` (default :data:`DEFAULT_FLUSH`, or ``FOURSIGHT_TIMER_FLUSH``).
    The issue-36 probe (``benchmarks/kernels/probe_v4.py``) measures the three side by side.
    """
    mode = flush or os.environ.get("FOURSIGHT_TIMER_FLUSH", DEFAULT_FLUSH)
    fl = _flush_fn(mode)
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g_run, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
        if fl is not None:
            fl()
        with torch.cuda.graph(g_run, stream=stream):
            for _ in range(reps):
                if fl is not None:
                    fl()
                fn()
        if fl is not None:
            with torch.cuda.graph(g_flush, stream=stream):
                for _ in range(reps):
                    fl()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        g_run.replay()
        ev[1].record()
        if fl is not None:
            g_flush.replay()
        ev[2].record()
        torch.cuda.synchronize()
        times.append((ev[0].elapsed_time(ev[1]) - (ev[1].elapsed_time(ev[2]) if fl is not None else 0.0)) / reps)
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
    disk = DiskCache.for_this_device()
    hit = disk.get(key, cands) if disk is not None else None
    if hit is not None:  # chosen, after the reference checks below, by an earlier process on this card and code
        TUNED[key] = hit
        TUNE_LOG.setdefault(key, []).append((hit, None, f"from the disk cache {disk.path}"))
        return hit
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
    if disk is not None:
        disk.put(key, best)
    return best


class DiskCache:
    """The autotuner's choices on disk: one JSON file per (card, kernels source, Triton, torch), ``repr(key)`` ->
    ``repr(config)`` (the configurations are frozen dataclasses, so their repr is their identity). A stored choice is
    used only if it is still one of the candidates offered for that key. Writes are atomic (a temporary file, then
    a rename); two processes tuning at once may each drop the other's newest entry, which only costs a re-timing."""

    _files: dict = {}

    def __init__(self, path: Path):
        self.path = path
        try:
            self.table = json.loads(path.read_text())
        except (OSError, ValueError):
            self.table = {}

    @classmethod
    def for_this_device(cls) -> "DiskCache | None":
        folder = os.environ.get("FOURSIGHT_TUNE_CACHE", str(Path.home() / ".cache" / "foursight" / "autotune"))
        if folder in ("", "0"):
            return None
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        import triton

        ident = f"{props.name}|{props.major}.{props.minor}|{props.multi_processor_count}|{_kernels_hash()}|{triton.__version__}|{torch.__version__}"
        name = hashlib.sha256(ident.encode()).hexdigest()[:20] + ".json"
        path = Path(folder) / name
        if path not in cls._files:
            cls._files[path] = cls(path)
        return cls._files[path]

    def get(self, key: tuple, cands: list):
        want = self.table.get(repr(key))
        return next((c for c in cands if repr(c) == want), None) if want is not None else None

    def put(self, key: tuple, cfg) -> None:
        self.table[repr(key)] = repr(cfg)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.table, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:  # a read-only home: the in-process cache still holds it
            pass


_KERNELS_HASH: list = []


def _kernels_hash() -> str:
    """sha256 of the kernels' source (every module of this package): a changed kernel is tuned again."""
    if not _KERNELS_HASH:
        h = hashlib.sha256()
        for f in sorted(Path(__file__).parent.rglob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        _KERNELS_HASH.append(h.hexdigest())
    return _KERNELS_HASH[0]


class Rejected(Exception):
    """A candidate configuration that ran but did not compute the reference function."""


def m_bucket(path: str, m: int) -> int:
    """The M bucket of the autotuner's keys: decode M <= 4 each its own, else 16; above, the next power of two."""
    if path == "decode":
        return m if m <= 4 else 16
    return min(triton.next_power_of_2(m), 4096)


def linear_key(path: str, m: int, prepared, act_quant: bool, static_gs: bool, dtype, has_bias: bool) -> tuple:
    """The autotuner's cache key of a :func:`splice_linear` call (benchmarks read ``TUNED[key]``)."""
    return ("linear", path, m_bucket(path, m), prepared.out_features, prepared.in_features, prepared.num_channels > 0,
            "linear" if act_quant else "w4a16", static_gs, dtype, has_bias)
