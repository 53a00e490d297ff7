"""The one dispatcher of the compensated linear layer: which backend runs a layer, chosen once.

A backend turns a :class:`~foursight.layer.QuantizedWeight` into its execution form once (after
loading, and again after a weight update) and runs the forward on it:

* :class:`ReferenceBackend` — the PyTorch oracle (:func:`foursight.layer.reference_linear`)
  with the dequantized FP4 weight cached; any device.
* :class:`TritonBackend` — the Triton SpliceGEMM kernels (:mod:`foursight.kernels.api`, imported
  only when the backend is used); CUDA tensors.

* the Blackwell native-FP4 backends (FlashInfer's ``mm_nvfp4_svdquant``; the Triton ``tl.dot_scaled``
  form), opt-in until a Blackwell run has verified them (docs/blackwell.md): their adapters live in
  their own modules (:mod:`foursight.kernels.experimental.flashinfer_gemm`, :mod:`foursight.kernels.experimental.dot_scaled`),
  imported by name when one is asked for (``foursight.kernels.backends.load_backend``).

:func:`prepare_linear` chooses a weight's backend once (:func:`select_backend`): CPU weights run the
reference; CUDA weights follow ``FOURSIGHT_KERNEL_BACKEND`` and the device's capability through
:func:`foursight.kernels.backends.choose_backend` (default: the first of :data:`BACKENDS` that
supports the weight, i.e. Triton; the choice is logged once per device). It returns a
:class:`PreparedLinear`, which every caller (the HF reference model, the vLLM and SGLang adapters)
keeps and calls per forward. No per-call dispatch happens after that.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from foursight.layer import QuantizedWeight, dequantize_weight, reference_linear

logger = logging.getLogger("foursight.dispatch")

class LinearBackend(Protocol):
    """What a backend provides (see the module docstring)."""

    name: str

    def supports(self, qw: QuantizedWeight) -> bool:
        """True when this backend can run ``qw`` where its tensors live."""

    def prepare(self, qw: QuantizedWeight, name: str, channels_checked: bool = False) -> Any:
        """The execution form of ``qw`` (idempotent; ``qw`` is not modified). ``channels_checked``: its
        channel set is a layer's own, already validated (a weight sync re-preparing the layer), so a
        backend may skip re-validating it (on a GPU that check reads to the host three times)."""

    def forward(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None,
                input_global_scale: torch.Tensor | None, act_quant: bool) -> torch.Tensor:
        """``x`` [..., K] -> [..., N] in ``x``'s dtype."""


class ReferenceBackend:
    """The PyTorch reference with ``dequantize_weight(qw, float64, include_bf16=False)`` cached:
    numerically identical to :func:`reference_linear` (the cache is exactly what it recomputes, in
    the float64 its product is accumulated in; float32 weights widen exactly)."""

    name = "reference"

    def supports(self, qw: QuantizedWeight) -> bool:
        return True

    def prepare(self, qw: QuantizedWeight, name: str, channels_checked: bool = False) -> tuple[QuantizedWeight, torch.Tensor]:
        from foursight.nvfp4_cpu import dequantize_nvfp4  # the native pass on the CPU (bit-identical), else eager

        return qw, dequantize_weight(qw, torch.float64, include_bf16=False, dequantize=dequantize_nvfp4)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        qw, w_deq = state
        return reference_linear(x, qw, bias, input_global_scale, act_quant, w_deq=w_deq)


class TritonBackend:
    """The Triton SpliceGEMM kernels on CUDA (``foursight.kernels.api.prepare_weight`` /
    ``splice_linear``); not taken when Triton cannot be imported."""

    name = "triton"

    def supports(self, qw: QuantizedWeight) -> bool:
        if not qw.weight_packed.is_cuda:
            return False
        try:
            import foursight.kernels.api  # noqa: F401
        except ImportError:
            return False
        return True

    def prepare(self, qw: QuantizedWeight, name: str, channels_checked: bool = False):
        from foursight.kernels.api import prepare_weight

        return prepare_weight(qw, name, channels_checked=channels_checked)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        from foursight.kernels.api import splice_linear

        return splice_linear(x, state, bias=bias, input_global_scale=input_global_scale, act_quant=act_quant)


#: Backends in order of preference; the first that supports a weight runs it.
BACKENDS: list[LinearBackend] = [TritonBackend(), ReferenceBackend()]
#: The backends by the name ``FOURSIGHT_KERNEL_BACKEND`` gives them; the experimental ones join when first
#: asked for, from the module the one registry names (``foursight.kernels.backends.load_backend``)
BY_NAME: dict[str, LinearBackend] = {b.name: b for b in BACKENDS}
_LOGGED: set = set()


def _capability(qw: QuantizedWeight) -> tuple[int, int] | None:
    """The compute capability of the GPU holding ``qw`` (None for CPU tensors)."""
    if not qw.weight_packed.is_cuda:
        return None
    return tuple(torch.cuda.get_device_capability(qw.weight_packed.device))


def select_backend(qw: QuantizedWeight) -> LinearBackend:
    """The backend of ``qw``: the reference on CPU; on CUDA the one ``FOURSIGHT_KERNEL_BACKEND`` asks for
    (``auto``: the first of :data:`BACKENDS` that supports ``qw``), by the capability rule of
    :func:`foursight.kernels.backends.choose_backend`, which raises when the asked-for backend cannot run."""
    cap = _capability(qw)
    if cap is not None:
        # the registry is plain Python (no Triton); without Triton, TritonBackend.supports says no and the
        # loop below takes the reference
        from foursight.kernels.backends import choose_backend, load_backend, requested_backend

        name, reason = choose_backend(cap, requested_backend())
        if (cap, name) not in _LOGGED:
            _LOGGED.add((cap, name))
            # on Blackwell every choice runs code that has not run there yet: say so where it is seen
            log = logger.warning if cap[0] in (10, 12) else logger.info
            log("FourSight linear backend: %s (%s)", name, reason)
        if name not in BY_NAME:
            BY_NAME[name] = load_backend(name)
        if name != "triton" or BY_NAME["triton"].supports(qw):
            return BY_NAME[name]
    for b in BACKENDS:
        if b.supports(qw):
            return b
    raise RuntimeError("no FourSight linear backend supports this weight")  # the reference always does


@dataclass
class PreparedLinear:
    """One layer's backend and execution state. Call it like the layer's forward."""

    backend: LinearBackend
    state: Any
    qw: QuantizedWeight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None,
                 act_quant: bool = True) -> torch.Tensor:
        return self.backend.forward(self.state, x, bias, input_global_scale, act_quant)


def prepare_linear(qw: QuantizedWeight, name: str = "layer", backend: LinearBackend | None = None,
                   channels_checked: bool = False) -> PreparedLinear:
    """Choose the backend of ``qw`` (or use ``backend``) and build its execution state, once
    (``channels_checked``: see :meth:`LinearBackend.prepare`)."""
    b = backend or select_backend(qw)
    return PreparedLinear(b, b.prepare(qw, name, channels_checked=channels_checked), qw)

