"""The one dispatcher of the compensated linear layer: which backend runs a layer, chosen once.

A backend turns a :class:`~foursight.layer.QuantizedWeight` into its execution form once (after
loading, and again after a weight update) and runs the forward on it:

* :class:`ReferenceBackend` — the PyTorch oracle (:func:`foursight.layer.reference_linear`)
  with the dequantized FP4 weight cached; any device.
* :class:`TritonBackend` — the Triton SpliceGEMM kernels (:mod:`foursight.kernels`, imported
  only when the backend is used); CUDA tensors.

:func:`prepare_linear` picks the first backend of :data:`BACKENDS` that can run a weight on its
device (a Blackwell native-FP4 backend would go first in that list) and returns a
:class:`PreparedLinear`, which every caller (the HF reference model, the vLLM and SGLang
adapters) keeps and calls per forward. No per-call dispatch happens after that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from foursight.layer import QuantizedWeight, dequantize_weight, reference_linear


class LinearBackend(Protocol):
    """What a backend provides (see the module docstring)."""

    name: str

    def supports(self, qw: QuantizedWeight) -> bool:
        """True when this backend can run ``qw`` where its tensors live."""

    def prepare(self, qw: QuantizedWeight, name: str) -> Any:
        """The execution form of ``qw`` (idempotent; ``qw`` is not modified)."""

    def forward(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None,
                input_global_scale: torch.Tensor | None, act_quant: bool) -> torch.Tensor:
        """``x`` [..., K] -> [..., N] in ``x``'s dtype."""


class ReferenceBackend:
    """The PyTorch reference with ``dequantize_weight(qw, float32, include_bf16=False)`` cached:
    numerically identical to :func:`reference_linear` (the cache is exactly what it recomputes)."""

    name = "reference"

    def supports(self, qw: QuantizedWeight) -> bool:
        return True

    def prepare(self, qw: QuantizedWeight, name: str) -> tuple[QuantizedWeight, torch.Tensor]:
        return qw, dequantize_weight(qw, torch.float32, include_bf16=False)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        qw, w_deq = state
        return reference_linear(x, qw, bias, input_global_scale, act_quant, w_deq=w_deq)


class TritonBackend:
    """The Triton SpliceGEMM kernels on CUDA (``foursight.kernels.prepare_weight`` /
    ``splice_linear``); not taken when Triton cannot be imported."""

    name = "triton"

    def supports(self, qw: QuantizedWeight) -> bool:
        if not qw.weight_packed.is_cuda:
            return False
        try:
            import foursight.kernels  # noqa: F401
        except ImportError:
            return False
        return True

    def prepare(self, qw: QuantizedWeight, name: str):
        from foursight.kernels import prepare_weight

        return prepare_weight(qw, name)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        from foursight.kernels import splice_linear

        return splice_linear(x, state, bias=bias, input_global_scale=input_global_scale, act_quant=act_quant)


#: Backends in order of preference; the first that supports a weight runs it.
BACKENDS: list[LinearBackend] = [TritonBackend(), ReferenceBackend()]


def select_backend(qw: QuantizedWeight) -> LinearBackend:
    """The first backend of :data:`BACKENDS` that supports ``qw`` (the reference always does)."""
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


def prepare_linear(qw: QuantizedWeight, name: str = "layer", backend: LinearBackend | None = None) -> PreparedLinear:
    """Choose the backend of ``qw`` (or use ``backend``) and build its execution state, once."""
    b = backend or select_backend(qw)
    return PreparedLinear(b, b.prepare(qw, name), qw)

