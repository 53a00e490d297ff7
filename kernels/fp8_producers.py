"""Kernel form: the FP8 rowwise baseline's producers with its per-token quantizer fused in (``_fp8_producer_kernel``).

Why it exists: the benchmarks' FP8 yardstick (``benchmarks/kernels/baselines.py``) quantized each linear's
activation with six eager PyTorch kernels, while the BF16 and FourSight decoders got one-launch producers
(:mod:`.producers`). An engine runs FP8 with the quantizer fused into the op before the linear (vLLM's
RMSNorm + quant and SiLU·mul + quant fusion passes) or, where there is no such op (o_proj), as one
``scaled_fp8_quant`` launch. This module gives the FP8 baseline the same: one launch per row that computes

* ``RMSNORM``: ``s = bf16(x + r)`` (with ``residual``; written back), ``y = bf16(s · rsqrt(mean(s²) + eps) · w)``;
* ``SILU_MUL``: from ``gu = [g | u]`` [M, 2K], ``y = bf16(g / (1 + exp(-g)) · u)``;
* ``PLAIN``: ``y = x`` (the standalone one-launch quantizer, for o_proj's input),

with the producer arithmetic of :mod:`.producers` (its ``@triton.jit`` helpers, imported, not copied), and
quantizes the bf16 row per token to E4M3 with ``scale = max(amax, 1e-12) / 448``, in one of two ways:

* ``exact=False`` (the default, what the benchmarks time): as vLLM's per-token kernel does, ``inv = 1 / scale``
  once per row and ``q = e4m3(clamp(y · inv, ±448))``, one multiplication per element and the hardware
  conversion (``cvt.rn.satfinite``, round to nearest even);
* ``exact=True``: ``q = e4m3(clamp(y / scale, ±448))`` with an IEEE division per element, bit for bit what
  :func:`foursight.fp8.quantize_activation_fp8` gives on the same device (``y · (1/scale)`` differs from
  ``y / scale`` in the last bit now and then, and so in an E4M3 code).

Bit-exactness with the PyTorch references (:func:`reference_fp8_producer`) rests on: ``/ 448`` as a true
division on the CPU but as a multiplication by ``fp32(1/448)`` on CUDA (ATen divides a tensor by a CPU scalar
that way, ``SCALE_RECIP``), IEEE round-to-nearest divisions (``div_rn``, not Triton's approximate ``/``), and
the E4M3 rounding: the hardware conversion on the GPU, and under the interpreter, whose float8 conversion
neither rounds to nearest nor saturates, the same rounding in integer arithmetic (:func:`_e4m3_code`: ties to
even, subnormals, the sign of -0 kept), stored as the code byte. The interpreter tests check the integer
rounding against ``torch``'s cast; ``tests/test_fp8_producers_gpu.py`` checks the hardware one.

Outputs: ``q`` float8_e4m3fn [M, K], ``scale`` float32 [M, 1] (the shapes ``torch._scaled_mm`` takes), the
residual sum with ``residual``, and the bf16 row ``y`` only when asked (``write_y``: the tests).

Reference: :func:`reference_fp8_producer` (the producers' PyTorch twins, then
:func:`foursight.fp8.quantize_activation_fp8`). Not on the FourSight path: a yardstick for the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foursight.fp8 import AMAX_FLOOR, FP8_DTYPE, FP8Error, quantize_activation_fp8
from foursight.nvfp4 import FP8_E4M3_MAX

from .primitives import MAX_ONEPASS_K, rne_bf16
from .producers import RMSNORM, SILU_MUL, produce_row, producer_warps, residual_sum, reference_rms_norm, reference_silu_mul
from .runtime import interpreting

#: the third producer kind of this module: no producer, the row itself (o_proj's standalone quantizer)
PLAIN: int = 2
KINDS: dict = {"rms_norm": RMSNORM, "silu_mul": SILU_MUL, "plain": PLAIN}
#: match PyTorch-on-CUDA's ``amax / 448.0`` (a multiplication by fp32(1/448)) on the GPU
SCALE_RECIP_ON_CUDA: bool = True


@dataclass(frozen=True)
class Fp8Input:
    """A linear's FP8 rowwise input: ``q`` float8_e4m3fn [M, K], ``scale`` float32 [M, 1]; ``y`` the bf16 row
    it was quantized from (None unless asked)."""

    q: torch.Tensor
    scale: torch.Tensor
    y: torch.Tensor | None = None


@triton.jit
def _e4m3_code(v):
    """E4M3 byte (int32, sign in bit 7) of fp32 ``v`` with ``|v| <= 448``, round to nearest, ties to even,
    the sign of -0 and of values that round to 0 kept (as ``torch.Tensor.to(torch.float8_e4m3fn)``)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = tl.abs(v)
    mb = mag.to(tl.int32, bitcast=True)
    # normal range (>= 2^-6): keep 3 mantissa bits, round half to even on the integer representation
    rn = ((mb + 0x7FFFF + ((mb >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range (< 2^-6): multiples of 2^-9; adding 2^14 (fp32 ulp 2^-9) rounds to that grid, ties to even
    sub = (mag + 16384.0) - 16384.0
    r = tl.where(mag < 0.015625, sub, rn)
    rb = r.to(tl.int32, bitcast=True)
    byte_norm = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    byte_sub = (r * 512.0).to(tl.int32)
    byte = tl.where(r < 0.015625, byte_sub, byte_norm)
    return byte | (sign << 7)


@triton.jit
def _fp8_producer_kernel(
    a_ptr, stride_am,  # RMSNORM / PLAIN: x [M, K]; SILU_MUL: gu [M, 2K]
    r_ptr, stride_rm,  # the residual [M, K] (HAS_RES)
    w_ptr,  # RMSNorm weight [K]
    s_out_ptr,  # bf16 [M, K]: x + r (HAS_RES)
    y_ptr,  # bf16 [M, K] (WRITE_Y)
    q_ptr,  # uint8 view of float8_e4m3fn [M, K]
    scale_ptr,  # fp32 [M]
    K, eps, e4m3_max, inv_max, amax_floor,
    KIND: tl.constexpr, HAS_RES: tl.constexpr, WRITE_Y: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_RECIP: tl.constexpr, EXACT: tl.constexpr, HW_CVT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    kmask = offs < K
    a_row = a_ptr + row * stride_am
    r_row = r_ptr + row * stride_rm
    if KIND == 0:
        s = residual_sum(a_row, r_row, offs, kmask, HAS_RES)
        if HAS_RES:
            tl.store(s_out_ptr + row * K + offs, s.to(tl.bfloat16), mask=kmask)
        rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / K + eps)
        w = tl.load(w_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        y = rne_bf16((s * rstd) * w)
    elif KIND == 1:
        y = produce_row(a_row, r_row, w_ptr, offs, kmask, 1.0, K, KIND, HAS_RES)
    else:
        y = tl.load(a_row + offs, mask=kmask, other=0.0).to(tl.float32)
    if WRITE_Y:
        tl.store(y_ptr + row * K + offs, y.to(tl.bfloat16), mask=kmask)
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor)
    if SCALE_RECIP:
        scale = amax * inv_max
    else:
        scale = tl.math.div_rn(amax, e4m3_max)
    if EXACT:
        q = tl.math.div_rn(y, tl.full(y.shape, 1.0, tl.float32) * scale)
    else:
        q = y * tl.math.div_rn(scale * 0.0 + 1.0, scale)  # 1 / scale, once a row (scale is finite and > 0)
    q = tl.minimum(tl.maximum(q, -e4m3_max), e4m3_max)
    if HW_CVT:
        code = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = _e4m3_code(q).to(tl.uint8)
    tl.store(q_ptr + row * K + offs, code, mask=kmask)
    tl.store(scale_ptr + row, scale)


def _check(t: torch.Tensor, name: str, cols: int) -> None:
    if t.dim() != 2 or t.shape[1] != cols:
        raise FP8Error(f"{name}: expected a 2-D tensor [M, {cols}], got shape {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise FP8Error(f"{name}: expected bfloat16, got {t.dtype}")
    if t.stride(1) != 1:
        raise FP8Error(f"{name}: rows must be contiguous (stride {t.stride()})")


def fp8_producer(kind: str, a: torch.Tensor, *, weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 eps: float = 1e-6, write_y: bool = False, exact: bool = False,
                 num_warps: int | None = None) -> tuple[Fp8Input, torch.Tensor | None]:
    """One launch: the producer ``kind`` (``rms_norm``, ``silu_mul`` or ``plain``) of ``a`` and its per-token E4M3
    quantization (``exact``: the module docstring). ``rms_norm``: ``a`` = x bf16 [M, K], ``weight`` [K], optional ``residual`` [M, K] (added first,
    the sum returned); ``silu_mul``: ``a`` = [gate | up] bf16 [M, 2K]; ``plain``: ``a`` = x bf16 [M, K].
    Returns ``(Fp8Input(q, scale, y), s)`` with ``s = x + residual`` (None without a residual)."""
    if kind not in KINDS:
        raise FP8Error(f"fp8_producer: kind {kind!r} is not one of {', '.join(KINDS)}")
    code = KINDS[kind]
    if a.dim() != 2:
        raise FP8Error(f"fp8_producer({kind}): input: expected a 2-D tensor, got shape {tuple(a.shape)}")
    if code == SILU_MUL and a.shape[1] % 2:
        raise FP8Error(f"fp8_producer(silu_mul): input [M, 2K] has an odd width {a.shape[1]}")
    k_dim = a.shape[1] // 2 if code == SILU_MUL else a.shape[1]
    _check(a, f"fp8_producer({kind}): input", a.shape[1])
    if k_dim > MAX_ONEPASS_K:
        raise FP8Error(f"fp8_producer({kind}): the row is held in registers: K = {k_dim} is over {MAX_ONEPASS_K}")
    if code == RMSNORM:
        if weight is None or weight.shape != (k_dim,):
            raise FP8Error(f"fp8_producer(rms_norm): weight: expected shape ({k_dim},), got "
                           f"{None if weight is None else tuple(weight.shape)}")
        if residual is not None:
            _check(residual, "fp8_producer(rms_norm): residual", k_dim)
            if residual.shape[0] != a.shape[0]:
                raise FP8Error(f"fp8_producer(rms_norm): residual has {residual.shape[0]} rows, input {a.shape[0]}")
    elif residual is not None:
        raise FP8Error(f"fp8_producer({kind}): a residual is added only before an RMSNorm")
    m, dev = a.shape[0], a.device
    q = torch.empty((m, k_dim), dtype=FP8_DTYPE, device=dev)
    scale = torch.empty((m, 1), dtype=torch.float32, device=dev)
    y = torch.empty((m, k_dim), dtype=torch.bfloat16, device=dev) if write_y else None
    s = torch.empty((m, k_dim), dtype=torch.bfloat16, device=dev) if residual is not None else None
    block_k = triton.next_power_of_2(max(k_dim, 16))
    nw = producer_warps(m, block_k, num_warps)  # the NVFP4 producers' rule: the row quantizes here too
    if m:
        _fp8_producer_kernel[(m,)](
            a, a.stride(0),
            residual if residual is not None else a, residual.stride(0) if residual is not None else 0,
            weight if weight is not None else a,
            s if s is not None else a, y if y is not None else a,
            q.view(torch.uint8), scale,
            k_dim, float(eps), float(FP8_E4M3_MAX), 1.0 / FP8_E4M3_MAX, AMAX_FLOOR,
            KIND=code, HAS_RES=residual is not None, WRITE_Y=write_y, BLOCK_K=block_k,
            SCALE_RECIP=SCALE_RECIP_ON_CUDA if a.is_cuda else False, EXACT=exact, HW_CVT=not interpreting(),
            num_warps=nw,
        )
    return Fp8Input(q, scale, y), s


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 write_y: bool = False, exact: bool = False) -> tuple[Fp8Input, torch.Tensor | None]:
    """The residual add + RMSNorm with its FP8 per-token quantization in one launch (vLLM's fused RMSNorm + quant):
    ``(Fp8Input, x + residual)``."""
    return fp8_producer("rms_norm", x, weight=weight, residual=residual, eps=eps, write_y=write_y, exact=exact)


def silu_mul_fp8(gu: torch.Tensor, write_y: bool = False, exact: bool = False) -> Fp8Input:
    """SiLU(gate) · up with its FP8 per-token quantization in one launch (vLLM's fused SiLU·mul + quant)."""
    return fp8_producer("silu_mul", gu, write_y=write_y, exact=exact)[0]


def quantize_fp8(x: torch.Tensor, exact: bool = False) -> Fp8Input:
    """Per-token E4M3 quantization of a bf16 row in one launch (vLLM's ``scaled_fp8_quant``, for o_proj's input)."""
    return fp8_producer("plain", x, exact=exact)[0]


def engine_quantize_fp8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch twin of the kernel's ``exact=False`` quantization: the package's scale
    (:func:`foursight.fp8.quantize_rowwise`'s ``max(amax, 1e-12) / 448``), then ``e4m3(clamp(y · (1 / scale), ±448))``."""
    amax = torch.linalg.vector_norm(y, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_min(AMAX_FLOOR) / FP8_E4M3_MAX
    q = (y.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def reference_fp8_producer(kind: str, a: torch.Tensor, *, weight: torch.Tensor | None = None,
                           residual: torch.Tensor | None = None, eps: float = 1e-6,
                           exact: bool = False) -> tuple[Fp8Input, torch.Tensor | None]:
    """PyTorch twin of :func:`fp8_producer`: the producers' references (:func:`.producers.reference_rms_norm`,
    :func:`.producers.reference_silu_mul`; equal to the kernel's row up to the order of the fp32 sum of squares),
    then the quantization of the bf16 row: :func:`foursight.fp8.quantize_activation_fp8` (``exact``) or
    :func:`engine_quantize_fp8`."""
    if kind == "rms_norm":
        y, s = reference_rms_norm(a, weight, eps, residual)
    elif kind == "silu_mul":
        y, s = reference_silu_mul(a), None
    elif kind == "plain":
        y, s = a, None
    else:
        raise FP8Error(f"reference_fp8_producer: kind {kind!r} is not one of {', '.join(KINDS)}")
    q, scale = quantize_activation_fp8(y, check=False) if exact else engine_quantize_fp8(y)
    return Fp8Input(q, scale, y), s

