"""The dot_scaled form (``foursight.kernels.experimental.dot_scaled``) under TRITON_INTERPRET=1 against the reference.

Triton 3.9's interpreter reads the E4M3 scales of ``tl.dot_scaled`` as E8M0 (``bits << 23``):
:func:`test_interpreter_reads_e4m3_scales_as_e8m0` shows it on a bare ``tl.dot_scaled``. So under the
interpreter the kernel takes its ``INTERP`` branch for the MMA alone: both operands decoded exactly
(``e2m1·scale``) and multiplied with an fp32 ``tl.dot`` — the products the block-scaled MMA forms,
summed in fp32. Everything else the GPU runs is what these tests run: the packed-code and scale
indexing of both tile orientations (``swap`` and not), the K masks, the per-row activation scale and
the per-row weight scale in the epilogue, the BF16 segment as K steps on the same accumulator, bias,
the transposed store of the swapped tile. Like tests/test_kernels.py this file runs in its own process
(scripts/test.sh), and skips where the kernels were built for a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from foursight.kernels.experimental.dot_scaled import (  # noqa: E402
    INTERP_CONFIGS,
    DotScaledConfig,
    NativeWeight,
    dot_scaled_launch,
    dot_scaled_linear,
    prepare_native_weight,
)
from foursight.layer import quantize_weight, reference_linear  # noqa: E402
from foursight.nvfp4 import NVFP4Error, e2m1_values, unpack_fp4  # noqa: E402
from foursight.quant_methods.sharding import concat_shards  # noqa: E402

pytestmark = interpreted_only


@triton.jit
def _bare_dot_scaled(a_ptr, as_ptr, b_ptr, bs_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    a = tl.load(a_ptr + rm[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :])
    b = tl.load(b_ptr + rn[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :])
    sa = tl.load(as_ptr + rm[:, None] * (BK // 16) + tl.arange(0, BK // 16)[None, :])
    sb = tl.load(bs_ptr + rn[:, None] * (BK // 16) + tl.arange(0, BK // 16)[None, :])
    tl.store(o_ptr + rm[:, None] * BN + rn[None, :], tl.dot_scaled(a, sa, "e2m1", tl.trans(b), sb, "e2m1"))


def test_interpreter_reads_e4m3_scales_as_e8m0():
    """Why the kernel has an INTERP branch. If this fails, Triton's interpreter honours E4M3 scales now,
    and the INTERP branch can go (the tests below would then run ``tl.dot_scaled`` itself)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=g)
    sa = (torch.rand(16, 4, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
    sb = (torch.rand(16, 4, generator=g) * 4 + 0.1).to(torch.float8_e4m3fn)
    out = torch.empty(16, 16)
    _bare_dot_scaled[(1,)](a, sa, b, sb, out, 16, 16, 64)
    dq = lambda p, s: e2m1_values(unpack_fp4(p)) * s.repeat_interleave(16, 1)  # noqa: E731
    as_e4m3 = dq(a, sa.float()) @ dq(b, sb.float()).t()
    e8m0 = lambda s: (s.view(torch.uint8).int() << 23).view(torch.float32)  # noqa: E731
    as_e8m0 = dq(a, e8m0(sa)) @ dq(b, e8m0(sb)).t()
    assert torch.allclose(out, as_e8m0, rtol=1e-6, atol=1e-30)
    assert not torch.allclose(out, as_e4m3, rtol=1e-2)


@pytest.mark.parametrize("cfg", ["swap", "ss"])
def test_the_native_mma_branch_with_scales_read_as_e8m0(cfg):
    """The ``tl.dot_scaled`` branch the GPU compiles, run by the interpreter: with scale bytes in E8M0's
    useful range and a reference that reads them as E8M0 (what the interpreter does), the output checks
    that branch's operands — codes packed along K low nibble first, the weight tile transposed (or, swapped,
    the activation tile), scales [rows, K/16] untransposed — and the epilogue around it, bit for bit up to
    fp32 summation order. The scale *type* (UE4M3 on the GPU) is the SASS check's business."""
    g = torch.Generator().manual_seed(3)
    m, n, k_dim, kk = 5, 160, 192, 3
    rb = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=g)  # noqa: E731
    sb = lambda *s: torch.randint(122, 133, s, dtype=torch.uint8, generator=g)  # noqa: E731  (2^-5 .. 2^5 as E8M0)
    packed, scale = rb(m, k_dim // 2), sb(m, k_dim // 16)
    a_gs = 2.0 ** torch.randint(-2, 3, (m,), generator=g).float()
    nw = NativeWeight(weight_packed=rb(n, k_dim // 2), weight_scale=sb(n, k_dim // 16),
                      weight_global_scale=2.0 ** torch.randint(-2, 3, (n,), generator=g).float(),
                      bf16_channels=torch.tensor([1, 50, 99], dtype=torch.int32), channel_mask=torch.zeros(k_dim, dtype=torch.uint8),
                      weight_bf16=torch.randn(n, kk, generator=g).to(torch.bfloat16))
    xs = torch.randn(m, kk, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    out = torch.empty(m, n)
    dot_scaled_launch(INTERP_CONFIGS[cfg], packed, scale, a_gs, xs, nw, bias, out, emulate_mma=False)
    e8m0 = lambda b: 2.0 ** (b.float() - 127)  # noqa: E731
    av = e2m1_values(unpack_fp4(packed)) * e8m0(scale).repeat_interleave(16, 1)
    wv = e2m1_values(unpack_fp4(nw.weight_packed)) * e8m0(nw.weight_scale).repeat_interleave(16, 1)
    ref = (av.double() @ wv.double().t()) / (a_gs.double()[:, None] * nw.weight_global_scale.double()[None, :])
    ref = ref + xs.double() @ nw.weight_bf16.double().t() + bias.double()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the same bytes through the emulated branch give E4M3's reading instead: the two branches differ only there
    out_e = torch.empty(m, n)
    dot_scaled_launch(INTERP_CONFIGS[cfg], packed, scale, a_gs, xs, nw, bias, out_e, emulate_mma=True)
    assert not torch.allclose(out_e, out, rtol=1e-2)


def _layer(n, k_dim, channels, per_row=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ch = torch.tensor(channels, dtype=torch.int64)
    if per_row:  # a fused layer: each shard its own weight global scale
        half = n // 2
        return concat_shards([quantize_weight(torch.randn(half, k_dim, generator=g), ch),
                              quantize_weight(3 * torch.randn(n - half, k_dim, generator=g), ch)])
    return quantize_weight(torch.randn(n, k_dim, generator=g), ch)


def _x(m, k_dim, channels, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_dim, generator=g) * 2
    if channels:
        x[:, list(channels)] *= 20
    return x.to(dtype)


@pytest.mark.parametrize("cfg", ["swap", "ss"])
@pytest.mark.parametrize("m,n,k_dim,channels,per_row,static,bias,dtype", [
    (1, 128, 128, (), False, False, False, torch.bfloat16),
    (5, 160, 192, (3, 17, 40, 100, 191), True, False, True, torch.bfloat16),  # N not a tile multiple, ragged K tile
    (20, 128, 80, (7,), False, True, True, torch.bfloat16),  # K = 80: the masked K tail; two token tiles
    (3, 128, 128, tuple(range(0, 128, 5)), True, True, False, torch.float16),  # k = 26 > BLOCK_KS: two BF16 steps
])
def test_dot_scaled_matches_the_reference(cfg, m, n, k_dim, channels, per_row, static, bias, dtype):
    qw = _layer(n, k_dim, channels, per_row)
    nw = prepare_native_weight(qw, "L0.mlp.up_proj")
    x = _x(m, k_dim, channels, dtype)
    b = torch.randn(n).to(dtype) if bias else None
    igs = torch.tensor([2688.0 / 40]) if static else None
    y = dot_scaled_linear(x, nw, b, igs, config=INTERP_CONFIGS[cfg])
    assert y.shape == (m, n) and y.dtype == dtype
    ref = reference_linear(x, qw, b, igs, out_dtype=torch.float32)
    # the output's own rounding (bf16: 2^-8 relative, fp16: 2^-11) plus fp32 accumulation order
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-10
    err = (y.float() - ref).abs()
    assert (err <= ulp * ref.abs() + 1e-4 * ref.abs().max()).all(), (err.max(), ref.abs().max())


def test_dot_scaled_without_the_bf16_segment_is_far_off():
    """The test above can fail: the same kernel with the BF16 channels' weights zeroed is far off."""
    channels = (3, 17)
    qw = _layer(128, 128, channels)
    x = _x(4, 128, channels)
    ref = reference_linear(x, qw, None, None, out_dtype=torch.float32)
    nw = prepare_native_weight(qw)
    nw.weight_bf16 = torch.zeros_like(nw.weight_bf16)
    y = dot_scaled_linear(x, nw, None, None, config=INTERP_CONFIGS["swap"])
    assert (y.float() - ref).abs().max() > 0.1 * ref.abs().max()


def test_dot_scaled_refusals():
    qw = _layer(128, 128, (1,))
    nw = prepare_native_weight(qw, "L9.o_proj")
    with pytest.raises(NVFP4Error, match="L9.o_proj: the dot_scaled form takes bf16 or fp16"):
        dot_scaled_linear(_x(2, 128, (1,), torch.float32), nw, name="L9.o_proj")
    with pytest.raises(NVFP4Error, match="L9.o_proj: input last dim 64"):
        dot_scaled_linear(_x(2, 64, ()), nw, name="L9.o_proj")
    with pytest.raises(ValueError, match="must be >= 128"):
        DotScaledConfig(swap=False, block_m=16, block_n=128, block_k=256)
