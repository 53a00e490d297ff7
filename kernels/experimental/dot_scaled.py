"""Kernel form: native NVFP4 SpliceGEMM for Blackwell (sm_100 / sm_120) through Triton's ``tl.dot_scaled``.

``Y = (A_e2m1·sA) · (W_e2m1·sW)ᵀ / (gs_a[m]·gs_w[n]) + X[:, S] · W[:, S]ᵀ (+ bias)`` with

* the FP4 part on the block-scaled FP4 tensor cores: ``tl.dot_scaled`` with E2M1 × E2M1 operands
  (packed two per byte, even column in the low nibble: the checkpoint's own layout) and E4M3
  block-16 scales (``float8e4nv`` scale tensors: Triton lowers them to
  ``tcgen05.mma ... kind::mxf4nvf4.block_scale.block16`` on sm_100a and to
  ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X ... ue4m3`` on sm_120a;
  ``benchmarks/kernels/sass_blackwell.py`` checks the SASS of every configuration below);
* the per-row activation global scale and the per-row weight global scale applied once per tile in
  the epilogue;
* then the BF16 segment as extra ``tl.dot`` K steps into the same fp32 accumulator, then the bias.

The activation codes, scales, per-row global scales and ``X[:, S]`` come from the activation
quantization kernel (:mod:`.act_quant`, bit-exact with the reference); the weight is its
:class:`NativeWeight`: the checkpoint's packed codes and scale bytes as they are (S nibbles forced
to 0), which is what the FP4 tensor cores read, so nothing is re-laid (the FlashInfer backend,
:mod:`.flashinfer_gemm`, starts from the same form and swizzles the scales).

Tiles: tcgen05 needs an MMA M of 128 with FP4, so on sm_100 a tile with fewer than 128 token rows
falls back to a BF16 emulation (``UTCHMMA``/``HMMA`` after decoding; seen in the SASS). The decode
configurations therefore swap A and B (``swap``: the weight's 128 rows are the MMA's M, the tokens
its N, 16–64 wide), and prefill uses 128-row token tiles. sm_120 (``mma.sync`` m16n8k64) takes
either.

Reference: :func:`foursight.layer.reference_linear` (equal up to fp32 accumulation order).

**Under Triton's CPU interpreter** ``tl.dot_scaled`` reads E4M3 scale bytes as E8M0 (``bits << 23``;
Triton 3.9, ``tests/test_blackwell_kernels.py`` shows it), so there (``EMULATE_MMA``, on with ``INTERP``)
the same kernel decodes both operands with :func:`~.primitives.fp4_tile` (exact ``e2m1·s·2^-14``) and
multiplies them with an fp32 ``tl.dot``: the same products (each exact in fp32) summed in fp32, i.e. the
equivalent formulation of the block-scaled MMA. Everything else (tile indexing, masks, epilogue, BF16
segment, stores) is the code the GPU runs. The ``tl.dot_scaled`` branch itself is also run by the
interpreter in a test, with scale bytes compared as E8M0, which checks its operands (packing, transposes,
scale shapes) but not the scale type (the SASS check does: UE4M3).
**Nothing of this form has run on a Blackwell GPU.**
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foursight.layer import PackedLayerShape, QuantizedWeight
from foursight.nvfp4 import NVFP4Error

from .. import act_quant as _aq
from ..prepared import checked_tensors, linear_operands
from ..primitives import bf16_rne, fp4_tile, tile_ids
from ..tile_steps import bf16_segment
from ..runtime import interpreting


@dataclass
class NativeWeight(PackedLayerShape):
    """The execution form of a layer for the native-FP4 backends: the checkpoint's layout itself.

    Attributes:
        weight_packed: uint8 [N, K/2] contiguous, the S columns' nibbles forced to 0.
        weight_scale: uint8 [N, K/16] contiguous, the E4M3 block-scale bytes.
        weight_global_scale: float32 [N] (a per-tensor [1] scale broadcast, or the per-row one).
        bf16_channels: int32 [k] sorted; channel_mask: uint8 [K], 1 at S.
        weight_bf16: bfloat16 [N, k] contiguous.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    bf16_channels: torch.Tensor
    channel_mask: torch.Tensor
    weight_bf16: torch.Tensor


def prepare_native_weight(qw: QuantizedWeight, name: str = "layer") -> NativeWeight:
    """:class:`NativeWeight` of ``qw`` (idempotent; ``qw`` is not modified). Bad shapes or dtypes raise
    :class:`~foursight.nvfp4.NVFP4Error` naming the tensor."""
    t = checked_tensors(qw, name)
    return NativeWeight(
        weight_packed=t.packed,
        weight_scale=t.scale.clone(),
        weight_global_scale=t.global_scale,
        bf16_channels=t.channels,
        channel_mask=t.channel_mask,
        weight_bf16=t.weight_bf16,
    )


