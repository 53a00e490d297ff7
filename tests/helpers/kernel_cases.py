"""The operands the SpliceGEMM interpreter tests share (tests/test_kernels_v4.py, tests/test_kernels_zfill.py): one
quantized layer with its prepared form, activations with per-channel scale spread and outlier columns, and the
tolerance against ``reference_linear`` (fp32 accumulation order; bf16 output rounding).

Import it after ``helpers.interpreter`` (which sets ``TRITON_INTERPRET`` before the kernels are imported)."""

from __future__ import annotations

import torch

from foursight.layer import quantize_weight


def quantized_layer(n: int, k: int, channels: int, seed: int):
    """``(QuantizedWeight, PreparedWeight, generator)``: an [n, k] weight with ``channels`` random BF16 channels,
    and the generator the test draws its activations from."""
    import foursight.kernels.api as fk

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    ch = torch.sort(torch.randperm(k, generator=g)[:channels]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    return qw, fk.prepare_weight(qw), g


def activation(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[m, k] bf16 with per-channel scales spread over e^N(0, 1) and every 7th column 20x (outliers)."""
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g))
    x[:, ::7] *= 20.0
    return x.bfloat16()


def assert_close_to_reference(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
