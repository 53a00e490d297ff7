"""The compensated layer's PyTorch reference against an independent float64 computation."""

from __future__ import annotations

import pytest
import torch

from foursight import layer as L
from foursight import nvfp4 as n


def _fp64_decode(packed, scale, gs_rows):
    """Independent decode: nibble by nibble with Python's E2M1 table, float64 math."""
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    r, half = packed.shape
    out = torch.zeros(r, half * 2, dtype=torch.float64)
    for i in range(r):
        for j in range(half):
            b = int(packed[i, j])
            for h, c in ((0, b & 0xF), (1, b >> 4)):
                v = table[c & 7] * (-1.0 if c & 8 else 1.0)
                col = 2 * j + h
                out[i, col] = v * float(scale[i, col // 16].float()) / float(gs_rows[i])
    return out


@pytest.mark.parametrize("k", [0, 16, 40])
def test_reference_matches_fp64(k):
    g = torch.Generator().manual_seed(k)
    N, K, M = 24, 64, 5
    w = (torch.randn(N, K, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    x[:, 7] *= 30  # an outlier channel
    ch = torch.randperm(K, generator=g)[:k].sort().values
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    qw = L.quantize_weight(w, ch)
    y = L.reference_linear(x, qw, bias=bias, out_dtype=torch.float32)

    qa = L.quantize_activation(x, qw.bf16_channels)
    xd = _fp64_decode(qa.packed, qa.scale, qa.global_scale)
    wd = _fp64_decode(qw.weight_packed, qw.weight_scale, qw.weight_global_scale.expand(N))
    ref = xd @ wd.T + x[:, ch].double() @ w[:, ch].double().T + bias.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    # the S columns really are zero in the FP4 parts
    if k:
        assert torch.all(xd[:, ch] == 0) and torch.all(wd[:, ch] == 0)


def test_compensation_reduces_error_with_outliers():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 128, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(32, 128, generator=g)
    x[:, [3, 50, 77, 90]] *= 50
    x = x.to(torch.bfloat16)
    exact = x.float() @ w.float().T
    var = x.float().var(0)
    ch = torch.topk(var, 16).indices.sort().values
    e0 = (L.reference_linear(x, L.quantize_weight(w, ch[:0]), out_dtype=torch.float32) - exact).norm() / exact.norm()
    e1 = (L.reference_linear(x, L.quantize_weight(w, ch), out_dtype=torch.float32) - exact).norm() / exact.norm()
    assert e1 < 0.5 * e0


def test_w4a16_mode_keeps_activations():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    qw = L.quantize_weight(w, torch.tensor([4]))
    y = L.reference_linear(x, qw, act_quant=False, out_dtype=torch.float32)
    wd = L.dequantize_weight(qw, torch.float64)
    assert torch.allclose(y.double(), x.double() @ wd.T, rtol=1e-5, atol=1e-5)


def test_static_input_scale_and_batch_invariance():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    qw = L.quantize_weight(w, torch.tensor([1, 2]))
    # dynamic per-row: one row alone gives the same output as inside the batch
    assert torch.equal(L.reference_linear(x, qw)[3], L.reference_linear(x[3:4], qw)[0])
    # a static scale gives a different (but close) answer and is used for all rows
    gs = n.global_scale_from_amax(x.float().abs().amax()).reshape(1)
    y_static = L.reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32)
    qa = L.quantize_activation(x, qw.bf16_channels, gs)
    assert torch.all(qa.global_scale == gs)
    y_dyn = L.reference_linear(x, qw, out_dtype=torch.float32)
    assert not torch.equal(y_static, y_dyn)
    exact = x.float() @ w.float().T
    for y in (y_static, y_dyn):
        assert (y - exact).norm() / exact.norm() < 0.25


def test_reference_linear_is_batch_invariant():
    """issue 53 item 7: a row's output does not depend on how many rows the call has, to the last
    bit of float32, through the reference and the CPU backend that engines run (before: float32
    ``mm`` took another kernel for a few rows, so M = 1-3, 5-7, 9-11 differed in the last bit from
    the same rows inside a long call; an engine that prefills only the tokens its prefix cache
    lacks then gave other logprobs for the same request cold and cached). SmolLM2's shapes, with
    BF16 channels and a bias."""
    from foursight.dispatch import prepare_linear

    g = torch.Generator().manual_seed(3)
    for n_out, k in ((1536, 576), (576, 1536)):
        w = (torch.randn(n_out, k, generator=g) * 0.05).to(torch.bfloat16)
        x = torch.randn(64, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n_out, generator=g).to(torch.bfloat16)
        qw = L.quantize_weight(w, torch.randperm(k, generator=g)[:32].sort().values)
        prepared = prepare_linear(qw)
        full = L.reference_linear(x, qw, bias=bias, out_dtype=torch.float32)
        assert torch.equal(prepared(x, bias), L.reference_linear(x, qw, bias=bias))
        for m in (1, 2, 3, 5, 7, 9, 11, 13, 33):
            assert torch.equal(L.reference_linear(x[-m:], qw, bias=bias, out_dtype=torch.float32), full[-m:]), (n_out, k, m)
            assert torch.equal(prepared(x[-m:], bias), prepared(x, bias)[-m:]), (n_out, k, m)


def test_prepared_reference_is_identical_and_idempotent():
    from foursight.dispatch import ReferenceBackend, prepare_linear

    w = torch.randn(8, 32).to(torch.bfloat16)
    qw = L.quantize_weight(w, torch.tensor([0, 31]))
    x = torch.randn(4, 32).to(torch.bfloat16)
    p1, p2 = prepare_linear(qw), prepare_linear(qw)
    assert isinstance(p1.backend, ReferenceBackend)  # CPU tensors: the reference, chosen once
    assert torch.equal(p1.state[1], p2.state[1])
    assert torch.equal(p1(x), L.reference_linear(x, qw))


@pytest.mark.parametrize(
    "channels,msg",
    [([40], "out of range"), ([1, 1], "repeated"), (list(range(32)), "k must be < K")],
)
def test_bad_channels_are_named(channels, msg):
    with pytest.raises(n.NVFP4Error, match=f"layers.0.q_proj.*{msg}"):
        L.quantize_weight(torch.ones(4, 32), torch.tensor(channels), name="layers.0.q_proj")


def test_shape_errors():
    with pytest.raises(n.NVFP4Error, match="in_features"):
        L.reference_linear(torch.ones(2, 48), L.quantize_weight(torch.ones(4, 32), torch.tensor([], dtype=torch.long)))
    with pytest.raises(n.NVFP4Error, match="lin: expected a 2-D weight"):
        L.quantize_weight(torch.ones(4, 4, 16), torch.tensor([0]), name="lin")
