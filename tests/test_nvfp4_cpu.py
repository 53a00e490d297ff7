"""The fused native CPU quantizer of the weight sync (:mod:`foursight.nvfp4_cpu`) against the eager one.

Oracles: :func:`foursight.layer.quantize_weight` (the eager PyTorch quantizer, which the native one must equal
byte for byte: codes, E4M3 block scales, global scale, BF16 columns) and PyTorch's own float -> float8_e4m3fn
cast. Inputs: every 16-bit float key for the E4M3 rounding, hand-made edge values (ties, boundaries beside
them, +-6, zeros of both signs, subnormals, saturating scales), random weights over many decades, and real
SmolLM2-135M weights through both entry points of :mod:`foursight.quant_methods.requantize`."""

from __future__ import annotations

import logging

import pytest
import torch

from foursight import nvfp4 as n
from foursight import nvfp4_cpu
from foursight.layer import QuantizedWeight, quantize_weight
from foursight.nvfp4 import NVFP4Error
from foursight.quant_methods.requantize import quantize_fused, quantize_shard

_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.delenv(nvfp4_cpu.ENV_NATIVE_CPU_QUANT, raising=False)
    assert nvfp4_cpu.native_lib() is not None, "the native quantizer did not build on this machine (a C compiler is needed)"


def _same(a: QuantizedWeight, b: QuantizedWeight, what: str) -> None:
    assert torch.equal(a.weight_packed, b.weight_packed), f"{what}: codes"
    assert torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8)), f"{what}: block scales"
    assert a.weight_global_scale.dtype == b.weight_global_scale.dtype == torch.float32, what
    assert torch.equal(a.weight_global_scale, b.weight_global_scale), f"{what}: global scale"
    assert torch.equal(a.bf16_channels, b.bf16_channels) and a.bf16_channels.dtype == b.bf16_channels.dtype, f"{what}: channels"
    assert torch.equal(a.weight_bf16, b.weight_bf16) and a.weight_bf16.dtype == b.weight_bf16.dtype, f"{what}: BF16 columns"


def _fused_oracle(w: torch.Tensor, ch: torch.Tensor, rows: list[int]) -> QuantizedWeight:
    """quantize_weight of every shard, concatenated (per-row global scales), what quantize_fused promises."""
    parts, off = [], 0
    for r in rows:
        parts.append(quantize_weight(w[off : off + r], ch))
        off += r
    return QuantizedWeight(torch.cat([p.weight_packed for p in parts]), torch.cat([p.weight_scale for p in parts]),
                           torch.cat([p.weight_global_scale.expand(r) for p, r in zip(parts, rows)]), parts[0].bf16_channels,
                           torch.cat([p.weight_bf16 for p in parts]))


def _check(w: torch.Tensor, ch: torch.Tensor, what: str, rows: list[int] | None = None) -> None:
    assert nvfp4_cpu.supports(w), what
    _same(quantize_shard(w, ch, name=what), quantize_weight(w, ch, name=what), what)
    gs = torch.tensor([448.0 * 6 / 0.37])
    _same(quantize_shard(w, ch, global_scale=gs, name=what), quantize_weight(w, ch, global_scale=gs, name=what), f"{what} (given scale)")
    if rows:
        _same(quantize_fused(w, ch, rows, [f"{what}.{i}" for i in range(len(rows))]), _fused_oracle(w, ch, rows), f"{what} (fused)")


def test_e4m3_rounding_equals_pytorchs_cast_on_every_16_bit_key():
    """Every float32 upper half (sign, exponent, 7 mantissa bits) with lower halves 0 (exact E4M3 ties and
    values), 1 (just above), 0x8000 and 0xFFFF (just below the next key), NaN and Inf included."""
    lib = nvfp4_cpu.native_lib()
    hi = torch.arange(1 << 16, dtype=torch.int64).to(torch.int32) << 16
    for lo in (0, 1, 0x8000, 0xFFFF):
        x = (hi | lo).view(torch.float32).contiguous()
        got = torch.empty(x.numel(), dtype=torch.uint8)
        lib.fs_e4m3_bytes(x.data_ptr(), x.numel(), got.data_ptr())
        assert torch.equal(got, x.to(torch.float8_e4m3fn).view(torch.uint8)), f"lower half {lo:#x}"


