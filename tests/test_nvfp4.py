"""NVFP4 format: hand-computed values, edge cases, and bit-exactness with compressed-tensors."""

from __future__ import annotations

import pytest
import torch

from foursight import nvfp4 as n

# value -> code, by the E2M1 definition: sign in bit 3, magnitudes 0,.5,1,1.5,2,3,4,6 = codes 0..7
HAND = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7,
        -0.5: 9, -1.0: 10, -1.5: 11, -2.0: 12, -3.0: 13, -4.0: 14, -6.0: 15}


def test_every_e2m1_code_round_trips():
    vals = torch.tensor(list(HAND))
    codes = n.e2m1_codes(vals)
    assert codes.tolist() == list(HAND.values())
    assert n.e2m1_values(codes).tolist() == list(HAND)
    # all 16 codes decode (code 8 is -0)
    all_codes = torch.arange(16, dtype=torch.uint8)
    dec = n.e2m1_values(all_codes)
    assert torch.equal(n.e2m1_codes(dec)[dec != 0], all_codes[dec != 0])
    assert dec[8].item() == 0.0 and torch.signbit(dec[8])


@pytest.mark.parametrize(
    "x,expected",
    [
        (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (0.74, 0.5), (1.25, 1.0), (1.26, 1.5),
        (1.75, 2.0), (2.5, 2.0), (2.51, 3.0), (3.5, 4.0), (3.49, 3.0), (5.0, 4.0), (5.01, 6.0),
        (7.0, 6.0), (100.0, 6.0), (-2.5, -2.0), (-3.5, -4.0), (-0.25, -0.0),
    ],
)
def test_round_to_nearest_even(x, expected):
    """Ties go to the even mantissa: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4."""
    got = n.round_to_e2m1(torch.tensor([x]))[0].item()
    assert got == expected


def test_pack_layout_even_column_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = n.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(n.unpack_fp4(packed), codes)


def test_global_scale_convention():
    assert n.global_scale_from_amax(torch.tensor(6.0)).item() == pytest.approx(448.0)
    assert n.global_scale_from_amax(torch.tensor(2688.0)).item() == pytest.approx(1.0)
    assert n.global_scale_from_amax(torch.tensor(0.0)).item() == 1.0  # compressed-tensors' fallback


def test_hand_computed_block():
    """One block, amax 6 with gs=1: scale = fp8(1) = 1, codes are the values themselves."""
    x = torch.tensor([[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -6.0, 0.3, -0.7, 2.6, 5.5, -5.5, 0.2, -1.3]])
    packed, scale = n.quantize_nvfp4(x, torch.tensor([1.0]))
    assert scale.float().tolist() == [[1.0]]
    expect = torch.tensor([[6.0, -4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -6.0, 0.5, -0.5, 3.0, 6.0, -6.0, 0.0, -1.5]])
    assert torch.equal(n.dequantize_nvfp4(packed, scale, torch.tensor([1.0])), expect)


def test_max_value_and_scale_saturation():
    # a block whose scale would exceed 448 is clamped to 448 and saturates to ±6*448/gs
    x = torch.full((1, 16), 1000.0)
    packed, scale = n.quantize_nvfp4(x, torch.tensor([448.0 * 6 / 1.0]))  # gs for amax=1
    assert scale.float().max().item() == 448.0
    assert n.dequantize_nvfp4(packed, scale, torch.tensor([2688.0])).max().item() == pytest.approx(1.0)


def test_subnormal_e4m3_scales():
    """Blocks far below the tensor amax get subnormal E4M3 scales (< 2^-6) and still round-trip."""
    gs = torch.tensor([1.0])
    x = torch.zeros(1, 32)
    x[0, :16] = 0.01 * 6  # scale = 0.01 -> subnormal e4m3 (step 2^-9)
    x[0, 16:] = 6.0
    packed, scale = n.quantize_nvfp4(x, gs)
    s0 = scale.float()[0, 0].item()
    assert 0 < s0 < 2**-6
    assert s0 == pytest.approx(0.009765625)  # 5 * 2^-9, the nearest e4m3 subnormal to 0.01
    deq = n.dequantize_nvfp4(packed, scale, gs)
    assert torch.allclose(deq[0, :16], torch.full((16,), 6 * s0))


def test_zero_block_gets_eps_scale_and_zero_codes():
    x = torch.zeros(2, 16)
    packed, scale = n.quantize_nvfp4(x, torch.tensor([1.0]))
    assert scale.float().unique().tolist() == [0.125]
    assert packed.unique().tolist() == [0]


@pytest.mark.parametrize("bad_k", [8, 24, 0])
def test_k_not_multiple_of_16_is_named(bad_k):
    with pytest.raises(n.NVFP4Error, match="my.layer: K=.* multiple of the NVFP4 block size 16"):
        n.quantize_nvfp4(torch.ones(2, bad_k) if bad_k else torch.ones(2, 0), torch.tensor([1.0]), name="my.layer")


def test_non_finite_is_named():
    x = torch.ones(2, 16)
    x[1, 3] = float("nan")
    with pytest.raises(n.NVFP4Error, match="w.q: 1 non-finite"):
        n.quantize_nvfp4(x, torch.tensor([1.0]), name="w.q")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_with_compressed_tensors(dtype, seed):
    """Our codes, packing and scales equal compressed-tensors' quantize + pack_fp4_to_uint8."""
    ct_helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 96)).to(dtype)  # wide dynamic range
    w[0, :16] = 0  # a zero block
    amax = w.float().abs().amax()
    gs_ct = generate_gparam(-amax.reshape(1), amax.reshape(1))
    gs = n.global_scale_from_amax(amax).reshape(1)
    assert torch.equal(gs, gs_ct)
    packed, scale = n.quantize_nvfp4(w, gs)
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    # compressed-tensors' scale computation: gs * amax/6 -> fp8, zeros -> eps
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    blk = w.float().reshape(48, 6, 16)
    args_s = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                              scale_dtype=torch.float8_e4m3fn)
    ct_scale, _ = calculate_qparams(blk.amin(-1), blk.amax(-1), args_s, global_scale=gs_ct)
    assert torch.equal(scale.float(), ct_scale.float())
    q = quantize(x=w, scale=ct_scale.float(), global_scale=gs_ct, zero_point=None, args=args)
    assert torch.equal(packed, ct_helpers.pack_fp4_to_uint8(q))
    # and decoding agrees with theirs
    unpacked = ct_helpers.unpack_fp4_from_uint8(packed, 48, 96, dtype=torch.float32)
    assert torch.equal(unpacked, n.e2m1_values(n.unpack_fp4(packed)))
    ours = n.dequantize_nvfp4(packed, scale, gs, torch.float32)
    theirs = dequantize(x_q=unpacked, scale=scale.float(), global_scale=gs_ct, dtype=torch.float32)
    assert torch.equal(ours, theirs)


