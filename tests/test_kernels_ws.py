"""The warp-specialized Gluon form's plain-Triton twin (``foursight.kernels.experimental.gluon_ws_twin``) under
TRITON_INTERPRET=1 (CPU) against the PyTorch reference (``foursight.layer.reference_linear``).

The twin has the Gluon kernel's tiling (256-column K steps of the fragment form, ``Yᵀ[BN, BM]``
tiles), decode, split plan and epilogue order; Gluon itself cannot run under the interpreter
(``tests/test_kernels_ws_gpu.py`` checks it on the device). Shapes are small: the interpreter is slow.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# The interpreter is chosen at import and the variable stays set for the process: set it only where
# this file was named on the command line (scripts/test.sh's kernels line, or a run of its own), not
# in the main test process, whose engines would inherit it (there the tests skip).
if not torch.cuda.is_available() and any("test_kernels_ws.py" in a for a in sys.argv if not a.startswith("-")):
    os.environ["TRITON_INTERPRET"] = "1"

import foursight.kernels.api as fk  # noqa: E402
from foursight.kernels import api  # noqa: E402
from foursight.kernels.experimental import gluon_stream, gluon_ws  # noqa: E402
from foursight.kernels.configs import StreamConfig, WSConfig, config_from_str  # noqa: E402
from foursight.kernels.runtime import interpreting  # noqa: E402
from foursight.kernels.split_k import split_counters  # noqa: E402
from foursight.layer import QuantizedWeight, quantize_weight, reference_linear
from foursight.nvfp4 import NVFP4Error
from helpers.kernel_switches import kernel_switches

pytestmark = pytest.mark.skipif(
    not interpreting(),
    reason="kernels not built for the Triton interpreter (CUDA machine, or imported earlier); run this file on its own on CPU",
)


def _channels(K: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.sort(torch.randperm(K, generator=g)[:k]).values.to(torch.int32)


def _act(M: int, K: int, g: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(1, K, generator=g))
    x[:, :: max(1, K // 5)] *= 20.0
    return x.to(dtype)


def _layer(N: int, K: int, k: int, g: torch.Generator, per_row_gs: bool = True) -> QuantizedWeight:
    w = torch.randn(N, K, generator=g) * 0.05
    qw = quantize_weight(w, _channels(K, k, g))
    if per_row_gs:
        qw = QuantizedWeight(qw.weight_packed, qw.weight_scale, qw.weight_global_scale.expand(N) * torch.linspace(0.5, 2.0, N),
                             qw.bf16_channels, qw.weight_bf16)
    return qw


def _close(y, ref):
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


# block_m, block_n, stages, warps, split_k: no split, a fixed split, automatic, two stored row blocks
_CONFIGS = [WSConfig(16, 64, 1, 4, 1), WSConfig(16, 64, 2, 4, 3), WSConfig(32, 128, 1, 8, 0), WSConfig(16, 128, 1, 4, 2)]


@pytest.mark.parametrize("cfg", _CONFIGS, ids=str)
@pytest.mark.parametrize("M,N,K,k", [(1, 40, 208, 16), (3, 64, 256, 0), (17, 130, 400, 128), (33, 64, 768, 16)])
def test_ws_twin_matches_the_reference(cfg, M, N, K, k):
    """W4A4 dynamic and static, W4A16 (fp32 out), bias, per-row weight scales, padding in N and K,
    several token tiles, split-K, a non-contiguous bf16 input."""
    g = torch.Generator().manual_seed(M * 7 + N + K + k)
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, 2 * K, g)[:, ::2]
    bias = torch.randn(N, generator=g).bfloat16()
    _close(fk.splice_linear(x, pw, bias=bias, config=cfg), reference_linear(x, qw, bias=bias, out_dtype=torch.float32))
    y = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)
    ref = reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32)
    scale = ref.abs().max().item() + 1e-6
    assert (y - ref).abs().max().item() <= 2e-5 * scale
    gs = torch.tensor([17.0])
    _close(fk.splice_linear(x, pw, input_global_scale=gs, config=cfg),
           reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32))


def test_ws_twin_split_k_is_bit_stable_and_leaves_counters_at_zero():
    """The ordered split-K reduction: repeated calls agree bit for bit and the counters return to 0."""
    g = torch.Generator().manual_seed(21)
    qw = _layer(128, 1024, 16, g)
    pw = fk.prepare_weight(qw)
    x = _act(5, 1024, g)
    cfg = WSConfig(16, 64, 1, 4, 4)
    assert gluon_ws.ws_plan(cfg, 5, pw)["splits"] == 4  # 4 steps of 256 columns, one per split
    y1 = fk.splice_linear(x, pw, config=cfg)
    y2 = fk.splice_linear(x, pw, config=cfg)
    assert torch.equal(y1, y2)
    assert not split_counters(x.device, 1).any()
    _close(y1, reference_linear(x, qw, out_dtype=torch.float32))


def test_ws_plan_steps_are_whole_256_column_steps():
    """Every split but the last gets an even number of 128-column chunks (the kernel's K step is 256)."""
    g = torch.Generator().manual_seed(5)
    pw = fk.prepare_weight(_layer(64, 1280, 0, g, per_row_gs=False))
    for split in (1, 2, 3, 5, 0):
        plan = gluon_ws.ws_plan(WSConfig(16, 64, 2, 4, split), 3, pw)
        assert plan["cps"] % 2 == 0 and plan["splits"] * plan["cps"] >= plan["kcp"] == 10
        assert (plan["splits"] - 1) * plan["cps"] < plan["kcp"]  # no empty split


def test_ws_config_and_dispatch_rules():
    """Bad tiles are refused when built; the Gluon form is no candidate where Gluon cannot run (here:
    the interpreter), and fp16 activations are refused with a clear error."""
    with pytest.raises(ValueError, match="block_n"):
        WSConfig(16, 64, 2, 8)  # two warpgroups need two 64-row blocks
    with pytest.raises(ValueError, match="block_m"):
        WSConfig(24, 64)
    assert not gluon_ws.available()
    for path in ("decode", "mid", "prefill"):
        assert not any(isinstance(c, WSConfig) for c in api.candidates(path, 16, "linear"))
    g = torch.Generator().manual_seed(3)
    pw = fk.prepare_weight(_layer(64, 256, 16, g))
    with pytest.raises(NVFP4Error, match="bf16"):
        fk.splice_gemm(_act(2, 256, g, torch.float16), pw, None, config=WSConfig(16, 64))


# ---------------------------------------------------------------------------------------------
# the register-streaming Gluon form (foursight.kernels.experimental.gluon_stream) through the same twin
# ---------------------------------------------------------------------------------------------

# block_m, depth, split_k: one-row tile without a split, a fixed split, automatic with 16 rows
# two consumer warpgroups (128 rows a program) with one wgmma in flight, and two warpgroups capped at 128 registers
_STREAM = [StreamConfig(8, 2, 1), StreamConfig(8, 1, 3), StreamConfig(16, 2, 0), StreamConfig(8, 2, 2, ring=2),
           StreamConfig(8, 2, 2, block_n=128, num_warps=8, mma_async=True), StreamConfig(16, 1, 0, 128, 128, 8)]


@pytest.mark.parametrize("cfg", _STREAM, ids=str)
@pytest.mark.parametrize("M,N,K,k", [(1, 40, 208, 16), (3, 64, 256, 0), (17, 130, 784, 128)])
def test_stream_twin_matches_the_reference(cfg, M, N, K, k):
    """The register-streaming form's arithmetic (its split plan, its BF16 columns as one MMA after the
    scales): W4A4 dynamic and static, W4A16 (fp32 out), bias, padding in N and K, several token tiles,
    split-K, a non-contiguous bf16 input."""
    g = torch.Generator().manual_seed(M * 5 + N + K + k)
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, 2 * K, g)[:, ::2]
    bias = torch.randn(N, generator=g).bfloat16()
    _close(fk.splice_linear(x, pw, bias=bias, config=cfg), reference_linear(x, qw, bias=bias, out_dtype=torch.float32))
    y = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)
    ref = reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32)
    assert (y - ref).abs().max().item() <= 2e-5 * (ref.abs().max().item() + 1e-6)
    gs = torch.tensor([17.0])
    _close(fk.splice_linear(x, pw, input_global_scale=gs, config=cfg),
           reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32))


