"""Plain-PyTorch references used by the kernel tests and the benchmark.

The oracle is :mod:`foursight.layer`; this module only re-exports it and adds the naive
"dequantize the whole weight, then matmul" emulation that the benchmark compares against.
"""

from __future__ import annotations

import torch

from foursight.layer import (  # noqa: F401  (re-exported)
    QuantizedActivation,
    QuantizedWeight,
    dequantize_weight,
    quantize_activation,
    quantize_weight,
    reference_linear,
)


def naive_emulation(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, act_quant: bool = True) -> torch.Tensor:
    """What a user without kernels would write: quantize/dequantize in PyTorch, then matmul.

    This is :func:`reference_linear` itself (fp32 dequantization of W and of X every call);
    the benchmark times it on the GPU as the "naive emulation" baseline.
    """
    return reference_linear(x, qw, bias=bias, act_quant=act_quant)