def _edge_weight() -> torch.Tensor:
    """[64, 256] BF16: ties and the floats beside them at several scales, +-6 and beyond, zeros of both signs,
    BF16 subnormals, blocks whose scale is an E4M3 subnormal or rounds to zero, and a huge value that
    saturates the other blocks' scales."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * 0.02
    b = torch.tensor(_BOUNDS + [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    near = torch.cat([b, torch.nextafter(b, torch.tensor(9.0)), torch.nextafter(b, torch.tensor(0.0)), torch.tensor([6.0, 6.5, 12.0])])
    for r, scale in enumerate((1.0, 0.5, 2.0, 1 / 6, 1e-3, 3.7)):
        w[r, : near.numel()] = near * scale
        w[r + 6, : near.numel()] = -near * scale
    w[12] = 0.0
    w[13] = -0.0
    w[14, :16] = 1e-39  # BF16 subnormals
    w[15, :16] = 1e-7   # a block scale far below the others: E4M3 subnormal or zero -> 0.125
    w[16, 16:32] = -1e-7
    w[17, :] = torch.tensor([0.0, -0.0]).repeat(128)
    w[18, 5] = 3e4      # the tensor's amax: every other block's scale is small
    w[19, :16] = 6.0
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("channels", [[], [0, 5, 17, 255], list(range(0, 256, 9))])
def test_edge_values_equal_the_eager_quantizer(channels):
    """Byte for byte, with the channel columns zeroed (a negative value there must not leave -0), with the
    weight's own global scale and a given one, whole and as three fused shards."""
    w = _edge_weight()
    ch = torch.tensor(channels, dtype=torch.int32)
    _check(w, ch, "edge", rows=[16, 40, 8])
    # a channel column of negative values: the eager quantizer zeroes it to +0 (code 0), not -0 (code 8)
    w2 = w.clone()
    w2[:, 5] = -1.0
    _check(w2, ch, "negative S column", rows=[32, 32])


@pytest.mark.parametrize("seed", [0, 1])
def test_random_weights_equal_the_eager_quantizer(seed):
    """Random weights over 9 decades of column scale, odd shapes (one 16-block, rows that do not split evenly
    over the threads) and a row-strided view (the rows of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    for rows, k in ((1, 16), (3, 48), (200, 64), (517, 320)):
        w = (torch.randn(rows, k, generator=g) * torch.logspace(-6, 3, k)).to(torch.bfloat16)
        ch = torch.randperm(k, generator=g)[: k // 16].to(torch.int32)
        _check(w, ch, f"random {rows}x{k}", rows=[rows // 2, rows - rows // 2] if rows > 1 else None)
    wide = (torch.randn(130, 96, generator=g)).to(torch.bfloat16)
    view = wide[:, :64]
    assert view.stride() == (96, 1)
    _check(view, torch.tensor([3, 40], dtype=torch.int32), "row-strided view", rows=[65, 65])


def test_real_weights_equal_the_eager_quantizer(smollm2_dir):
    """Every linear weight of three of SmolLM2-135M's layers (first, middle, last: 21 tensors), with 32 BF16
    channels; q/k/v and gate/up also fused, as the online sync quantizes them."""
    from safetensors import safe_open

    g = torch.Generator().manual_seed(3)
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.endswith("proj.weight") and k.split(".")[2] in ("0", "15", "29")]
        assert len(names) == 21
        w = {k: f.get_tensor(k) for k in names}
    for name, t in w.items():
        assert t.dtype == torch.bfloat16
        ch = torch.randperm(t.shape[1], generator=g)[:32].to(torch.int32)
        _same(quantize_shard(t, ch, name=name), quantize_weight(t, ch, name=name), name)
    for layer in ("0", "15", "29"):
        p = f"model.layers.{layer}"
        for shards in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]):
            parts = [w[f"{p}.{s}.weight"] for s in shards]
            fused = torch.cat(parts)
            ch = torch.randperm(fused.shape[1], generator=g)[:32].to(torch.int32)
            rows = [t.shape[0] for t in parts]
            _same(quantize_fused(fused, ch, rows, shards), _fused_oracle(fused, ch, rows), f"{p} {shards}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_named_as_by_the_eager_quantizer(bad):
    """Anywhere, channel columns included: the native pass reports it and the eager quantizer names the tensor."""
    for col in (7, 40):  # 40 is a BF16 channel
        w = torch.randn(48, 64).to(torch.bfloat16)
        w[20, col] = bad  # a row of the second shard
        ch = torch.tensor([3, 40], dtype=torch.int32)
        assert nvfp4_cpu.quantize_rows(w, ch) is None
        with pytest.raises(NVFP4Error, match="layers.3.q_proj"):
            quantize_shard(w, ch, name="layers.3.q_proj")
        with pytest.raises(NVFP4Error, match="k_proj"):
            quantize_fused(w, ch, [16, 32], ["q_proj", "k_proj"])


def test_turned_off_or_unbuildable_falls_back_to_the_eager_quantizer(monkeypatch, tmp_path, caplog):
    """``FOURSIGHT_NATIVE_CPU_QUANT=0`` turns it off; a failed build (here: no such compiler) is logged once,
    naming why, and the sync's quantizer still gives the same bytes (the eager path)."""
    w = torch.randn(32, 64).to(torch.bfloat16)
    ch = torch.tensor([1, 2], dtype=torch.int32)
    ref = quantize_weight(w, ch)
    monkeypatch.setenv(nvfp4_cpu.ENV_NATIVE_CPU_QUANT, "0")
    assert not nvfp4_cpu.supports(w)
    _same(quantize_shard(w, ch), ref, "turned off")
    monkeypatch.delenv(nvfp4_cpu.ENV_NATIVE_CPU_QUANT)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FOURSIGHT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nvfp4_cpu, "_lib", None)
    monkeypatch.setattr(nvfp4_cpu, "_lib_error", None)
    with caplog.at_level(logging.WARNING, logger=nvfp4_cpu.__name__):
        assert not nvfp4_cpu.supports(w)
        assert not nvfp4_cpu.supports(w)
    msgs = [r.getMessage() for r in caplog.records if "native CPU NVFP4 quantizer is unavailable" in r.getMessage()]
    assert len(msgs) == 1 and "no-such-cc" in msgs[0], msgs
    _same(quantize_shard(w, ch), ref, "unbuildable")