@dataclass(frozen=True)
class DotScaledConfig:
    """One tile of the dot_scaled form. ``swap``: the tile is ``Yᵀ[BN, BM]`` (weight rows as the MMA's
    M: what sm_100 needs when the token tile is below 128 rows)."""

    swap: bool
    block_m: int
    block_n: int
    block_k: int
    block_ks: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"DotScaledConfig: block_k={self.block_k} must be a multiple of 64 (one FP4 MMA K step)")
        mma_m = self.block_n if self.swap else self.block_m
        if mma_m < 128:
            raise ValueError(f"DotScaledConfig: the MMA's M ({mma_m}) must be >= 128 for the sm_100 block-scaled MMA "
                             "(use swap=True for small token tiles)")
        if self.swap and self.block_m < 16:
            raise ValueError(f"DotScaledConfig: a swapped token tile of {self.block_m} rows is below tcgen05's N = 16")

    @property
    def name(self) -> str:
        return f"dot_scaled/{'swap' if self.swap else 'ss'}/{self.block_m}/{self.block_n}/{self.block_k}/{self.num_warps}/{self.num_stages}"


#: The configurations the dispatcher picks from by M (:func:`config_for`); every one is compiled for
#: sm_100a and sm_120a by ``benchmarks/kernels/sass_blackwell.py``. Untuned: no Blackwell timing exists.
CONFIGS: dict[str, DotScaledConfig] = {
    "decode16": DotScaledConfig(swap=True, block_m=16, block_n=128, block_k=256),
    "decode32": DotScaledConfig(swap=True, block_m=32, block_n=128, block_k=256),
    "mid64": DotScaledConfig(swap=True, block_m=64, block_n=128, block_k=256),
    "prefill": DotScaledConfig(swap=False, block_m=128, block_n=128, block_k=256, num_warps=8),
}

#: Small tiles for the CPU interpreter (same code paths: swap and not).
INTERP_CONFIGS: dict[str, DotScaledConfig] = {
    "swap": DotScaledConfig(swap=True, block_m=16, block_n=128, block_k=64, block_ks=16),
    "ss": DotScaledConfig(swap=False, block_m=128, block_n=16 * 8, block_k=64, block_ks=16),
}


def config_for(m: int) -> DotScaledConfig:
    """The configuration for M token rows (GPU)."""
    if m <= 16:
        return CONFIGS["decode16"]
    if m <= 32:
        return CONFIGS["decode32"]
    if m <= 64:
        return CONFIGS["mid64"]
    return CONFIGS["prefill"]


