"""Triton kernels under TRITON_INTERPRET=1 (CPU) against the PyTorch reference (foursight.layer).

* activation quantization: bit-exact (codes, E4M3 scale bytes, global scales, gathered channels);
* SpliceGEMM: within fp32-accumulation tolerance of ``reference_linear`` (fp32 output, so the
  comparison is not hidden behind a bf16 rounding), over M in {1, 3, 16, 17, 64}, K with and
  without a ragged last tile, k in {0, 16, 128}, bias, non-contiguous inputs, static/dynamic
  activation scales, per-tensor/per-row weight scales, W4A16 (bf16 and fp16).

The interpreter is slow: shapes are small and each kernel configuration is a fixed small tile.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.act_quant as fk_aq  # noqa: E402
from foursight.kernels.configs import DequantConfig, FragmentConfig, GemvConfig, SSConfig, SwapConfig  # noqa: E402

from foursight.layer import QuantizedWeight, quantize_activation, quantize_weight, reference_linear
from foursight.nvfp4 import NVFP4Error

# If another test module imported foursight.kernels first (compiled mode), or on a CUDA machine,
# these CPU-interpreter tests skip; run tests/test_kernels.py in its own pytest process.
pytestmark = interpreted_only


def _channels(K: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.sort(torch.randperm(K, generator=g)[:k]).values.to(torch.int32)


def _act(M: int, K: int, g: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(1, K, generator=g))  # per-channel spread
    x[:, :: max(1, K // 5)] *= 20.0  # a few outlier channels
    return x.to(dtype)


def _assert_qa_equal(a, r):
    assert torch.equal(a.packed, r.packed), "packed codes differ"
    assert torch.equal(a.scale.view(torch.uint8), r.scale.view(torch.uint8)), "E4M3 scale bytes differ"
    assert torch.equal(a.global_scale, r.global_scale), "global scales differ"
    assert a.x_bf16.dtype == r.x_bf16.dtype and torch.equal(a.x_bf16, r.x_bf16), "gathered channels differ"


# ---------------------------------------------------------------------------------------------
# activation quantization: bit-exact
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("K,k", [(192, 0), (208, 16), (208, 128), (160, 16)])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_activation_bit_exact(M, K, k, static):
    g = torch.Generator().manual_seed(1000 * M + K + k + static)
    x = _act(M, K, g)
    ch = _channels(K, k, g)
    gs = torch.tensor([37.5]) if static else None
    _assert_qa_equal(fk.quantize_activation(x, ch, gs), quantize_activation(x, ch, gs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_activation_dtypes_and_noncontiguous(dtype):
    g = torch.Generator().manual_seed(7)
    base = _act(96, 33, g, dtype)  # [K, M] storage -> transpose gives a non-contiguous [M, K]
    x = base.t()
    assert not x.is_contiguous()
    ch = _channels(96, 16, g)
    _assert_qa_equal(fk.quantize_activation(x, ch), quantize_activation(x, ch))


def test_quantize_activation_ties_zero_rows_and_zero_blocks():
    # row 0: block amax 6 -> gs = 448, s = 448, x / (s/gs) = x: every E2M1 decision boundary (ties)
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    x = torch.zeros(4, 64)
    x[0, :16] = ties
    x[0, 16:32] = ties * 1e-3  # small block in the same row
    # row 1 stays all zero (gs -> 1.0); row 2 has an all-zero block (scale 0 -> 0.125)
    x[2, 16:] = torch.linspace(-3, 3, 48)
    x[3] = torch.linspace(-1e-30, 1e-30, 64)  # tiny values: E4M3 subnormal scales
    for ch in (torch.tensor([], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)):
        _assert_qa_equal(fk.quantize_activation(x, ch), quantize_activation(x, ch))
        _assert_qa_equal(fk.quantize_activation(x.bfloat16(), ch), quantize_activation(x.bfloat16(), ch))


def test_quantize_activation_multipass(monkeypatch):
    """Rows longer than MAX_ONEPASS_K take the two-pass (amax, then quantize) loop."""
    monkeypatch.setattr(fk_aq, "MAX_ONEPASS_K", 32)
    g = torch.Generator().manual_seed(3)
    x = _act(5, 4160, g)  # 4160 is not a multiple of the 4096-wide loop chunk: ragged last chunk
    ch = _channels(4160, 16, g)
    for gs in (None, torch.tensor([11.0])):
        _assert_qa_equal(fk.quantize_activation(x, ch, gs), quantize_activation(x, ch, gs))


def test_quantize_activation_errors():
    with pytest.raises(NVFP4Error, match="input"):
        fk.quantize_activation(torch.randn(2, 40), torch.tensor([1]))  # K not a multiple of 16
    with pytest.raises(NVFP4Error, match="input"):
        fk.quantize_activation(torch.randn(2, 3, 32), torch.tensor([1]))
    with pytest.raises(NVFP4Error, match="channels"):
        fk.quantize_activation(torch.randn(2, 32), torch.tensor([40]))
    with pytest.raises(NVFP4Error, match="input_global_scale"):
        fk.quantize_activation(torch.randn(2, 32), torch.tensor([1]), torch.ones(2))


# ---------------------------------------------------------------------------------------------
# SpliceGEMM
# ---------------------------------------------------------------------------------------------


def _layer(N: int, K: int, k: int, g: torch.Generator, per_row_gs: bool = False) -> QuantizedWeight:
    w = torch.randn(N, K, generator=g) * 0.05
    ch = _channels(K, k, g)
    qw = quantize_weight(w, ch)
    if per_row_gs:  # e.g. a fused q/k/v shard: each row block with its own global scale
        qw = QuantizedWeight(qw.weight_packed, qw.weight_scale, qw.weight_global_scale.expand(N) * torch.linspace(0.5, 2.0, N),
                             qw.bf16_channels, qw.weight_bf16)
    return qw


def _check(y: torch.Tensor, ref: torch.Tensor):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all()
    scale = ref.abs().max().item() + 1e-6
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= 2e-5 * scale, f"max abs err {err:.3e} vs output scale {scale:.3e}"


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("K", [192, 208])  # 208: ragged last 64-wide K tile
@pytest.mark.parametrize("k", [0, 16, 128])
def test_splice_linear_w4a4(M, K, k):
    if k >= K:
        pytest.skip("k must be < K")
    g = torch.Generator().manual_seed(M * 7 + K + k)
    N = 48
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, K, g, torch.float32).bfloat16().float()  # fp32 in -> fp32 out: a tight comparison
    bias = torch.randn(N, generator=g)
    y = fk.splice_linear(x, pw, bias=bias)
    _check(y, reference_linear(x, qw, bias=bias))


# every kernel form the autotuner can pick, forced: the one-row GEMV, the swap-AB kernel (with and
# without split-K), the SS kernel and dequantize-then-cuBLAS
_KIND_CONFIGS = [
    GemvConfig(16, 64),
    GemvConfig(16, 32),
    SwapConfig(16, 16, 64, 4, 1, 0),
    SwapConfig(32, 32, 32, 4, 1, 2),
    SSConfig(32, 32, 32, 4, 1),
    SSConfig(16, 16, 64, 4, 1),
    SSConfig(16, 32, 32, 4, 1, True),
]


@pytest.mark.parametrize("cfg", _KIND_CONFIGS, ids=str)
@pytest.mark.parametrize("M,K,k", [(1, 208, 16), (3, 192, 0), (4, 208, 128), (17, 208, 16)])
def test_every_kernel_form(cfg, M, K, k):
    if isinstance(cfg, GemvConfig) and M > 1:
        pytest.skip("the GEMV form serves one row")
    g = torch.Generator().manual_seed(M * 13 + K + k)
    N = 40
    qw = _layer(N, K, k, g, per_row_gs=True)
    pw = fk.prepare_weight(qw)
    base = _act(M, 2 * K, g, torch.float32).bfloat16().float()
    x = base[:, ::2]  # non-contiguous along K
    bias = torch.randn(N, generator=g)
    _check(fk.splice_linear(x, pw, bias=bias, config=cfg), reference_linear(x, qw, bias=bias))
    gs = torch.tensor([17.0])
    _check(fk.splice_linear(x, pw, input_global_scale=gs, config=cfg), reference_linear(x, qw, input_global_scale=gs))
    xb = x.bfloat16()
    y16 = fk.splice_gemm(xb, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)
    _check(y16, reference_linear(xb, qw, bias=bias, act_quant=False, out_dtype=torch.float32))


@pytest.mark.parametrize("path", ["decode", "mid", "prefill"])
def test_splice_linear_each_datapath_static_scale_per_row_gs(path):
    g = torch.Generator().manual_seed(11)
    N, K, k, M = 40, 96, 16, 19
    qw = _layer(N, K, k, g, per_row_gs=True)
    pw = fk.prepare_weight(qw)
    x = _act(M, K, g, torch.float32)
    gs = torch.tensor([21.0])
    y = fk.splice_linear(x, pw, input_global_scale=gs, path=path)
    _check(y, reference_linear(x, qw, input_global_scale=gs))


def test_splice_linear_bf16_out_and_leading_dims_noncontiguous():
    g = torch.Generator().manual_seed(5)
    N, K, k = 32, 64, 16
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(2 * 3 * 2, K, g).reshape(2, 3, 2, K)[:, :, 1, :]  # [2, 3, K], non-contiguous
    assert not x.is_contiguous()
    bias = torch.randn(N, generator=g).bfloat16()
    y = fk.splice_linear(x, pw, bias=bias)
    ref = reference_linear(x, qw, bias=bias, out_dtype=torch.float32)
    assert y.shape == (2, 3, N) and y.dtype == torch.bfloat16
    # bf16 output: within one bf16 rounding of the fp32 reference
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,path", [(1, "decode"), (17, "mid"), (33, "prefill")])
def test_splice_gemm_w4a16(dtype, M, path):
    g = torch.Generator().manual_seed(M)
    N, K, k = 40, 160, 16
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, K, g, dtype)
    bias = torch.randn(N, generator=g)
    y = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, path=path)
    _check(y, reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32))
    # the user-facing call returns x's dtype
    y2 = fk.splice_linear(x, pw, bias=bias, act_quant=False)
    assert y2.dtype == dtype


def test_w4a16_ignores_nonzero_fp4_codes_in_bf16_channels():
    """A checkpoint whose FP4 part has codes in S columns: the reference zeroes X[:, S] in W4A16;
    prepare_weight zeroes those nibbles, so the kernel agrees."""
    g = torch.Generator().manual_seed(9)
    N, K = 32, 64
    w = torch.randn(N, K, generator=g)
    ch = torch.tensor([3, 10, 33], dtype=torch.int32)
    q_full = quantize_weight(w, torch.tensor([], dtype=torch.int32))
    qw = QuantizedWeight(q_full.weight_packed, q_full.weight_scale, q_full.weight_global_scale, ch, w[:, ch.long()].bfloat16())
    pw = fk.prepare_weight(qw)
    x = _act(3, K, g)
    y = fk.splice_gemm(x, pw, None, out_dtype=torch.float32)
    _check(y, reference_linear(x, qw, act_quant=False, out_dtype=torch.float32))


def test_prepare_weight_idempotent_and_does_not_mutate():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    q_full = quantize_weight(w, torch.tensor([], dtype=torch.int32))
    qw = QuantizedWeight(q_full.weight_packed, q_full.weight_scale, q_full.weight_global_scale,
                         torch.tensor([1, 6], dtype=torch.int32), w[:, [1, 6]].bfloat16())
    before = [t.clone() for t in qw.tensors()]
    p1, p2 = fk.prepare_weight(qw), fk.prepare_weight(qw)
    for a, b in zip(qw.tensors(), before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    for name in ("weight_packed", "weight_scale", "weight_global_scale", "bf16_channels", "channel_mask", "weight_bf16"):
        assert torch.equal(getattr(p1, name), getattr(p2, name)), name
    assert p1.weight_global_scale.shape == (16,)
    # the S nibbles are zero in the prepared copy (column 1: high nibble of byte 0; column 6: low of byte 3)
    assert int((p1.weight_packed[:, 0] >> 4).max()) == 0 and int((p1.weight_packed[:, 3] & 0xF).max()) == 0


def test_splice_linear_errors():
    g = torch.Generator().manual_seed(4)
    qw = _layer(16, 64, 16, g)
    pw = fk.prepare_weight(qw)
    with pytest.raises(NVFP4Error, match="input"):
        fk.splice_linear(torch.randn(2, 48), pw)
    with pytest.raises(NVFP4Error, match="bias"):
        fk.splice_linear(torch.randn(2, 64), pw, bias=torch.randn(15))
    with pytest.raises(NVFP4Error, match="W4A16"):
        fk.splice_linear(torch.randn(2, 64), pw, act_quant=False)  # fp32 activations in W4A16
    bad = QuantizedWeight(qw.weight_packed, qw.weight_scale, torch.ones(3), qw.bf16_channels, qw.weight_bf16)
    with pytest.raises(NVFP4Error, match="weight_global_scale"):
        fk.prepare_weight(bad)
    bad = QuantizedWeight(qw.weight_packed, qw.weight_scale[:, :2], qw.weight_global_scale, qw.bf16_channels, qw.weight_bf16)
    with pytest.raises(NVFP4Error, match="weight_scale"):
        fk.prepare_weight(bad)
    bad = QuantizedWeight(qw.weight_packed, qw.weight_scale, qw.weight_global_scale, qw.bf16_channels, qw.weight_bf16[:, :3])
    with pytest.raises(NVFP4Error, match="weight_bf16"):
        fk.prepare_weight(bad)


def test_empty_batch():
    g = torch.Generator().manual_seed(8)
    pw = fk.prepare_weight(_layer(16, 64, 16, g))
    assert fk.splice_linear(torch.randn(0, 64).bfloat16(), pw).shape == (0, 16)


def test_blackwell_path_not_taken_here():
    from foursight.kernels.backends import blackwell_fp4_available

    assert blackwell_fp4_available() is False


@pytest.mark.parametrize("per_row_gs", [False, True])
@pytest.mark.parametrize("M,K,k", [(1, 208, 16), (19, 192, 0), (33, 208, 128)])
def test_dequant_cublas_form(M, K, k, per_row_gs):
    """Dequantize-then-cuBLAS: bf16 in and out, within the bf16 rounding of its operands (the
    activation's fake-quantized value, and the weight's when the weight scale is per row) of the
    reference; the S segment and the activation codes are exact."""
    g = torch.Generator().manual_seed(70 + M + k + per_row_gs)
    N = 48
    qw = _layer(N, K, k, g, per_row_gs=per_row_gs)
    pw = fk.prepare_weight(qw)
    assert pw.uniform_global_scale is (not per_row_gs)
    x = _act(M, K, g)
    bias = torch.randn(N, generator=g).bfloat16()
    cfg = DequantConfig(64, 128)
    for act_quant, gs in ((True, None), (True, torch.tensor([9.0])), (False, None)):
        y = fk.splice_linear(x, pw, bias=bias, input_global_scale=gs, act_quant=act_quant, config=cfg)
        ref = reference_linear(x, qw, bias=bias, input_global_scale=gs, act_quant=act_quant, out_dtype=torch.float32)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        rel = ((y.float() - ref).norm() / ref.norm()).item()
        assert rel < 4e-3, f"rel err {rel:.2e} (act_quant={act_quant}, static={gs is not None})"
    with pytest.raises(ValueError, match="bf16"):
        fk.splice_linear(x.float(), pw, config=cfg)


@pytest.mark.parametrize("scale_bf16", [False, True], ids=["e5m3", "bf16"])
@pytest.mark.parametrize("cfg", [DequantConfig(64, 128), DequantConfig(128, 256)], ids=str)
def test_dequant_weight_is_exact(cfg, scale_bf16, monkeypatch):
    """W' of the dequant form, read from the fragment form (the layer's one resident weight form):
    e2m1 * s exactly (per-tensor scale), W[:, S] at the S columns; padding in N and K."""
    import foursight.kernels.fragment_layout as frag
    from foursight.kernels.dequant import dequant_weight
    from foursight.nvfp4 import dequantize_nvfp4

    monkeypatch.setattr(frag, "SCALES_AS_BF16", scale_bf16)
    g = torch.Generator().manual_seed(5)
    qw = _layer(130, 400, 16, g)
    pw = fk.prepare_weight(qw)
    w = dequant_weight(cfg, pw, div_gs=False).float()
    ref = dequantize_nvfp4(qw.weight_packed, qw.weight_scale, torch.ones(1))  # q * s, no global scale
    ch = qw.bf16_channels.long()
    ref[:, ch] = qw.weight_bf16.float()
    assert torch.equal(w, ref)


def test_swap_config_refuses_two_warpgroups():
    with pytest.raises(ValueError, match="warpgroup"):
        SwapConfig(128, 128, 64, 8, 3, 0)


def test_naive_emulation_baseline_matches_reference():
    """The benchmark's naive baseline computes the same function (up to bf16 operand rounding)."""
    from foursight.kernels.reference import naive_emulation

    g = torch.Generator().manual_seed(12)
    qw = _layer(32, 128, 16, g)
    x = _act(5, 128, g)
    ref = reference_linear(x, qw, out_dtype=torch.float32)
    y = naive_emulation(x, qw).float()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-2


