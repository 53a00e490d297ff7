"""The one registry of FourSight linear backends: which exist, which are experimental, and on which GPU
each can run (each backend answers ``is_supported(capability)`` itself), plus the choice rule.

Backends (:data:`REGISTRY`, in order of preference for ``auto``):

* ``triton`` — the Triton SpliceGEMM kernels of this package (fragment / dequant forms; verified on the
  H200 and H100, sm_90), the default on every CUDA GPU;
* ``reference`` — the PyTorch reference (:func:`foursight.layer.reference_linear`), anywhere;
* ``dot_scaled`` — experimental: the Triton ``tl.dot_scaled`` form (:mod:`.dot_scaled`), Blackwell only;
* ``flashinfer`` — experimental: FlashInfer's ``mm_nvfp4_svdquant`` (:mod:`.flashinfer_gemm`), Blackwell
  with FlashInfer installed.

Experimental backends never run unless asked for (:data:`BACKEND_ENV`, ``foursight serve
--kernel-backend``) until a device run verifies them (:data:`VERIFIED_NATIVE`). They live in
:mod:`foursight.kernels.experimental`, apart from the default path: the registry names the module of each,
and it is imported by that name only when it is asked for (:func:`load_backend`), as an engine loads a
plugin. No module of the default path imports them (``tests/test_import_graph.py`` checks it). The
experimental *kernel forms* inside the ``triton`` backend (the Gluon tiles) are rows of the kernel-form
table, :mod:`.forms`, with their own switches.

This module is the rule (pure functions of the capability, testable with a faked one) and the device
lookups it needs (:func:`device_capability`, :func:`blackwell_fp4_available`); how each backend prepares
and runs a layer is :mod:`foursight.dispatch`'s.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: The environment variable that selects the backend of every FourSight layer of the process.
BACKEND_ENV: str = "FOURSIGHT_KERNEL_BACKEND"
#: Compute-capability majors with block-scaled FP4 tensor cores (sm_100/sm_103: 10; sm_120/sm_121: 12).
FP4_MAJORS: tuple[int, ...] = (10, 12)
#: Native backends that have passed a run on a Blackwell GPU; ``auto`` prefers them there. Empty:
#: nothing has run on Blackwell yet.
VERIFIED_NATIVE: tuple[str, ...] = ()


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this device or install."""


def sm(capability: tuple[int, int] | None) -> str:
    return "cpu" if capability is None else f"sm_{capability[0]}{capability[1]}"


def native_fp4(capability: tuple[int, int] | None) -> bool:
    """True for a GPU with native block-scaled FP4 MMA (sm_100/sm_103/sm_120/sm_121)."""
    return capability is not None and capability[0] in FP4_MAJORS


def device_capability(device: torch.device | int | None = None) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def blackwell_fp4_available(device: torch.device | int | None = None) -> bool:
    """True on a GPU whose native FP4 backends exist here (sm_100/sm_103/sm_120/sm_121); False on
    Hopper and CPU. Whether they run is :func:`choose_backend`'s opt-in rule."""
    return native_fp4(device_capability(device))


def flashinfer_svdquant_available() -> bool:
    """True when ``flashinfer.gemm.mm_nvfp4_svdquant`` can be imported."""
    try:
        from flashinfer.gemm import mm_nvfp4_svdquant  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything at import
        return False
    return True