@triton.jit
def dot_scaled_kernel(
    a_ptr, stride_am,  # uint8 [M, K/2]: packed E2M1 codes of the activation (S columns zero)
    as_ptr, stride_asm,  # uint8 [M, K/16]: its E4M3 block-scale bytes
    a_gs_ptr,  # fp32 [M]: per-row activation global scale
    wp_ptr, stride_wpn,  # uint8 [N, K/2]
    ws_ptr, stride_wsn,  # uint8 [N, K/16]
    w_gs_ptr,  # fp32 [N]
    xs_ptr, stride_xsm,  # [M, KS] = X[:, S] (contiguous, x's dtype)
    wb_ptr, stride_wbn,  # bf16 [N, KS]
    bias_ptr,
    out_ptr, stride_om, stride_on,
    M, N, K, KS,
    SWAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_KS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
    GROUP_M: tl.constexpr,
    EMULATE_MMA: tl.constexpr,
    INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    KH: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    kh = tl.arange(0, KH)
    g = tl.arange(0, G)

    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 // 2 + kh)[None, :])
            sa = tl.load(as_ptr + rm[:, None] * stride_asm + (k0 // 16 + g)[None, :])
            w = tl.load(wp_ptr + rn[:, None] * stride_wpn + (k0 // 2 + kh)[None, :])
            sw = tl.load(ws_ptr + rn[:, None] * stride_wsn + (k0 // 16 + g)[None, :])
        else:
            km = (k0 // 2 + kh) < K // 2
            gm = (k0 // 16 + g) < K // 16
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k0 // 2 + kh)[None, :], mask=km[None, :], other=0)
            sa = tl.load(as_ptr + rm[:, None] * stride_asm + (k0 // 16 + g)[None, :], mask=gm[None, :], other=0)
            w = tl.load(wp_ptr + rn[:, None] * stride_wpn + (k0 // 2 + kh)[None, :], mask=km[None, :], other=0)
            sw = tl.load(ws_ptr + rn[:, None] * stride_wsn + (k0 // 16 + g)[None, :], mask=gm[None, :], other=0)
        if EMULATE_MMA:
            # the interpreter's dot_scaled reads E4M3 scales as E8M0: the same products, decoded exactly
            va = fp4_tile(tl.reshape(a, (BLOCK_M, G, 8)).to(tl.int32), sa.to(tl.int32), BLOCK_M, BLOCK_K).to(tl.float32)
            vw = fp4_tile(tl.reshape(w, (BLOCK_N, G, 8)).to(tl.int32), sw.to(tl.int32), BLOCK_N, BLOCK_K).to(tl.float32)
            if SWAP:
                acc = tl.dot(vw * 16384.0, tl.trans(va * 16384.0), acc)
            else:
                acc = tl.dot(va * 16384.0, tl.trans(vw * 16384.0), acc)
        else:
            sa8 = sa.to(tl.float8e4nv, bitcast=True)
            sw8 = sw.to(tl.float8e4nv, bitcast=True)
            if SWAP:
                acc = tl.dot_scaled(w, sw8, "e2m1", tl.trans(a), sa8, "e2m1", acc)
            else:
                acc = tl.dot_scaled(a, sa8, "e2m1", tl.trans(w), sw8, "e2m1", acc)

    # epilogue: the per-row activation scale and the weight's per-row scale, once per tile
    ags = tl.load(a_gs_ptr + rm)
    wgs = tl.load(w_gs_ptr + rn)
    if SWAP:
        acc = acc * (1.0 / wgs)[:, None] * (1.0 / ags)[None, :]
    else:
        acc = acc * (1.0 / ags)[:, None] * (1.0 / wgs)[None, :]

    # the BF16 segment: extra K steps into the same accumulator
    if HAS_KS:
        acc = bf16_segment(acc, xs_ptr, stride_xsm, 1, xs_ptr, wb_ptr, stride_wbn, rm, rn, 0, KS,
                            BLOCK_KS, True, True, SWAP, INTERP)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn).to(tl.float32)
        if SWAP:
            acc += bias[:, None]
        else:
            acc += bias[None, :]
    if INTERP and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = bf16_rne(acc, INTERP)
    if SWAP:
        omask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None].to(tl.int64) * stride_on
    else:
        omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def dot_scaled_launch(cfg: DotScaledConfig, packed, scale, a_gs, xs, pw: NativeWeight, bias, out,
                      emulate_mma: bool | None = None) -> torch.Tensor:
    """Launch the kernel on an already-quantized activation (``packed`` uint8 [M, K/2], ``scale`` uint8
    [M, K/16], ``a_gs`` fp32 [M], ``xs`` [M, k] = X[:, S]) into ``out`` [M, N]. ``emulate_mma``: decode
    and fp32-multiply instead of ``tl.dot_scaled`` (default: under the interpreter only; the tests also
    run ``tl.dot_scaled`` there, with scale bytes it reads as E8M0, to check the native branch's operands)."""
    m = packed.shape[0]
    n, k_dim, kk = pw.out_features, pw.in_features, pw.num_channels
    dummy = pw.weight_global_scale
    interp = interpreting()
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    extra = {} if interp else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    dot_scaled_kernel[grid](
        packed, packed.stride(0), scale, scale.stride(0), a_gs,
        pw.weight_packed, pw.weight_packed.stride(0), pw.weight_scale, pw.weight_scale.stride(0), pw.weight_global_scale,
        xs if kk else dummy, xs.stride(0) if kk else 0,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
        out, out.stride(0), out.stride(1),
        m, n, k_dim, kk,
        SWAP=cfg.swap, HAS_BIAS=bias is not None, HAS_KS=kk > 0, EVEN_K=k_dim % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_KS=cfg.block_ks, GROUP_M=cfg.group_m,
        EMULATE_MMA=interp if emulate_mma is None else emulate_mma, INTERP=interp, **extra,
    )
    return out


def dot_scaled_linear(
    x: torch.Tensor,
    pw: NativeWeight,
    bias: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    config: DotScaledConfig | None = None,
    name: str = "layer",
) -> torch.Tensor:
    """W4A4 FourSight linear on the dot_scaled form: activation quantization (dynamic per-row or the
    static ``input_global_scale``) + the kernel. ``x`` [..., K] bf16/fp16; returns [..., N] in x's
    dtype. W4A16 is not a mode of this form (the dispatcher refuses it)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise NVFP4Error(f"{name}: the dot_scaled form takes bf16 or fp16 activations, got {x.dtype}")
    lead, x2, out = linear_operands(x, pw, bias, name)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, pw.out_features)
    packed, scale, _, gs, xs = _aq.act_quant_launch(x2, pw.channel_mask, pw.bf16_channels, input_global_scale, True, False, True)
    if interpreting() and config is None:
        config = INTERP_CONFIGS["swap" if m <= 16 else "ss"]
    dot_scaled_launch(config or config_for(m), packed, scale, gs, xs, pw, bias, out)
    return out.reshape(*lead, pw.out_features)


class DotScaledBackend:
    """The linear adapter of the experimental ``dot_scaled`` backend (``foursight.dispatch.LinearBackend``;
    ``FOURSIGHT_KERNEL_BACKEND=dot_scaled``): W4A4 with static or dynamic activation scales."""

    name = "dot_scaled"

    def supports(self, qw: QuantizedWeight) -> bool:
        return qw.weight_packed.is_cuda

    def prepare(self, qw: QuantizedWeight, name: str, channels_checked: bool = False) -> tuple[str, NativeWeight]:
        return name, prepare_native_weight(qw, name)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        name, pw = state
        if not act_quant:
            raise NVFP4Error(f"{name}: the dot_scaled backend runs W4A4 only; serve W4A16 checkpoints with "
                             "FOURSIGHT_KERNEL_BACKEND=triton")
        return dot_scaled_linear(x, pw, bias, input_global_scale, name=name)


#: what ``foursight.kernels.backends.load_backend("dot_scaled")`` returns
BACKEND = DotScaledBackend()
