"""Shared pieces of the GPU kernel-form tests (``tests/test_kernels_ws_gpu.py``,
``tests/test_kernels_stream_gpu.py``): one cached layer at a time on the device, an activation with a few
large channels, the fp32 tolerance of ``splice_gemm`` and the repeated-call bit-identity check. Called only
where CUDA is available."""

from __future__ import annotations

import torch

DEV = "cuda"
_LAYERS: dict = {}


def cached_layer(n: int, k_dim: int, k: int):
    """``(QuantizedWeight, PreparedWeight)`` of a random N x K layer with k BF16 channels, seeded by its shape;
    one layer is kept at a time (the 8B shapes are large)."""
    import foursight.kernels.api as fk
    from foursight.layer import quantize_weight

    key = (n, k_dim, k)
    if key not in _LAYERS:
        _LAYERS.clear()
        g = torch.Generator(device=DEV).manual_seed(n + k_dim + k)
        w = torch.randn(n, k_dim, generator=g, device=DEV) * 0.02
        ch = torch.sort(torch.randperm(k_dim, generator=g, device=DEV)[:k]).values.to(torch.int32)
        qw = quantize_weight(w, ch)
        _LAYERS[key] = (qw, fk.prepare_weight(qw))
    return _LAYERS[key]


def activation(m: int, k_dim: int, seed: int) -> torch.Tensor:
    """bf16 [m, k_dim] with per-channel scales and every 7th-of-K channel 30x larger (outliers)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k_dim, generator=g, device=DEV) * torch.exp(torch.randn(1, k_dim, generator=g, device=DEV))
    x[:, :: max(1, k_dim // 7)] *= 30.0
    return x.bfloat16()


def check_fp32(y, ref, tol: float = 1e-5):
    """fp32 output within ``tol`` relative (norm) and ``20·tol·max|ref|`` absolute of the reference."""
    assert torch.isfinite(y).all()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    err = (y.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert rel <= tol and err <= 20 * tol * scale, f"rel {rel:.3e}, max abs err {err:.3e} (output scale {scale:.3e})"


def repeat_identical(fn, first: torch.Tensor, what: str, repeats: int):
    """``fn()`` called ``repeats - 1`` more times gives ``first`` bit for bit."""
    for i in range(repeats - 1):
        y = fn()
        assert torch.equal(y, first), f"{what}: call {i + 2} of {repeats} differs from the first " \
                                      f"(max |diff| {(y.float() - first.float()).abs().max().item():.3e})"