# ---------------------------------------------------------------------------------------------
# the fragment form (BF16 activations): its execution form and the kernel
# ---------------------------------------------------------------------------------------------


def test_fragment_scale_encoding_is_exact_for_every_e4m3_value():
    """Every non-negative finite E4M3 byte, re-encoded as the E5M3 byte the kernel reads, gives
    bf16 bits byte*16 + 224*128 whose value is exactly scale * 2^119."""
    from foursight.kernels.fragment_layout import SCALE_BIAS_BITS, e5m3_of_e4m3

    b = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    u = e5m3_of_e4m3(b).to(torch.int32)
    bits = (u * 16 + SCALE_BIAS_BITS).to(torch.int16)
    got = bits.view(torch.bfloat16).float()
    want = b.view(torch.float8_e4m3fn).float() * 2.0**119
    nz = want != 0
    assert torch.equal(got[nz], want[nz])
    with pytest.raises(ValueError, match="block scale"):
        e5m3_of_e4m3(torch.tensor([0x7F], dtype=torch.uint8))


def _decode_fragment_words(fw) -> torch.Tensor:
    """Independent decoder of the stored words: E2M1 codes [Np, Kp] in real order, from the bit
    table and the stored-row/word map alone (no kernel code)."""
    from foursight.kernels.fragment_layout import FRAG_COLS, FRAG_ROWS, tile_map

    srow, word, bits = tile_map("cpu")
    w = fw.words.to(torch.int64) & 0xFFFFFFFF
    np_, kw = w.shape
    nb, nc = np_ // FRAG_ROWS, kw // 16
    w = w.reshape(nb, FRAG_ROWS, nc, 16)
    sel = w[:, srow, :, :]  # [nb, 64 real rows, 128 cols?]
    out = torch.zeros(nb, FRAG_ROWS, nc, FRAG_COLS, dtype=torch.int64)
    for col in range(FRAG_COLS):
        ww = torch.gather(w, 1, srow[:, col].view(1, FRAG_ROWS, 1, 1).expand(nb, FRAG_ROWS, nc, 16))
        ww = ww[..., word[:, col]].diagonal(dim1=1, dim2=3) if False else torch.stack(
            [ww[:, r, :, word[r, col]] for r in range(FRAG_ROWS)], dim=1)
        code = 0
        for i, weight in enumerate((8, 4, 2, 1)):
            code = code + ((ww >> bits[:, col, i].view(1, FRAG_ROWS, 1)) & 1) * weight
        out[:, :, :, col] = code
    del sel
    return out.reshape(nb * FRAG_ROWS, nc * FRAG_COLS)