def gluon_available() -> bool:
    """True when Triton's Gluon (``triton.experimental.gluon``) imports."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@dataclass(frozen=True)
class KernelBackend:
    """One backend: its name, whether it is experimental (opt-in), and its own support rule."""

    name: str
    summary: str
    experimental: bool
    #: ``rule(capability) -> None`` when it can run there, else the reason it cannot (the message of
    #: :class:`BackendUnavailable` when it is asked for)
    rule: Callable[[tuple[int, int] | None], str | None]
    #: the module of an experimental backend, whose ``BACKEND`` is its linear adapter (the protocol
    #: ``foursight.dispatch.LinearBackend``); imported by name, only when the backend is asked for
    module: str | None = None

    def is_supported(self, capability: tuple[int, int] | None) -> bool:
        return self.rule(capability) is None

    def why_not(self, capability: tuple[int, int] | None) -> str | None:
        return self.rule(capability)


def _triton_rule(cap):
    return "CPU tensors run the PyTorch reference" if cap is None else None


_FLASHINFER_MISSING = (f"{BACKEND_ENV}=flashinfer: flashinfer.gemm.mm_nvfp4_svdquant cannot be imported; install FlashInfer "
                       f">= 0.7 (`pip install flashinfer-python`) or use {BACKEND_ENV}=dot_scaled")


def _blackwell_rule(what: str):
    def rule(cap):
        if not native_fp4(cap):
            return (f"{BACKEND_ENV}={what} needs a Blackwell GPU (sm_100/sm_103/sm_120/sm_121: block-scaled FP4 MMA"
                    f"{', for FlashInfer mm_nvfp4_svdquant' if what == 'flashinfer' else ''}); this GPU is {sm(cap)}. "
                    f"Use {BACKEND_ENV}=triton (or auto)")
        if what == "flashinfer" and not flashinfer_svdquant_available():
            return _FLASHINFER_MISSING
        return None
    return rule


#: Every backend, in ``auto``'s order of preference among the non-experimental ones.
REGISTRY: dict[str, KernelBackend] = {b.name: b for b in (
    KernelBackend("triton", "Triton SpliceGEMM kernels (fragment / dequant forms), verified on sm_90", False, _triton_rule),
    KernelBackend("reference", "the PyTorch reference (foursight.layer.reference_linear)", False, lambda cap: None),
    KernelBackend("dot_scaled", "Triton tl.dot_scaled native FP4 (docs/blackwell.md)", True, _blackwell_rule("dot_scaled"),
                  "foursight.kernels.experimental.dot_scaled"),
    KernelBackend("flashinfer", "FlashInfer mm_nvfp4_svdquant (docs/blackwell.md)", True, _blackwell_rule("flashinfer"),
                  "foursight.kernels.experimental.flashinfer_gemm"),
)}
#: The values :data:`BACKEND_ENV` accepts.
CHOICES: tuple[str, ...] = ("auto", *REGISTRY)
#: The experimental native backends.
NATIVE: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.experimental)
def rebuilds_checkpoint(state: Any) -> bool:
    """Whether a backend's execution form ``state`` (``PreparedLinear.state``) gives back its layer's
    checkpoint FP4 codes and block scales exactly (``state.checkpoint_codes()``): the ``triton``
    backend's fragment form does (:meth:`foursight.kernels.prepared.PreparedWeight.checkpoint_codes`);
    the reference's float32 weight and the experimental backends' forms do not. Where it does, the
    engine plugin keeps those two tensors only in the execution form and frees its own copy after
    processing (issue 36 item 6: one weight copy inside the engine); elsewhere it keeps them."""
    return callable(getattr(state, "checkpoint_codes", None))


def load_backend(name: str) -> Any:
    """The linear adapter (``BACKEND``) of the experimental backend ``name``, its module imported now."""
    module = REGISTRY[name].module
    if module is None:
        raise ValueError(f"{BACKEND_ENV}={name}: not an experimental backend (its adapter is foursight.dispatch's)")
    return importlib.import_module(module).BACKEND


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
    if requested != "auto":
        b = REGISTRY[requested]
        reason = b.why_not(capability)
        if requested == "flashinfer" and flashinfer_ok is not None and native_fp4(capability):
            reason = None if flashinfer_ok else _FLASHINFER_MISSING
        if reason:
            raise BackendUnavailable(reason)
        return requested, f"{where}: {BACKEND_ENV}={requested} (opt-in: not yet verified on Blackwell)"
    # auto
    if native_fp4(capability):
        for name in VERIFIED_NATIVE:
            ok = flashinfer_ok if (name == "flashinfer" and flashinfer_ok is not None) else REGISTRY[name].is_supported(capability)
            if ok:
                return name, f"{where}: {name} (native FP4, verified on Blackwell)"
        return "triton", (f"{where}: the native FP4 backends ({', '.join(NATIVE)}) have not run on Blackwell yet, so the "
                          f"Triton SpliceGEMM path verified on the H200 runs; set {BACKEND_ENV}=flashinfer or dot_scaled "
                          "(foursight serve --kernel-backend) to opt in")
    return "triton", f"{where}: triton"
