"""Kernel form: a linear's producer with the NVFP4 activation quantizer fused into it (``_producer_kernel``).

In a decoder layer three of the four linears read the output of a cheap row-wise op: qkv and gate_up read
an RMSNorm (after the residual add), down reads SiLU·mul of gate_up's output. Run unfused, each of them is
two launches on the decode step's critical path: the producer, then the standalone quantizer
(:mod:`.act_quant`), which reads the producer's row back. This kernel is both in one launch, one program per
row (issue 36 item 2, "fuse the quantizer into the producer"):

* ``RMSNORM``: ``s = bf16(x + r)`` (with ``residual``; written back, as engines' fused add-norm does),
  ``y = bf16(s · rsqrt(mean(s²) + eps) · w)``;
* ``SILU_MUL``: from ``gu = [g | u]`` [M, 2K], ``y = bf16(g / (1 + exp(-g)) · u)``.

``y`` is computed in fp32 and rounded once to bf16 (the producer's output dtype). With a consumer (the
prepared weight of the linear that reads ``y``) the bf16 row is quantized in registers with the quantizer's
own primitives into the operands the fragment tiles read: ``deq = q · s`` (bf16), the per-row dynamic global
scale (or the static one) and the dense ``X[:, S]`` copy (``y`` at the consumer's BF16 channels, recomputed
from the inputs at those channels with the same arithmetic). So the quantized operands are bit-identical to
running the producer and then :func:`foursight.kernels.api.quantize_activation` on its bf16 output
(``tests/test_producers.py``). The bf16 row itself is written only when asked (``write_y``: a consumer whose
chosen tile is not a fragment tile, the tests, and the BF16 engines' path, where this is the producer alone).

Reference: the producer in PyTorch (:func:`reference_rms_norm`, :func:`reference_silu_mul`, equal up to the
order of the fp32 sum of squares), then :func:`foursight.layer.quantize_activation`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foursight.nvfp4 import NVFP4Error

from .act_quant import FEW_ROWS, static_global_scale
from .primitives import DIV6_RECIP_ON_CUDA, MAX_ONEPASS_K, global_scale, quant_xb, rne_bf16
from .runtime import interpreting

RMSNORM: int = 0
SILU_MUL: int = 1


@dataclass(frozen=True)
class ProducedInput:
    """A linear's input as a fused producer left it (:func:`foursight.kernels.api.rms_norm`,
    :func:`~foursight.kernels.api.silu_mul`); :func:`~foursight.kernels.api.splice_linear` takes it for ``x``.

    ``y``: the bf16 row (None when not written); ``deq``/``gs``/``xs``: the activation quantized for
    ``consumer`` (bf16 ``q · s`` [M, K], fp32 global scales [M], bf16 ``X[:, S]`` [M, k]), None without one;
    ``static_gs``: whether ``gs`` is a static activation scale broadcast (the linear's autotuner keys on it)."""

    y: torch.Tensor | None
    deq: torch.Tensor | None = None
    gs: torch.Tensor | None = None
    xs: torch.Tensor | None = None
    consumer: object = None
    static_gs: bool = False


def producer_warps(m: int, block_k: int, num_warps: int | None = None, few_rows: bool = True) -> int:
    """Warps of one producer program (one row of ``block_k`` values): more for wider rows, 32 at few rows of a
    wide K when the row quantizes (``few_rows``: as the standalone quantizer, the row's latency chain is the
    time there), ``num_warps`` when given (the probes force it), 4 under the interpreter. The NVFP4 and the FP8
    producers both take it."""
    if interpreting():
        return 4
    if num_warps is not None:
        return num_warps
    nw = 4 if block_k <= 2048 else (8 if block_k <= 8192 else 16)
    if few_rows and m <= FEW_ROWS and block_k >= 4096:
        nw = 32
    return nw


@triton.jit
def residual_sum(a_row, r_row, offs, mask, HAS_RES: tl.constexpr):
    """``bf16(x + r)`` as fp32 (``x`` alone without a residual) at columns ``offs``."""
    s = tl.load(a_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = rne_bf16(s + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32))
    return s


@triton.jit
def produce_row(a_row, r_row, w_ptr, offs, mask, rstd, K, KIND: tl.constexpr, HAS_RES: tl.constexpr):
    """The bf16-rounded producer output (as fp32) at columns ``offs``; ``rstd``: the row's RMSNorm factor."""
    if KIND == 0:
        s = residual_sum(a_row, r_row, offs, mask, HAS_RES)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = rne_bf16((s * rstd) * w)
    else:
        g = tl.load(a_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(a_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        y = rne_bf16((g / (1.0 + tl.exp(-g))) * u)
    return y


@triton.jit
def _producer_kernel(
    a_ptr, stride_am,  # RMSNORM: x [M, K]; SILU_MUL: gu [M, 2K]
    r_ptr, stride_rm,  # the residual [M, K] (HAS_RES)
    w_ptr,  # RMSNorm weight [K]
    s_out_ptr,  # bf16 [M, K]: x + r (HAS_RES)
    y_ptr,  # bf16 [M, K] (WRITE_Y)
    smask_ptr, ch_ptr,  # the consumer's S mask uint8 [K] and channels int32 [KS]
    gs_in_ptr,  # fp32 [1] static global scale (STATIC_GS)
    deq_ptr, gs_out_ptr, xs_ptr,  # bf16 [M, K] q*s, fp32 [M], bf16 [M, KS] (QUANT)
    K, KS, eps,
    KIND: tl.constexpr, HAS_RES: tl.constexpr, WRITE_Y: tl.constexpr, QUANT: tl.constexpr,
    HAS_CH: tl.constexpr, STATIC_GS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_KS: tl.constexpr, DIV6_RECIP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    kmask = offs < K
    a_row = a_ptr + row * stride_am
    r_row = r_ptr + row * stride_rm
    rstd = 1.0
    if KIND == 0:
        s = residual_sum(a_row, r_row, offs, kmask, HAS_RES)
        if HAS_RES:
            tl.store(s_out_ptr + row * K + offs, s.to(tl.bfloat16), mask=kmask)
        rstd = tl.math.rsqrt(tl.sum(s * s, axis=0) / K + eps)
        w = tl.load(w_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        y = rne_bf16((s * rstd) * w)
    else:
        y = produce_row(a_row, r_row, w_ptr, offs, kmask, rstd, K, KIND, HAS_RES)
    if WRITE_Y:
        tl.store(y_ptr + row * K + offs, y.to(tl.bfloat16), mask=kmask)
    if QUANT:
        x = y
        if HAS_CH:
            sm = tl.load(smask_ptr + offs, mask=kmask, other=0)
            x = tl.where(sm != 0, 0.0, x)
        xb = tl.reshape(x, (BLOCK_K // 16, 16))
        bamax = tl.max(tl.abs(xb), axis=1)
        if STATIC_GS:
            gs = tl.load(gs_in_ptr)
        else:
            gs = global_scale(tl.max(bamax, axis=0))
        _packed, _sbyte, deq = quant_xb(xb, bamax, gs, BLOCK_K, DIV6_RECIP)
        tl.store(deq_ptr + row * K + offs, deq.to(tl.bfloat16), mask=kmask)
        tl.store(gs_out_ptr + row, gs)
        if HAS_CH:
            offs_c = tl.arange(0, BLOCK_KS)
            for c0 in range(0, KS, BLOCK_KS):
                cmask = (c0 + offs_c) < KS
                ch = tl.load(ch_ptr + c0 + offs_c, mask=cmask, other=0)
                yc = produce_row(a_row, r_row, w_ptr, ch, cmask, rstd, K, KIND, HAS_RES)
                tl.store(xs_ptr + row * KS + c0 + offs_c, yc.to(tl.bfloat16), mask=cmask)


def producer_launch(kind: int, a: torch.Tensor, k_dim: int, *, weight=None, residual=None, eps: float = 1e-6,
                    mask=None, channels=None, global_scale=None, quant: bool = False, write_y: bool = True,
                    num_warps: int | None = None):
    """Launch ``_producer_kernel``. Returns ``(y, s, deq, gs, xs)``: ``y`` bf16 [M, K] (None unless ``write_y``),
    ``s`` = x + residual bf16 [M, K] (None without a residual), and with ``quant`` the consumer's operands
    (``deq`` bf16 [M, K], ``gs`` fp32 [M], ``xs`` bf16 [M, KS]); ``mask``/``channels`` are the consumer's."""
    m = a.shape[0]
    dev = a.device
    if k_dim > MAX_ONEPASS_K:
        raise NVFP4Error(f"the fused producers hold a row in registers: K = {k_dim} is over {MAX_ONEPASS_K}")
    if k_dim % 16:
        raise NVFP4Error(f"the fused producers quantize 16-value blocks: K = {k_dim} is not a multiple of 16")
    kk = channels.numel() if (quant and channels is not None) else 0
    y = torch.empty((m, k_dim), dtype=torch.bfloat16, device=dev) if write_y else None
    s = torch.empty((m, k_dim), dtype=torch.bfloat16, device=dev) if residual is not None else None
    deq = torch.empty((m, k_dim), dtype=torch.bfloat16, device=dev) if quant else None
    gs = torch.empty((m,), dtype=torch.float32, device=dev) if quant else None
    xs = torch.empty((m, kk), dtype=torch.bfloat16, device=dev) if quant else None
    dummy = a
    gs_in = static_global_scale(global_scale, dev) if (quant and global_scale is not None) else dummy
    block_k = triton.next_power_of_2(k_dim)
    nw = producer_warps(m, block_k, num_warps, few_rows=quant)
    if m:
        _producer_kernel[(m,)](
            a, a.stride(0),
            residual if residual is not None else dummy, residual.stride(0) if residual is not None else 0,
            weight if weight is not None else dummy,
            s if s is not None else dummy, y if y is not None else dummy,
            mask if kk else dummy, channels if kk else dummy, gs_in,
            deq if quant else dummy, gs if quant else dummy, xs if kk else dummy,
            k_dim, kk, float(eps),
            KIND=kind, HAS_RES=residual is not None, WRITE_Y=write_y, QUANT=quant, HAS_CH=kk > 0,
            STATIC_GS=quant and global_scale is not None,
            BLOCK_K=block_k, BLOCK_KS=max(16, min(256, triton.next_power_of_2(max(kk, 1)))),
            DIV6_RECIP=DIV6_RECIP_ON_CUDA if a.is_cuda else False,
            num_warps=nw,
        )
    return y, s, deq, gs, xs


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """PyTorch twin of the ``RMSNORM`` producer: ``(y, x + residual)`` (the sum None without a residual)."""
    s = (x.float() + residual.float()).to(torch.bfloat16) if residual is not None else x
    sf = s.float()
    rstd = torch.rsqrt(sf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((sf * rstd) * weight.float()).to(torch.bfloat16), (s if residual is not None else None)


def reference_silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of the ``SILU_MUL`` producer."""
    g, u = gu.float().chunk(2, dim=-1)
    return ((g / (1.0 + torch.exp(-g))) * u).to(torch.bfloat16)


def check_producer_input(t: torch.Tensor, name: str, shape: tuple | None = None) -> None:
    """A producer's input ``t`` (named ``name`` in the error): [M, K] (or ``shape``), bf16, unit stride along K."""
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != tuple(shape)):
        raise NVFP4Error(f"{name}: expected {list(shape) if shape else '[M, K]'}, got shape {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise NVFP4Error(f"{name}: the fused producers take bf16, got {t.dtype}")
    if t.shape[1] and t.stride(1) != 1:
        raise NVFP4Error(f"{name}: needs unit stride along its last dimension, got strides {tuple(t.stride())}")


def same_channels(a, b) -> bool:
    """Whether an activation quantized for the prepared layer ``a`` is the one ``b`` reads (the same BF16 channel set)."""
    if a is b or a.bf16_channels is b.bf16_channels:
        return True
    if a.in_features != b.in_features or a.num_channels != b.num_channels:
        return False
    if _capturing():
        return False  # comparing the index tensors would synchronize inside a CUDA-graph capture
    return bool(torch.equal(a.bf16_channels, b.bf16_channels))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