def test_stream_plan_fits_the_activation_slice_and_splits_whole_steps():
    """Every split's activation slice fits the shared memory the form gives it, every split but the last
    has an even number of 128-column chunks and none is empty, and the columns' MMA width covers the share."""
    g = torch.Generator().manual_seed(8)
    pw = fk.prepare_weight(_layer(64, 9216, 96, g, per_row_gs=False))  # 36 steps of 256 columns
    for cfg in (StreamConfig(8, 2, 0), StreamConfig(16, 2, 1), StreamConfig(32, 1, 2), StreamConfig(8, 2, 40),
                StreamConfig(16, 2, 0, ring=4)):
        plan = gluon_stream.stream_plan(cfg, 3, pw)
        assert plan["cps"] % 2 == 0 and (cfg.ring or plan["cps"] // 2 <= gluon_stream.max_steps(cfg.block_m)), (cfg, plan)
        assert plan["splits"] * plan["cps"] >= plan["kcp"] == 72 and (plan["splits"] - 1) * plan["cps"] < plan["kcp"]
        assert plan["segp"] >= plan["seg"] and plan["segp"] >= 16 and plan["segp"] & (plan["segp"] - 1) == 0
    assert gluon_stream.stream_plan(StreamConfig(16, 2, 1), 3, pw)["splits"] == 5  # 36 steps, 8 a split at most
    assert gluon_stream.stream_plan(StreamConfig(16, 2, 1, ring=4), 3, pw)["splits"] == 1  # a ring: any share fits


def test_stream_config_and_dispatch_rules():
    """Bad tiles are refused when built, tags round-trip, and the form is no candidate where Gluon
    cannot run (here: the interpreter), even when switched on."""
    for bad in (dict(block_m=12), dict(depth=3), dict(block_n=128), dict(num_warps=8), dict(q_split=3), dict(ring=5),
                dict(num_warps=2, block_n=32), dict(ring=4, mma_async=True)):
        with pytest.raises(ValueError, match="StreamConfig"):
            StreamConfig(**bad)
    cfg = StreamConfig(16, 1, 3, 128)
    assert config_from_str(str(cfg)) == cfg
    for cfg in (StreamConfig(8, 2, block_n=128, num_warps=8, mma_async=True), StreamConfig(8, 2, mma_async=True)):
        assert config_from_str(str(cfg)) == cfg
    # a tag written before mma_async existed still reads back (the field defaults to False)
    assert config_from_str("gluon_stream/16/1/3/128/64/4/8/0") == StreamConfig(16, 1, 3, 128)
    for value in ("1", "only", None):
        with kernel_switches(FOURSIGHT_STREAM=value):
            assert not any(isinstance(c, StreamConfig) for c in api.candidates("decode", 1, "linear"))
    assert {c.block_m for c in api.stream_candidates(1)} == {8} and {c.block_m for c in api.stream_candidates(9)} == {16}
    assert {c.depth for c in api.stream_candidates(16)} == {1, 2}
