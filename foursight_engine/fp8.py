"""FP8 rowwise W8A8 numerics (the FlashRL rollout anchor), in plain PyTorch (CPU and GPU).

Format (what FlashRL / vLLM's dynamic ``fp8`` run on Hopper):

* weight ``W`` [N, K]: E4M3 (``torch.float8_e4m3fn``) codes with one FP32 scale per output row,
  ``s_w[n] = amax(|W[n, :]|) / 448``, ``Wq = e4m3(W / s_w)`` (round to nearest, ties to even,
  saturating at ±448); ``W ≈ Wq · s_w``.
* activation ``x`` [M, K]: quantized dynamically per token the same way (``s_x[m] = amax(|x[m, :]|) / 448``).
* ``y = (xq · s_x) (Wq · s_w)ᵀ`` accumulated in FP32, returned in the input dtype (BF16).

:func:`fp8_rowwise_linear` runs ``torch._scaled_mm`` (rowwise scales, FP32 accumulation) on CUDA
when it is available there and agrees with the dequantized reference on the first call
(:func:`scaled_mm_ok`); otherwise it runs the dequantized reference
(:func:`fp8_rowwise_reference`). :class:`Fp8Linear` is the layer (``set_weight`` re-quantizes on
a weight sync, as ``FourSightLinear.set_weight`` does); :func:`foursight.hf.quantize_hf_model_fp8`
swaps it into an HF model. ``foursight rl --rollout-precision fp8`` and ``foursight compare hf:fp8`` use these;
``benchmarks/kernels/baselines.py`` times the same quantizers, with the two options that timing needs:
``check=False`` (no finiteness check: that check reads a flag back to the host, which a CUDA-graph
capture forbids) and :func:`scaled_mm_rowwise`'s ``fast_accum=True`` (cuBLASLt's fast FP8
accumulation, as FP8 engines run the GEMM). Neither changes the quantized codes or scales.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from foursight.nvfp4 import FP8_E4M3_MAX, check_finite

FP8_DTYPE = torch.float8_e4m3fn
#: smallest amax used for a scale (an all-zero row gets scale 1e-12 / 448, codes 0)
AMAX_FLOOR = 1e-12


class FP8Error(ValueError):
    """Invalid input for an FP8 rowwise operation (the message names the tensor)."""


def quantize_rowwise(x: torch.Tensor, name: str = "tensor", *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes with one FP32 scale per row: ``x [R, K] -> (q float8_e4m3fn [R, K], scale float32 [R, 1])``,
    ``scale = max(amax_row, 1e-12) / 448``, ``q = e4m3(clamp(x / scale, ±448))``; ``x ≈ q · scale``.

    A BF16/FP16/FP32 ``x`` is not copied to FP32 first: the row amax is taken in FP32 and the divide
    promotes to FP32, the same values as on ``x.float()``. ``check=False`` skips the NaN/Inf check, which
    reads a flag back to the host (not allowed inside a CUDA-graph capture); a non-finite value then
    gives NaN codes instead of an error."""
    if x.dim() != 2:
        raise FP8Error(f"{name}: expected a 2-D tensor [R, K], got shape {tuple(x.shape)}")
    xf = x if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else x.float()
    amax = torch.linalg.vector_norm(xf, ord=math.inf, dim=-1, keepdim=True, dtype=torch.float32)
    if check and x.numel() and not bool(torch.isfinite(amax).all()):
        check_finite(x, name)
    scale = amax.clamp_min(AMAX_FLOOR) / FP8_E4M3_MAX
    q = (xf / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight_fp8(weight: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight [N, K] -> ``(wq float8_e4m3fn [N, K], w_scale float32 [N, 1])`` (per output row)."""
    return quantize_rowwise(weight, name)


def quantize_activation_fp8(x: torch.Tensor, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: ``x [M, K] -> (xq [M, K], x_scale [M, 1])`` (``check``: see
    :func:`quantize_rowwise`)."""
    return quantize_rowwise(x, "activation", check=check)


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale`` in FP32, cast to ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def fp8_rowwise_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: per-token E4M3 quantization of ``x`` [M, K], FP32 product with the dequantized weight,
    ``+ bias``, cast to ``x.dtype``."""
    xq, sx = quantize_activation_fp8(x)
    y = dequantize_rowwise(xq, sx) @ dequantize_rowwise(wq, w_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_rowwise(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, *,
                      fast_accum: bool = False) -> torch.Tensor:
    """The FP8 GEMM alone, ``torch._scaled_mm`` with rowwise scales: ``xq`` [M, K] and ``wq`` [N, K] E4M3,
    ``x_scale`` [M, 1] and ``w_scale`` [N, 1] FP32 -> [M, N] BF16. ``fast_accum=True`` is cuBLASLt's fast
    FP8 accumulation (what FP8 engines run; the benchmarks' FP8 baseline); the default accumulates in FP32."""
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def _scaled_mm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # unchecked: the finiteness check reads a flag back to the host, a sync per linear per decoded
    # token (22-36 s per RL step on the H200); a non-finite activation still gives a non-finite output
    xq, sx = quantize_activation_fp8(x, check=False)
    y = scaled_mm_rowwise(xq, sx, wq, w_scale)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


_SCALED_MM: dict[str, bool] = {}


def scaled_mm_ok(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` rowwise runs on ``device`` and matches :func:`fp8_rowwise_reference`
    (relative error < 1e-2 on a random problem); decided once per device. CPU: always the reference."""
    key = str(device)
    if key not in _SCALED_MM:
        ok = False
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            try:
                g = torch.Generator(device="cpu").manual_seed(0)
                x = torch.randn(32, 64, generator=g).to(device, torch.bfloat16)
                wq, ws = quantize_weight_fp8(torch.randn(48, 64, generator=g).to(device, torch.bfloat16))
                ref = fp8_rowwise_reference(x, wq, ws).float()
                got = _scaled_mm(x, wq, ws, None).float()
                ok = bool((got - ref).norm() <= 1e-2 * ref.norm())
            except Exception:  # noqa: BLE001 - any failure: use the reference
                ok = False
        _SCALED_MM[key] = ok
    return _SCALED_MM[key]


def fp8_rowwise_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x Wᵀ (+ bias)`` in FP8 rowwise W8A8; ``x`` [..., K]. ``torch._scaled_mm`` where
    :func:`scaled_mm_ok`, the reference otherwise."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] == 0:
        return x.new_zeros(*shape[:-1], wq.shape[0])
    fn = _scaled_mm if (x.is_cuda and x2.dtype == torch.bfloat16 and scaled_mm_ok(x.device)) else fp8_rowwise_reference
    return fn(x2, wq, w_scale, bias).reshape(*shape[:-1], wq.shape[0])


class Fp8Linear(nn.Module):
    """Drop-in ``nn.Linear`` replacement running FP8 rowwise W8A8 (buffers ``weight_fp8`` [N, K],
    ``weight_scale`` [N, 1], ``bias``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = ""):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.name = name
        wq, ws = quantize_weight_fp8(weight.detach(), name or "weight")
        self.register_buffer("weight_fp8", wq)
        self.register_buffer("weight_scale", ws)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def set_weight(self, weight: torch.Tensor) -> None:
        """Re-quantize from a new weight [N, K] in place (a weight sync)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise FP8Error(f"{self.name}: weight has shape {list(weight.shape)}, expected {[self.out_features, self.in_features]}")
        self.weight_fp8, self.weight_scale = quantize_weight_fp8(weight.to(self.weight_fp8.device), self.name or "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_rowwise_linear(x, self.weight_fp8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 rowwise W8A8"

