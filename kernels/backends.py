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
--kernel-backend``) until a device run verifies them (:data:`VERIFIED_NATIVE`). The experimental
*kernel forms* inside the ``triton`` backend (the warp-specialized Gluon tile, :mod:`.gluon_ws`) are
opt-in the same way (``FOURSIGHT_WS``), listed in :data:`EXPERIMENTAL_FORMS`.

The experimental backends and forms live apart from the default path: the registry names the module
of each, and it is imported by that name only when it is asked for (:func:`load_backend`,
:func:`form_module`), as an engine loads a plugin. No module of the default path imports them
(``tests/test_import_graph.py`` checks it).

This module is the rule only (pure functions of the capability, testable with a faked one); how each
backend prepares and runs a layer is :mod:`foursight.dispatch`'s.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, NamedTuple

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
                  "foursight.kernels.dot_scaled"),
    KernelBackend("flashinfer", "FlashInfer mm_nvfp4_svdquant (docs/blackwell.md)", True, _blackwell_rule("flashinfer"),
                  "foursight.kernels.flashinfer_gemm"),
)}
#: The values :data:`BACKEND_ENV` accepts.
CHOICES: tuple[str, ...] = ("auto", *REGISTRY)
#: The experimental native backends.
NATIVE: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.experimental)
#: Experimental kernel forms of the ``triton`` backend: name -> (environment switch, support rule). Not
#: autotune candidates unless switched on (measured slower everywhere: benchmarks/results/h200-2026-12-05-ws/).
class ExperimentalForm(NamedTuple):
    """An experimental kernel form of the ``triton`` backend: its switch, its support rule (``rule(capability)``:
    None when it can run there, else why not), and its modules, imported by name only when it is switched on."""

    switch: str
    rule: Callable[[tuple[int, int] | None], str | None]
    module: str  # the form's kernels
    twin: str  # its plain-Triton twin, which the interpreter runs


EXPERIMENTAL_FORMS: dict[str, ExperimentalForm] = {
    "gluon_ws": ExperimentalForm(
        "FOURSIGHT_WS=1 (or only)",
        lambda cap: None if cap is not None and cap[0] == 9 and gluon_available()
        else f"the Gluon warp-specialized form needs sm_90 and triton.experimental.gluon; this is {sm(cap)}",
        "foursight.kernels.gluon_ws", "foursight.kernels.gluon_ws_twin"),
    "gluon_stream": ExperimentalForm(
        "FOURSIGHT_STREAM=1 (or only)",
        lambda cap: None if cap is not None and cap[0] == 9 and gluon_available()
        else f"the Gluon register-streaming form needs sm_90 and triton.experimental.gluon; this is {sm(cap)}",
        "foursight.kernels.gluon_stream", "foursight.kernels.gluon_ws_twin"),
}


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


def form_module(name: str, interpreted: bool = False) -> ModuleType:
    """The module of the experimental kernel form ``name`` (its plain-Triton twin when ``interpreted``), imported now."""
    form = EXPERIMENTAL_FORMS[name]
    return importlib.import_module(form.twin if interpreted else form.module)


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
