"""What this process runs the kernels on, in Python: the Triton interpreter or a GPU
(:func:`interpreting`), whether programmatic dependent launch may be used (:func:`pdl_supported`), and
how many programs of one compiled kernel fit on the device at once (:func:`resident_programs`, the
CUDA occupancy rule). One subject: the runtime facts the launchers of every form ask.
"""

from __future__ import annotations

import os

import torch
import triton


@triton.jit
def _probe():
    """Never launched: built like every kernel of the package, so its type tells whether the
    ``@triton.jit`` decorators of this process chose the interpreter (:func:`interpreting`)."""
    pass


def pdl_supported() -> bool:
    """Programmatic dependent launch is usable: Triton has ``tl.extra.cuda.gdc_wait`` /
    ``gdc_launch_dependents`` and the ``launch_pdl`` launch option (Triton 3.6 and 3.9 do; older
    ones, and the interpreter, do not) **and** ``FOURSIGHT_PDL=1`` asks for it. Off by default: on the
    H200 the W4A4 call took 28.4 µs with PDL against 25.8 µs without at 8192², M = 1 (27.6 vs 25.5 at
    14336 × 4096; ``benchmarks/results/h200-2026-12-05/breakdown.md``): the L2 prefetch and the
    dependent-launch wait cost more than the overlap gained."""
    if os.environ.get("FOURSIGHT_PDL", "0") != "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as _cuda
    except ImportError:  # pragma: no cover
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(_cuda, "gdc_wait")
            and hasattr(_cuda, "gdc_launch_dependents"))


_DEVICE_PROPS: dict = {}


def resident_programs(device, compile_fn=None, num_warps: int = 4) -> int:
    """Programs of one kernel variant that fit on ``device`` at once: SMs x blocks per SM, the blocks
    per SM limited by the variant's registers, shared memory and threads (the CUDA occupancy rule,
    ``num_warps`` warps per program). ``compile_fn`` compiles the variant without launching it
    (``JITFunction.warmup``); without it, or if the compiled kernel does not say, 4 per SM. Under the
    interpreter or off CUDA: 8, so that the CPU tests exercise split-K."""
    if interpreting() or device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_PROPS:
        _DEVICE_PROPS[idx] = torch.cuda.get_device_properties(idx)
    props = _DEVICE_PROPS[idx]
    per_sm = 4
    if compile_fn is not None:
        try:
            k = compile_fn()
            if getattr(k, "n_regs", None) is None and hasattr(k, "_init_handles"):
                k._init_handles()
            regs, shared = int(k.n_regs), int(k.metadata.shared)
            warp_regs = -(-max(regs, 1) * 32 // 256) * 256
            by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (warp_regs * num_warps)
            smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
            by_smem = smem // (shared + 1024)
            by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
            per_sm = max(1, min(by_regs, by_smem, by_threads, 32))
        except Exception:  # noqa: BLE001 - an introspection gap costs speed, never correctness
            pass
    return per_sm * props.multi_processor_count


def interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return isinstance(_probe, InterpretedFunction)