def test_other_dtypes_and_devices_take_the_eager_path():
    """Only BF16 CPU weights go native (float32 and float16 keep the eager quantizer, which equals itself)."""
    for dtype in (torch.float32, torch.float16):
        w = torch.randn(16, 32).to(dtype)
        assert not nvfp4_cpu.supports(w)
        _same(quantize_shard(w, torch.tensor([4], dtype=torch.int32)), quantize_weight(w, torch.tensor([4], dtype=torch.int32)), str(dtype))


def test_dequantizer_equals_the_eager_one(monkeypatch):
    """nvfp4_cpu.dequantize_nvfp4 on the CPU (the native pass) against foursight.nvfp4's eager one: every byte value,
    scales over E4M3's range (subnormals, zero, 448), a scalar, a [1] and a per-row global scale, each dtype."""
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (67, 128), generator=g, dtype=torch.uint8)
    packed[0, :128] = torch.arange(128, dtype=torch.uint8)
    packed[1, :128] = torch.arange(128, 256, dtype=torch.uint8)
    scale_bytes = torch.randint(0, 0x7F, (67, 16), generator=g, dtype=torch.uint8)  # every finite positive E4M3, 0 included
    scale_bytes[2] = torch.tensor([0, 1, 2, 7, 8, 0x20, 0x7E, 0x7E, 1, 0, 3, 4, 5, 6, 9, 10], dtype=torch.uint8)
    scale = scale_bytes.view(torch.float8_e4m3fn)
    got = {}
    monkeypatch.setenv(nvfp4_cpu.ENV_NATIVE_CPU_QUANT, "1")
    for native, deq in (("1", nvfp4_cpu.dequantize_nvfp4), ("0", n.dequantize_nvfp4)):  # the native pass, the eager one
        got[native] = [deq(packed, scale, gs, dtype)
                       for gs in (torch.tensor(3.5), torch.tensor([1e-3]), torch.rand(67, generator=torch.Generator().manual_seed(5)) * 900 + 0.01)
                       for dtype in (torch.float32, torch.bfloat16, torch.float64)]
    monkeypatch.delenv(nvfp4_cpu.ENV_NATIVE_CPU_QUANT)
    assert nvfp4_cpu.dequantize_rows(packed, scale, torch.tensor([2.0])) is not None  # the native pass did run
    for a, b in zip(got["1"], got["0"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