def test_per_row_global_scale_is_row_local():
    """Dynamic per-row scales: a row's encoding does not depend on the other rows (batch invariance)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    gs = n.global_scale_from_amax(x.abs().amax(1, keepdim=True))
    p_all, s_all = n.quantize_nvfp4(x, gs)
    p_one, s_one = n.quantize_nvfp4(x[2:3], gs[2:3])
    assert torch.equal(p_all[2:3], p_one) and torch.equal(s_all[2:3].float(), s_one.float())


# ---- the vectorized encoder (issue 37 item 1) against the encoder it replaced ----

_OLD_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
_OLD_TIE_UP = [False, True, False, True, False, True, False]


def _old_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The encoder before issue 37 (float compare-adds, one temporary per boundary), kept as the oracle."""
    xf = x.float()
    mag = xf.abs()
    idx = (mag > _OLD_BOUNDS[0]).to(torch.uint8)
    for b, up in zip(_OLD_BOUNDS[1:], _OLD_TIE_UP[1:]):
        idx += (mag >= b) if up else (mag > b)
    return idx | (torch.signbit(xf).to(torch.uint8) << 3)


def _old_pack(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def _old_scales(amax: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    s = gs.float() * (amax / n.FP4_MAX)
    s = torch.clamp(s, min=-n.FP8_E4M3_MAX, max=n.FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.full_like(s, n.ZERO_SCALE_REPLACEMENT), s)
    return s.to(torch.float8_e4m3fn)


def _old_quantize(x: torch.Tensor, gs: torch.Tensor):
    r, k = x.shape
    amax = x.float().abs().reshape(r, k // 16, 16).amax(-1)
    scale = _old_scales(amax, gs.float())
    eff = (scale.float() / gs.float()).repeat_interleave(16, dim=1)
    return _old_pack(_old_e2m1_codes(torch.clamp(x.float() / eff, -6.0, 6.0))), scale


def _edge_values() -> torch.Tensor:
    """Every boundary and tie, the floats right beside them, the grid points, zeros of both signs,
    float32 subnormals, the saturation edge and beyond, and infinities: both signs."""
    b = torch.tensor(_OLD_BOUNDS + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    up, down = torch.nextafter(b, torch.tensor(100.0)), torch.nextafter(b, torch.tensor(0.0))
    extra = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 1e-30, 6.0001, 7.0, 1e6, 3.4e38, float("inf")])
    v = torch.cat([b, up, down, extra])
    return torch.cat([v, -v])


def test_encoder_and_packer_equal_the_old_ones_on_every_edge_value():
    v = _edge_values()
    assert torch.equal(n.e2m1_codes(v), _old_e2m1_codes(v))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 3
    x.view(-1)[: v.numel()] = v
    codes = n.e2m1_codes(x)
    assert torch.equal(codes, _old_e2m1_codes(x))
    assert torch.equal(n.pack_fp4(codes), _old_pack(codes))
    assert torch.equal(n.pack_fp4(codes[:, 1:-1]), _old_pack(codes[:, 1:-1]))  # a strided view takes the old form
    assert torch.equal(n.e2m1_codes(x.to(torch.bfloat16)), _old_e2m1_codes(x.to(torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantizer_equals_the_old_one_bit_for_bit(dtype):
    """Random weights over 9 decades, blocks of zeros, of -0, of E4M3-subnormal scales, blocks
    whose scale saturates (a global scale too large for them), exact ties after scaling, and
    per-row global scales."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 512, generator=g) * torch.logspace(-6, 3, 512)
    x[0] = 0.0
    x[1] = -0.0
    x[2, :16] = 1e-7  # block scale a subnormal E4M3 value, or zero -> 0.125
    x[3, :64] = torch.tensor(_OLD_BOUNDS * 9 + [6.0])[:64]  # ties under a global scale of 448*6/6
    x = x.to(dtype)
    amax = x.float().abs().amax()
    for gs in (n.global_scale_from_amax(amax).reshape(1), torch.tensor([448.0]), torch.tensor([1e-3]),
               n.global_scale_from_amax(x.float().abs().amax(1, keepdim=True))):
        p, s = n.quantize_nvfp4(x, gs)
        po, so = _old_quantize(x, gs)
        assert torch.equal(p, po) and torch.equal(s.view(torch.uint8), so.view(torch.uint8)), f"gs {gs.flatten()[:2]}"


def test_dequantizer_equals_the_old_one_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (40, 64), generator=g, dtype=torch.uint8)
    scale = (torch.rand(40, 8, generator=g) * 400).to(torch.float8_e4m3fn)
    for gs in (torch.tensor([3.5]), torch.rand(40, generator=g) + 0.1):
        old_eff = (scale.float() / (gs.unsqueeze(1) if gs.dim() == 1 and gs.numel() > 1 else gs)).repeat_interleave(16, dim=1)
        old = n.e2m1_values(n.unpack_fp4(packed)) * old_eff
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(n.dequantize_nvfp4(packed, scale, gs, dtype), old.to(dtype))


# ---- the table encoder of the weight sync (issue 37 item 1, round two) against the plain one ----

def test_code_table_equals_the_plain_encoder_on_every_float32_key():
    """Every 16-bit key (sign, exponent, 7 mantissa bits) with each kind of lower half: zero (exact
    boundaries and ties), the smallest and the largest nonzero one (just above a boundary, just below
    the next key): the table encoder equals the compare encoder after the clamp to ±6, and the
    float-compare oracle of the old quantizer; NaN keys excepted (the quantizer refuses them before)."""
    hi = torch.arange(1 << 16, dtype=torch.int32) << 16
    for lo in (0, 1, 0x8000, 0xFFFF):
        x = (hi | lo).view(torch.float32)
        x = x[~torch.isnan(x)]
        clamped = torch.clamp(x, -6.0, 6.0)
        got = n.e2m1_codes_lut(x.contiguous())
        assert torch.equal(got, n.e2m1_codes_f32(clamped.contiguous())), f"lower half {lo:#x}"
        assert torch.equal(got, _old_e2m1_codes(clamped)), f"lower half {lo:#x}"


def test_block_amax_propagates_non_finite_values():
    x = torch.randn(4, 64)
    x[1, 3], x[2, 40] = float("nan"), float("-inf")
    a = n.block_amax(x.reshape(4, 4, 16))
    assert torch.isnan(a[1, 0]) and a[2, 2] == float("inf")
    ok = torch.isfinite(x).reshape(4, 4, 16).all(-1)
    assert torch.equal(a[ok], x.abs().reshape(4, 4, 16).amax(-1)[ok])


def test_quantizer_equals_the_old_one_on_the_real_models_weights(smollm2_dir):
    """Every linear weight of three of SmolLM2-135M's 30 layers (first, middle, last: 21 BF16 tensors,
    10.6 M values; all 210 take 40 s), with a per-tensor scale and with per-row scales: packed codes
    and E4M3 scales equal the old quantizer's, byte for byte; and the dequantizer equals the old one."""
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.endswith("proj.weight") and k.split(".")[2] in ("0", "15", "29")]
        assert len(names) == 21
        for name in names:
            w = f.get_tensor(name)
            for gs in (n.global_scale_from_amax(w.float().abs().amax()).reshape(1),
                       n.global_scale_from_amax(w.float().abs().amax(1, keepdim=True))):
                p, s = n.quantize_nvfp4(w, gs, name)
                po, so = _old_quantize(w, gs)
                assert torch.equal(p, po) and torch.equal(s.view(torch.uint8), so.view(torch.uint8)), name
            old_eff = (so.float() / gs.reshape(-1, 1)).repeat_interleave(16, dim=1)
            assert torch.equal(n.dequantize_nvfp4(p, s, gs.reshape(-1)), n.e2m1_values(n.unpack_fp4(p)) * old_eff), name
