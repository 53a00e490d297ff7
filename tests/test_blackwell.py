"""The Blackwell native-FP4 backends, as far as they can be checked without a Blackwell GPU (docs/blackwell.md).

* Layouts, bit-exact against independent re-implementations: the 128x4 swizzled scale layout
  (against the per-byte offset formula FlashInfer documents, and against FlashInfer's own pure-PyTorch
  helpers when ``flashinfer`` imports), the packed codes with S zeroed, the rank padding of the BF16
  term (exact zero columns), per TP rank.
* The FlashInfer operands fed to an emulation of ``mm_nvfp4_svdquant``'s documented contract
  (``out = α·(A·Bᵀ + D·L1ᵀ) + bias``, written here from the docs, with its own unswizzle) reproduce
  ``reference_linear``: this checks what FourSight hands FlashInfer, not FlashInfer.
* The backend choice with the device capability faked, FlashInfer present (a module exposing the
  emulated contract, or the real package where installed) and absent; the refusals and their messages.
* The dot_scaled form compiled offline for sm_100a/sm_120a shows the block-scaled FP4 MMA (one
  configuration; ``benchmarks/kernels/sass_blackwell.py`` checks them all).

The numerics of the dot_scaled kernel under the interpreter are in tests/test_blackwell_kernels.py (its
own process); what needs a GPU is in tests/test_blackwell_gpu.py.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from foursight import dispatch
from foursight.kernels import backends as bw
from foursight.kernels.experimental import flashinfer_gemm as fg
from foursight.kernels.experimental.dot_scaled import prepare_native_weight
from foursight.layer import QuantizedWeight, quantize_weight, reference_linear
from foursight.nvfp4 import NVFP4Error, e2m1_values, pack_fp4, unpack_fp4
from foursight.quant_methods.sharding import concat_shards, shard_quantized_weight

# --------------------------------------------------------------------------------------------
# independent re-implementations
# --------------------------------------------------------------------------------------------


def offsets_128x4(rows: int, cols: int) -> torch.Tensor:
    """Byte offset of every (row, col) in the 128x4 layout, from the formula FlashInfer documents
    (``gemm_bf16_fp4._unswizzle_sf_128x4``): ((r//128)·⌈C/4⌉ + c//4)·512 + (r%32)·16 + (r%128//32)·4 + c%4."""
    r = torch.arange(rows).reshape(-1, 1)
    c = torch.arange(cols).reshape(1, -1)
    kb = -(-cols // 4)
    return ((r // 128) * kb + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_by_formula(sf: torch.Tensor) -> torch.Tensor:
    rows, cols = sf.shape
    out = torch.zeros(-(-rows // 128) * 128 * -(-cols // 4) * 4, dtype=torch.uint8)
    out[offsets_128x4(rows, cols).reshape(-1)] = sf.reshape(-1)
    return out


def unswizzle_by_formula(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return flat.reshape(-1)[offsets_128x4(rows, cols)]


def emulate_svdquant(a, b, a_sf, b_sf, alpha, d, l1, bias=None):
    """``mm_nvfp4_svdquant``'s documented contract in fp32: ``α·(A·Bᵀ + D·L1ᵀ) (+ bias)`` with A, B packed
    e2m1 (low nibble first) and their UE4M3 block-16 scales in the 128x4 layout; argument checks as documented."""
    m, kh = a.shape
    n = b.shape[0]
    k = kh * 2
    assert a.dtype == b.dtype == torch.uint8 and b.shape[1] == kh and n % 32 == 0 and k % 32 == 0
    assert d.dtype == l1.dtype == torch.bfloat16 and d.shape[1] % 32 == 0 and d.shape[1] >= 32 and l1.shape == (n, d.shape[1])
    assert a_sf.dtype == b_sf.dtype == torch.uint8 and alpha.dtype == torch.float32
    sa = unswizzle_by_formula(a_sf, m, k // 16).view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    sb = unswizzle_by_formula(b_sf, n, k // 16).view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    av = e2m1_values(unpack_fp4(a)) * sa
    bv = e2m1_values(unpack_fp4(b)) * sb
    y = alpha.reshape(-1)[0] * (av.double() @ bv.double().t() + d.double() @ l1.double().t())
    if bias is not None:
        y = y + bias.double()
    return y.float()


def fake_flashinfer(monkeypatch):
    """A ``flashinfer`` package whose ``gemm.mm_nvfp4_svdquant`` is the emulated contract."""
    pkg = types.ModuleType("flashinfer")
    gemm = types.ModuleType("flashinfer.gemm")
    gemm.mm_nvfp4_svdquant = emulate_svdquant
    pkg.gemm = gemm
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gemm", gemm)


def layer(n=96, k_dim=128, channels=(3, 17, 40, 101), seed=0, shards=None) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if shards:  # fused q/k/v-style layer: each shard keeps its own weight global scale
        parts = [quantize_weight(torch.randn(r, k_dim, generator=g) * (i + 1), torch.tensor(channels, dtype=torch.int64))
                 for i, r in enumerate(shards)]
        return concat_shards(parts)
    return quantize_weight(torch.randn(n, k_dim, generator=g), torch.tensor(channels, dtype=torch.int64))


def activations(m, k_dim, channels, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_dim, generator=g)
    if len(channels):
        x[:, list(channels)] *= 25  # the outliers the BF16 channels are for
    return x.to(torch.bfloat16)


def bf16_term_bound(x, qw):
    """What one bf16 rounding of ``W[:, S]·gs_a·gs_w`` (L1) may cost: 2^-8·Σ|x_s||w_s| per output."""
    ch = qw.bf16_channels.long()
    if not ch.numel():
        return torch.zeros(x.shape[0], qw.out_features)
    return 2.0**-8 * (x[:, ch].float().abs() @ qw.weight_bf16.float().abs().t())


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,cols", [(1, 1), (128, 4), (200, 12), (257, 9), (300, 70)])
def test_swizzle_128x4_is_the_documented_layout(rows, cols):
    sf = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    flat = fg.swizzle_sf_128x4(sf)
    expect = swizzle_by_formula(sf)
    assert flat.dtype == torch.uint8 and flat.shape == expect.shape
    assert torch.equal(flat, expect)  # every byte, the zero padding included
    assert torch.equal(fg.unswizzle_sf_128x4(flat, rows, cols), sf)
    assert torch.equal(fg.swizzle_sf_128x4(sf.view(torch.float8_e4m3fn)), expect)  # E4M3 scale tensors as they are stored


def test_swizzle_128x4_matches_flashinfers_own_reference():
    """FlashInfer's pure-PyTorch layout helpers (they run on the CPU); skipped where flashinfer is not installed."""
    pytest.importorskip("flashinfer")
    from flashinfer.diffusion_ops.minimax_h3_fc1_swiglu import _swizzle_sf_128x4
    from flashinfer.gemm.gemm_bf16_fp4 import _unswizzle_sf_128x4

    for rows, cols in [(1, 1), (200, 12), (257, 9)]:
        sf = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
        flat = fg.swizzle_sf_128x4(sf)
        assert torch.equal(flat, _swizzle_sf_128x4(sf))
        assert torch.equal(_unswizzle_sf_128x4(flat, rows, cols).reshape(rows, cols), sf)


def test_packed_codes_and_scales_match_flashinfers_own_dequantizer():
    """FlashInfer's pure-PyTorch NVFP4 dequantizer (its CPU fallback, linear scale layout) reads the operands we
    hand it (codes low nibble first, E4M3 scale bytes) as the values the reference dequantizes; skipped without flashinfer."""
    pytest.importorskip("flashinfer")
    from flashinfer.quantization.fp4_quantization import _e2m1_and_ufp8sf_scale_to_float_cpu

    from foursight.nvfp4 import dequantize_nvfp4

    qw = layer(n=64, k_dim=128)
    nw = prepare_native_weight(qw)
    gs = qw.weight_global_scale
    theirs = _e2m1_and_ufp8sf_scale_to_float_cpu(nw.weight_packed, nw.weight_scale, 1.0 / gs, 16, 1, False)
    ours = dequantize_nvfp4(nw.weight_packed, nw.weight_scale.view(torch.float8_e4m3fn), gs, torch.float32)
    assert torch.allclose(theirs, ours, rtol=2**-22, atol=0)


def test_native_weight_is_the_checkpoint_layout_with_s_codes_zeroed():
    qw = layer()
    ch = qw.bf16_channels.long()
    # plant non-zero codes in the S columns (an imported checkpoint need not have zeros there)
    codes = unpack_fp4(qw.weight_packed)
    codes[:, ch] = 7
    planted = QuantizedWeight(pack_fp4(codes), qw.weight_scale, qw.weight_global_scale, qw.bf16_channels, qw.weight_bf16)
    before = planted.weight_packed.clone()
    nw = prepare_native_weight(planted)
    expect = codes.clone()
    expect[:, ch] = 0
    assert torch.equal(nw.weight_packed, pack_fp4(expect))
    assert torch.equal(planted.weight_packed, before)  # the checkpoint tensor is not modified
    assert torch.equal(nw.weight_scale, qw.weight_scale.view(torch.uint8))
    assert torch.equal(nw.weight_global_scale, qw.weight_global_scale.expand(qw.out_features))
    with pytest.raises(NVFP4Error, match="L7.weight_scale"):
        prepare_native_weight(QuantizedWeight(qw.weight_packed, qw.weight_scale[:, :-1], qw.weight_global_scale,
                                              qw.bf16_channels, qw.weight_bf16), "L7")


@pytest.mark.parametrize("k,r", [(0, 32), (1, 32), (31, 32), (32, 32), (33, 64), (100, 128)])
def test_rank_padding_is_a_multiple_of_32_with_exact_zero_columns(k, r):
    assert fg.padded_rank(k) == r
    chans = tuple(range(5, 5 + 2 * k, 2))
    qw = layer(n=64, k_dim=256, channels=chans)
    fw = fg.prepare_flashinfer_weight(qw)
    assert fw.rank == r
    w_s = fw.segments[0].w_s
    assert w_s.shape == (64, r) and w_s.dtype == torch.bfloat16
    assert torch.equal(w_s[:, :k], qw.weight_bf16)
    assert (w_s[:, k:].view(torch.int16) == 0).all()  # +0.0 bits, not -0.0
    x = activations(3, 256, chans)
    ops = fg.flashinfer_operands(fw, x, torch.tensor([40.0]))
    assert ops.d.shape == (3, r) and (ops.d[:, k:].view(torch.int16) == 0).all()
    assert torch.equal(ops.d[:, :k], x[:, list(chans)])
    assert (ops.scaled[0][1][:, k:].view(torch.int16) == 0).all()  # L1's padding stays exact zeros after the α fold


def test_tensor_parallel_ranks_pad_their_own_channels():
    """Row-parallel K split over 2 ranks (the engines' slicing): each rank pads its local k to 32·j with
    exact zeros (one rank has none of the channels), and the ranks' emulated outputs sum to the layer."""
    chans = (3, 17, 40, 101)  # all in the first half of K = 256
    qw = layer(n=64, k_dim=256, channels=chans)
    x = activations(5, 256, chans)
    igs = torch.tensor([30.0])
    total = torch.zeros(5, 64)
    for rank in range(2):
        part = shard_quantized_weight(qw, rank, 2, "K")
        fw = fg.prepare_flashinfer_weight(part, f"down_proj.tp{rank}")
        k_local = part.num_channels
        assert fw.rank == fg.padded_rank(k_local) and fw.rank % 32 == 0
        assert (fw.segments[0].w_s[:, k_local:].view(torch.int16) == 0).all()
        xs = x[:, rank * 128:(rank + 1) * 128]
        total += fg.flashinfer_linear(fw, xs, None, igs, mm=emulate_svdquant)
    assert [shard_quantized_weight(qw, r, 2, "K").num_channels for r in range(2)] == [4, 0]
    ref = reference_linear(x, qw, None, igs, out_dtype=torch.float32)
    tol = bf16_term_bound(x, qw) + 1e-4 * ref.abs().max()
    assert ((total - ref).abs() <= tol).all()


# --------------------------------------------------------------------------------------------
# the FlashInfer operands against the reference (through the emulated contract)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [(), (5,), (3, 17, 40, 101, 102, 127)])
@pytest.mark.parametrize("shards", [None, (64, 32, 32)])
def test_flashinfer_operands_reproduce_the_reference(channels, shards):
    qw = layer(n=128, k_dim=128, channels=channels, shards=shards)
    fw = fg.prepare_flashinfer_weight(qw, "L0.qkv_proj")
    assert len(fw.segments) == (3 if shards else 1)  # one call per run of equal weight scales
    x = activations(7, 128, channels)
    bias = torch.randn(128).to(torch.bfloat16)
    igs = torch.tensor([2688.0 / 30])
    y = fg.flashinfer_linear(fw, x, bias, igs, mm=emulate_svdquant)
    ref = reference_linear(x, qw, bias, igs, out_dtype=torch.float32)
    err = (y - ref).abs()
    assert (err <= bf16_term_bound(x, qw) + 1e-5 * ref.abs().max()).all(), err.max()
    if channels:  # the α fold matters: without it the BF16 term is off by gs_a·gs_w
        ops = fg.flashinfer_operands(fw, x, igs)
        seg = fw.segments[0]
        wrong = emulate_svdquant(ops.a, seg.b, ops.a_sf, seg.b_sf, ops.scaled[0][0], ops.d, seg.w_s)
        assert (wrong - ref[:, :seg.stop]).abs().max() > 100 * err.max()


def test_flashinfer_refusals_name_the_layer_and_the_fix():
    qw = layer()
    fw = fg.prepare_flashinfer_weight(qw, "L3.mlp.down_proj")
    x = activations(2, 128, (3,))
    with pytest.raises(NVFP4Error, match=r"L3.mlp.down_proj.*--activation-scale static"):
        fg.flashinfer_linear(fw, x, None, None, mm=emulate_svdquant)
    with pytest.raises(NVFP4Error, match="W4A4 only"):
        fg.flashinfer_linear(fw, x, None, torch.tensor([1.0]), act_quant=False, mm=emulate_svdquant)
    with pytest.raises(NVFP4Error, match="bf16 activations"):
        fg.flashinfer_linear(fw, x.half(), None, torch.tensor([1.0]), mm=emulate_svdquant)
    with pytest.raises(NVFP4Error, match=r"L1.o_proj: in_features 48 is not a multiple of 32"):
        fg.prepare_flashinfer_weight(layer(n=64, k_dim=48, channels=(1,)), "L1.o_proj")
    with pytest.raises(NVFP4Error, match=r"rows \[0, 48\)"):
        fg.prepare_flashinfer_weight(layer(k_dim=128, shards=(48, 48)), "L2.gate_up_proj")


# --------------------------------------------------------------------------------------------
# the backend choice
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap,req,fi,expect", [
    (None, "flashinfer", False, "reference"),
    ((9, 0), "auto", True, "triton"),
    ((10, 0), "auto", True, "triton"),  # native backends are opt-in until a Blackwell run verified them
    ((12, 0), "auto", True, "triton"),
    ((10, 0), "flashinfer", True, "flashinfer"),
    ((12, 0), "flashinfer", True, "flashinfer"),
    ((10, 3), "dot_scaled", False, "dot_scaled"),
    ((12, 0), "dot_scaled", False, "dot_scaled"),
    ((9, 0), "triton", False, "triton"),
    ((10, 0), "reference", False, "reference"),
])
def test_choice_by_capability(cap, req, fi, expect):
    name, reason = bw.choose_backend(cap, req, flashinfer_ok=fi)
    assert name == expect
    if cap is not None and cap[0] in (10, 12) and req == "auto":
        assert "FOURSIGHT_KERNEL_BACKEND=flashinfer or dot_scaled" in reason and "have not run on Blackwell" in reason


@pytest.mark.parametrize("cap,req,fi,match", [
    ((9, 0), "flashinfer", True, "needs a Blackwell GPU.*sm_90"),
    ((8, 9), "dot_scaled", False, "needs a Blackwell GPU.*sm_89"),
    ((10, 0), "flashinfer", False, "pip install flashinfer-python"),
])
def test_a_backend_that_cannot_run_is_a_clear_error(cap, req, fi, match):
    with pytest.raises(bw.BackendUnavailable, match=match):
        bw.choose_backend(cap, req, flashinfer_ok=fi)


def test_env_value_is_checked():
    assert bw.requested_backend({}) == "auto"
    assert bw.requested_backend({bw.BACKEND_ENV: " FlashInfer "}) == "flashinfer"
    with pytest.raises(bw.BackendUnavailable, match="auto, triton, reference, dot_scaled, flashinfer"):
        bw.requested_backend({bw.BACKEND_ENV: "cutlass"})


@pytest.fixture
def blackwell(monkeypatch):
    """Weights on a faked sm_100 device (the tensors stay on the CPU)."""
    monkeypatch.setattr(dispatch, "_capability", lambda qw: (10, 0))
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    return monkeypatch


def test_dispatch_default_on_blackwell_stays_triton_and_says_so(blackwell, caplog):
    blackwell.delenv(bw.BACKEND_ENV, raising=False)
    blackwell.setattr(dispatch.TritonBackend, "supports", lambda self, qw: True)
    with caplog.at_level(logging.INFO, logger="foursight.dispatch"):
        b = dispatch.select_backend(layer())
    assert b.name == "triton"
    assert "FourSight linear backend: triton (sm_100: the native FP4 backends" in caplog.text
    assert "FOURSIGHT_KERNEL_BACKEND=flashinfer or dot_scaled" in caplog.text


def test_dispatch_flashinfer_present_runs_the_layer_through_its_contract(blackwell, caplog):
    fake_flashinfer(blackwell)
    blackwell.setenv(bw.BACKEND_ENV, "flashinfer")
    qw = layer(channels=(3, 17))
    with caplog.at_level(logging.INFO, logger="foursight.dispatch"):
        p = dispatch.prepare_linear(qw, "L0.q_proj")
    assert p.backend.name == "flashinfer" and "flashinfer (opt-in" in caplog.text
    x = activations(4, 128, (3, 17))
    igs = torch.tensor([50.0])
    y = p(x, None, igs)
    ref = reference_linear(x, qw, None, igs, out_dtype=torch.float32)
    assert ((y - ref).abs() <= bf16_term_bound(x, qw) + 1e-5 * ref.abs().max()).all()
    with pytest.raises(NVFP4Error, match="--activation-scale static"):
        p(x, None, None)  # a dynamic-scale checkpoint on this backend


def test_dispatch_flashinfer_absent_is_a_clear_error(blackwell):
    for mod in ("flashinfer", "flashinfer.gemm"):  # import -> ImportError, also after a real flashinfer was imported
        blackwell.setitem(sys.modules, mod, None)
    blackwell.setenv(bw.BACKEND_ENV, "flashinfer")
    assert not bw.flashinfer_svdquant_available()
    with pytest.raises(bw.BackendUnavailable, match="mm_nvfp4_svdquant cannot be imported"):
        dispatch.prepare_linear(layer())


def test_dispatch_dot_scaled_and_the_hopper_refusal(blackwell):
    blackwell.setenv(bw.BACKEND_ENV, "dot_scaled")
    assert dispatch.select_backend(layer()).name == "dot_scaled"
    blackwell.setattr(dispatch, "_capability", lambda qw: (9, 0))
    with pytest.raises(bw.BackendUnavailable, match="sm_90"):
        dispatch.select_backend(layer())


def test_cpu_weights_run_the_reference_whatever_is_asked(monkeypatch):
    monkeypatch.setenv(bw.BACKEND_ENV, "flashinfer")
    assert dispatch.select_backend(layer()).name == "reference"
    assert bw.blackwell_fp4_available() is False


def test_real_flashinfer_is_found_where_installed(blackwell):
    pytest.importorskip("flashinfer")
    assert bw.flashinfer_svdquant_available()
    blackwell.setenv(bw.BACKEND_ENV, "flashinfer")
    assert dispatch.select_backend(layer()).name == "flashinfer"


def test_serve_kernel_backend_option_sets_the_env(tmp_path):
    from typer.testing import CliRunner

    from foursight.cli import app

    (tmp_path / "config.json").write_text("{}")  # a model folder as far as `serve` looks
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--kernel-backend", "dot_scaled", "--dry-run"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "FOURSIGHT_KERNEL_BACKEND=dot_scaled" in r.output and "--quantization foursight" in r.output
    r = CliRunner().invoke(app, ["serve", str(tmp_path), "--kernel-backend", "cutlass", "--dry-run"], env={"COLUMNS": "200"})
    assert r.exit_code != 0 and "choose one of" in r.output


# --------------------------------------------------------------------------------------------
# offline compilation (one configuration; benchmarks/kernels/sass_blackwell.py does all)
# --------------------------------------------------------------------------------------------


def test_dot_scaled_compiles_to_block_scaled_fp4_mma_for_sm100a_and_sm120a():
    from helpers.scripts import load_benchmark

    sb = load_benchmark("sass_blackwell")
    from foursight.kernels.experimental.dot_scaled import CONFIGS, DotScaledConfig

    for cap in (100, 120):
        res = sb.check(cap, sb.compile_for(cap, CONFIGS["decode16"], True), True)
        assert res["ok"], res
        assert res["fp4_mma_sass"] > 0 and res["fp4_loops_with_bf16"] == 0
    # the check can fail: an unswapped 16-row tile is emulated in BF16 on sm_100a
    bad = object.__new__(DotScaledConfig)
    for k, v in dict(swap=False, block_m=16, block_n=128, block_k=256, block_ks=64, group_m=8, num_warps=4, num_stages=3).items():
        object.__setattr__(bad, k, v)
    res = sb.check(100, sb.compile_for(100, bad, False), False)
    assert not res["ok"] and res["fp4_mma_sass"] == 0 and res["bf16_mma_sass"] > 0