@pytest.mark.parametrize("N,K", [(64, 256), (40, 208), (130, 400)])
def test_fragment_weight_round_trips_the_codes(N, K):
    from foursight.kernels.fragment_layout import fragment_weight

    g = torch.Generator().manual_seed(N + K)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(1, 0x7F, (N, K // 16), generator=g, dtype=torch.uint8)
    scale[0, 1] = 0  # a zero scale: its block's codes are stored as zeros
    fw = fragment_weight(packed, scale)
    assert fw.words.shape == (-(-N // 64) * 64, -(-K // 256) * 256 // 8)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(N, K).to(torch.int64)
    codes[0, 16:32] = 0
    got = _decode_fragment_words(fw)
    assert torch.equal(got[:N, :K], codes)
    assert not got[N:].any() and not got[:, K:].any()


_FRAG_CONFIGS = [FragmentConfig(16, 64, 128, 1, 1), FragmentConfig(16, 64, 256, 1, 2), FragmentConfig(32, 128, 128, 1, 0),
                 FragmentConfig(16, 64, 128, 1, 3, max_regs=128)]


@pytest.mark.parametrize("scale_bf16", [False, True], ids=["e5m3", "bf16"])
@pytest.mark.parametrize("cfg", _FRAG_CONFIGS, ids=str)
@pytest.mark.parametrize("M,N,K,k", [(1, 40, 208, 16), (3, 64, 256, 0), (17, 130, 400, 128)])
def test_fragment_form(cfg, M, N, K, k, scale_bf16, monkeypatch):
    """The fragment kernel against the reference: W4A4 dynamic and static, W4A16, bias, per-row weight
    scales, padding in N and K, split-K, a non-contiguous bf16 input; both scale encodings."""
    import foursight.kernels.fragment_layout as frag

    monkeypatch.setattr(frag, "SCALES_AS_BF16", scale_bf16)
    g = torch.Generator().manual_seed(M * 7 + N + K + k)
    qw = _layer(N, K, k, g, per_row_gs=True)
    pw = fk.prepare_weight(qw)
    x = _act(M, 2 * K, g)[:, ::2]
    bias = torch.randn(N, generator=g).bfloat16()
    ref = reference_linear(x, qw, bias=bias, out_dtype=torch.float32)
    y = fk.splice_linear(x, pw, bias=bias, config=cfg)
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
    gs = torch.tensor([17.0])
    y = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)
    _check(y, reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32))
    y = fk.splice_linear(x, pw, input_global_scale=gs, config=cfg)
    ref = reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32)
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_fragment_form_refuses_fp16_and_bad_tiles():
    g = torch.Generator().manual_seed(3)
    qw = _layer(64, 128, 16, g)
    pw = fk.prepare_weight(qw)
    with pytest.raises(NVFP4Error, match="bf16"):
        fk.splice_gemm(_act(2, 128, g, torch.float16), pw, None, config=FragmentConfig(16, 64))
    with pytest.raises(ValueError, match="block_n"):
        FragmentConfig(16, 48)


def test_fragment_split_k_reduces_in_one_launch_and_leaves_counters_at_zero():
    """Split-K: the last split of each tile sums the partials (in split order) and resets its
    counter, so repeated calls agree bit for bit and need no memset."""
    from foursight.kernels.split_k import split_counters

    g = torch.Generator().manual_seed(21)
    qw = _layer(128, 512, 16, g)
    pw = fk.prepare_weight(qw)
    x = _act(5, 512, g)
    cfg = FragmentConfig(16, 64, 128, 1, 3)
    y1 = fk.splice_linear(x, pw, config=cfg)
    y2 = fk.splice_linear(x, pw, config=cfg)
    assert torch.equal(y1, y2)
    assert not split_counters(x.device, 1).any()
    ref = reference_linear(x, qw, out_dtype=torch.float32)
    torch.testing.assert_close(y1.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


def test_fragment_split_plan_fills_whole_waves():
    """The automatic split count leaves no partial wave when one exists: 128 tiles on 396 resident
    programs (3 per SM x 132) take 3 splits (384 programs, one wave), not 5 (640: 1.6 waves)."""
    from foursight.kernels.split_k import split_plan, wave_split

    assert wave_split(128, 32, 396) == 3
    assert wave_split(128, 32, 528) == 4
    assert wave_split(64, 56, 396) == 6
    assert wave_split(1000, 32, 396) == 1  # more tiles than resident programs: no split
    assert wave_split(2, 4, 8) == 4  # capped by the K steps
    splits, cps, first = split_plan(16, 8192, 64, 128, 16, 64, 2, 0, 396)
    assert splits == 3 and first == cps and splits * cps >= 64 and (splits - 1) * cps < 64  # equal FP4 shares
    # the BF16 segment spread over the splits in 16-column steps, every column covered once
    from foursight.kernels.split_k import segment_plan

    for kk, sp in ((128, 3), (128, 8), (16, 4), (200, 1), (64, 2)):
        bks, per = segment_plan(kk, sp)
        assert per % bks == 0 and 16 <= bks <= 64 and sp * per >= kk and per - bks < -(-kk // sp)


def test_one_weight_form_resident():
    """A prepared layer keeps only the fragment form of its FP4 part (resident_bytes counts every
    tensor it holds); the default bf16 paths — decode and mid (fragment), prefill (dequant from the
    fragment form) and the autotuner's reference check — leave it so; the packed layout rebuilt from
    the fragment form equals the checkpoint's (S nibbles zeroed), and only an fp16-form call keeps it."""
    from foursight.kernels.fragment_layout import fragment_bytes, unfragment
    from foursight.kernels.prepared import zero_channel_nibbles

    g = torch.Generator().manual_seed(44)
    N, K, k = 130, 400, 16
    qw = _layer(N, K, k, g, per_row_gs=True)
    pw = fk.prepare_weight(qw)
    small = 4 * N + 4 * k + K + 2 * N * k
    assert fk.resident_bytes(pw) == fragment_bytes(pw.fragment) + small
    before = fk.resident_bytes(pw)
    x = _act(3, K, g)
    for m, cfg in ((1, None), (17, None), (40, DequantConfig(64, 128)), (40, FragmentConfig(32, 64, 128, 1, 0))):
        xm = _act(m, K, g)
        fk.splice_linear(xm, pw, config=cfg)
        fk.splice_linear(xm, pw, act_quant=False, config=cfg)
    # only the dequant path's small caches were added (its int64 channel index and the folded scale)
    assert fk.resident_bytes(pw) == before + 8 * k + 4 and "packed" not in pw._cache
    before = fk.resident_bytes(pw)
    packed, scale = unfragment(pw.fragment)
    assert torch.equal(packed, zero_channel_nibbles(qw.weight_packed, pw.bf16_channels))
    assert torch.equal(scale, qw.weight_scale.view(torch.uint8))
    fk.splice_linear(x.half(), pw)  # an fp16 model: the packed forms, which keep the packed layout
    assert fk.resident_bytes(pw) == before + N * K // 2 + N * K // 16


def test_device_v4_dry_run_writes_provenance(tmp_path):
    """benchmarks/kernels/device_v4.sh (the device run of issue 36) on the CPU with DRY_RUN=1: no staging (on the
    device benchmarks/device/stage.sh installs the package from the tree), the interpreter's installed package;
    each benchmark parses its arguments and writes its JSON with the provenance the device results must carry,
    and $OUT holds at most 7 files (the device tool returns 8; one is left for a script appended to the same call)."""
    import json
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    import triton

    from foursight.kernels import configs

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PY": sys.executable, "STEPS": "probe,grid,breakdown,decode",
           "FOURSIGHT_COMMIT": "0123abc"}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(["bash", str(root / "benchmarks/kernels/device_v4.sh")], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 7 and {"v4_summary.md", "probe_v4.json", "splice_gemm.json", "bench_decode.json"} <= set(files), files
    probe = json.loads((out / "probe_v4.json").read_text())
    grid = json.loads((out / "splice_gemm.json").read_text())
    with tarfile.open(out / "v4_rest.tar.gz") as t:
        brk = json.load(t.extractfile("./breakdown.json"))
    for res in (probe, grid, brk):
        p = res["provenance"]
        assert p["commit"] == "0123abc" and len(p["kernels_sha256"]) == 64 and p["triton"] == triton.__version__
        assert p["default_configs"]["DECODE_CONFIGS"] == [str(c) for c in configs.DECODE_CONFIGS]
        assert p["kernels_dir"] == str(Path(configs.__file__).resolve().parent)  # the installed package, as this process's
    assert probe["default_flush"] == "read" and "8192x8192" in probe["args"]["shapes"]
    assert grid["args"]["ks"] == "0,128" and "4096x14336" in grid["args"]["shapes"]
    dec = json.loads((out / "bench_decode.json").read_text())
    assert dec["env"]["git_commit"] == "0123abc" and "foursight-w4a4-k0" in dec["args"]["modes"]
    assert grid["provenance"]["kernels_sha256"][:16] == dec["env"]["kernels_sha256"]
    summary = (out / "v4_summary.md").read_text()
    assert "commit 0123abc" in summary and grid["provenance"]["kernels_sha256"] in summary
