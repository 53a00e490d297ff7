"""Which linear backend a CUDA device gets: the Blackwell (sm_100 / sm_120) native-FP4 backends are opt-in.

Two native-FP4 backends exist (docs/blackwell.md):

* ``flashinfer`` — FlashInfer's ``mm_nvfp4_svdquant`` (:mod:`.flashinfer_gemm`; static per-layer
  activation scales, bf16);
* ``dot_scaled`` — the Triton ``tl.dot_scaled`` form (:mod:`.dot_scaled`; any activation scale).

Neither has run on a Blackwell GPU (none is lent to this project), so :func:`choose_backend` never
picks one by itself: on every GPU the default stays the Triton SpliceGEMM path verified on the H200
(``triton``), and on sm_100/sm_120 the reason it gives says how to opt in. The choice is made with
the environment variable :data:`BACKEND_ENV` (``foursight serve --kernel-backend`` sets it for the
vLLM server it starts): ``auto`` (default), ``triton``, ``reference``, ``dot_scaled``,
``flashinfer``. A native backend asked for on a GPU that cannot run it is an error naming the GPU
and what it needs; on CPU tensors every choice runs the PyTorch reference.

This module holds the rule only (pure functions of the capability, testable with a faked one);
:mod:`foursight.dispatch` applies it. When a Blackwell run has verified a backend, it goes into
:data:`VERIFIED_NATIVE` and ``auto`` picks it there.
"""

from __future__ import annotations

import os

import torch

#: The environment variable that selects the backend of every FourSight layer of the process.
BACKEND_ENV: str = "FOURSIGHT_KERNEL_BACKEND"
CHOICES: tuple[str, ...] = ("auto", "triton", "reference", "dot_scaled", "flashinfer")
NATIVE: tuple[str, ...] = ("flashinfer", "dot_scaled")
#: Native backends that have passed a run on a Blackwell GPU; ``auto`` prefers them there. Empty:
#: nothing has run on Blackwell yet.
VERIFIED_NATIVE: tuple[str, ...] = ()
#: Compute-capability majors with block-scaled FP4 tensor cores (sm_100/sm_103: 10; sm_120/sm_121: 12).
FP4_MAJORS: tuple[int, ...] = (10, 12)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this device or install."""


def native_fp4(capability: tuple[int, int] | None) -> bool:
    """True for a GPU with native block-scaled FP4 MMA (sm_100/sm_103/sm_120/sm_121)."""
    return capability is not None and capability[0] in FP4_MAJORS


def sm(capability: tuple[int, int] | None) -> str:
    return "cpu" if capability is None else f"sm_{capability[0]}{capability[1]}"


def flashinfer_svdquant_available() -> bool:
    """True when ``flashinfer.gemm.mm_nvfp4_svdquant`` can be imported."""
    try:
        from flashinfer.gemm import mm_nvfp4_svdquant  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def requested_backend(environ=None) -> str:
    """The backend asked for in :data:`BACKEND_ENV` (default ``auto``); a bad value is an error listing the choices."""
    value = (os.environ if environ is None else environ).get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise BackendUnavailable(f"{BACKEND_ENV}={value!r}: not a FourSight kernel backend; choose one of {', '.join(CHOICES)}")
    return value


def choose_backend(capability: tuple[int, int] | None, requested: str, flashinfer_ok: bool | None = None) -> tuple[str, str]:
    """``(backend name, reason)`` for a weight on a device of ``capability`` (None: CPU).

    ``flashinfer_ok``: whether FlashInfer's SVDQuant GEMM imports (looked up when None and needed).
    Raises :class:`BackendUnavailable` when the requested backend cannot run there.
    """
    where = sm(capability)
    if capability is None:
        return "reference", "CPU tensors run the PyTorch reference"
    if requested in ("triton", "reference"):
        return requested, f"{where}: {BACKEND_ENV}={requested}"
    if requested == "dot_scaled":
        if not native_fp4(capability):
            raise BackendUnavailable(f"{BACKEND_ENV}=dot_scaled needs a Blackwell GPU (sm_100/sm_103/sm_120/sm_121: "
                                     f"block-scaled FP4 MMA); this GPU is {where}. Use {BACKEND_ENV}=triton (or auto)")
        return "dot_scaled", f"{where}: {BACKEND_ENV}=dot_scaled (opt-in: not yet verified on Blackwell)"
    if requested == "flashinfer":
        if not native_fp4(capability):
            raise BackendUnavailable(f"{BACKEND_ENV}=flashinfer needs a Blackwell GPU (FlashInfer's mm_nvfp4_svdquant runs on "
                                     f"sm_100/sm_103 and sm_120/sm_121); this GPU is {where}. Use {BACKEND_ENV}=triton (or auto)")
        if not (flashinfer_svdquant_available() if flashinfer_ok is None else flashinfer_ok):
            raise BackendUnavailable(f"{BACKEND_ENV}=flashinfer: flashinfer.gemm.mm_nvfp4_svdquant cannot be imported; "
                                     "install FlashInfer >= 0.7 (`pip install flashinfer-python`) or use "
                                     f"{BACKEND_ENV}=dot_scaled")
        return "flashinfer", f"{where}: {BACKEND_ENV}=flashinfer (opt-in: not yet verified on Blackwell)"
    # auto
    if native_fp4(capability):
        for name in VERIFIED_NATIVE:
            if name != "flashinfer" or (flashinfer_svdquant_available() if flashinfer_ok is None else flashinfer_ok):
                return name, f"{where}: {name} (native FP4, verified on Blackwell)"
        return "triton", (f"{where}: the native FP4 backends ({', '.join(NATIVE)}) have not run on Blackwell yet, so the "
                          f"Triton SpliceGEMM path verified on the H200 runs; set {BACKEND_ENV}=flashinfer or dot_scaled "
                          "(foursight serve --kernel-backend) to opt in")
    return "triton", f"{where}: triton"


def device_capability(device: torch.device | int | None = None) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def blackwell_fp4_available(device: torch.device | int | None = None) -> bool:
    """True on a GPU whose native FP4 backends exist here (sm_100/sm_103/sm_120/sm_121); False on
    Hopper and CPU. Whether they run is :func:`choose_backend`'s opt-in rule."""
    return native_fp4(device_capability(device))
