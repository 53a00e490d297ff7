"""The producers with the activation quantizer fused in (``foursight.kernels.api.rms_norm`` / ``silu_mul``,
:mod:`foursight.kernels.producers`), under the Triton interpreter (CPU).

Against independent references:
- the producer's bf16 row against PyTorch (``F.rms_norm`` after the bf16 residual add; ``F.silu(g) · u``),
  up to bf16 rounding, and the residual sum exactly;
- the quantized operands against :func:`foursight.layer.quantize_activation` (the PyTorch oracle) of the
  kernel's own bf16 row, bit for bit: ``q · s``, the per-row global scale (dynamic and static), ``X[:, S]``;
- the linear on the produced input against the same linear on the row (``splice_linear``), bit for bit, and
  against :func:`foursight.layer.reference_linear`.
Every output starts poisoned (NaN), so an element nobody writes fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import foursight.kernels.api as fk  # noqa: E402
from foursight.layer import quantize_weight, reference_linear  # noqa: E402
from foursight.nvfp4 import NVFP4Error  # noqa: E402
from helpers.producers import assert_quantized_like_oracle  # noqa: E402

pytestmark = interpreted_only

_REAL_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _REAL_EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else 0xAB)


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)


def _layer(n: int, k: int, ks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    ch = torch.sort(torch.randperm(k, generator=g)[:ks]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    return qw, fk.prepare_weight(qw, name="layer")


@pytest.mark.parametrize(("m", "k", "ks", "residual", "static"), [
    (3, 256, 24, True, False),
    (2, 400, 37, False, False),  # K not a power of two, KS not a multiple of 16
    (1, 256, 0, True, False),  # plain NVFP4 (no BF16 channels)
    (2, 256, 300 // 2, True, True),  # static global scale, KS > 128
])
def test_rms_norm_quantized_for_its_consumer(poisoned, m, k, ks, residual, static):
    g = torch.Generator().manual_seed(m * 7 + k + ks)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    r = (torch.randn(m, k, generator=g) * 3).bfloat16() if residual else None
    w = (1 + 0.3 * torch.randn(k, generator=g)).bfloat16()
    _, pw = _layer(32, k, ks, seed=k + ks)
    gs_static = torch.tensor([37.5]) if static else None

    # the row alone (no consumer): the BF16 path, and the row the quantization must equal
    row, s_row = fk.rms_norm(x, w, 1e-5, residual=r)
    assert row.deq is None and row.consumer is None
    s_ref = (x.float() + r.float()).bfloat16() if residual else x
    if residual:
        assert torch.equal(s_row, s_ref)
    else:
        assert s_row is None
    y_ref = F.rms_norm(s_ref.float(), (k,), w.float(), 1e-5)
    assert (row.y.float() - y_ref).abs().max() <= 2 ** -7 * y_ref.abs().max()  # one bf16 ulp of the largest

    p, s = fk.rms_norm(x, w, 1e-5, residual=r, consumer=pw, input_global_scale=gs_static)
    assert p.y is None and p.consumer is pw
    if residual:
        assert torch.equal(s, s_ref)
    assert_quantized_like_oracle(p, row.y, pw.bf16_channels, gs_static)


@pytest.mark.parametrize(("m", "k", "ks"), [(2, 256, 40), (1, 144, 5)])
def test_silu_mul_quantized_for_its_consumer(poisoned, m, k, ks):
    g = torch.Generator().manual_seed(m + k)
    gu = (torch.randn(m, 2 * k, generator=g) * 2).bfloat16()
    _, pw = _layer(16, k, ks, seed=3)
    row = fk.silu_mul(gu)
    gate, up = gu.float().chunk(2, dim=-1)
    y_ref = F.silu(gate) * up
    assert (row.y.float() - y_ref).abs().max() <= 2 ** -7 * y_ref.abs().max()
    p = fk.silu_mul(gu, consumer=pw)
    assert_quantized_like_oracle(p, row.y, pw.bf16_channels)


@pytest.mark.parametrize(("m", "ks"), [(1, 32), (5, 0), (20, 16)])  # decode, decode k = 0, mid
def test_linear_on_the_produced_input(poisoned, m, ks):
    k, n = 256, 64
    g = torch.Generator().manual_seed(m + ks)
    x = torch.randn(m, k, generator=g).bfloat16()
    r = torch.randn(m, k, generator=g).bfloat16()
    w = torch.ones(k).bfloat16()
    qw, pw = _layer(n, k, ks, seed=m)
    row, _ = fk.rms_norm(x, w, residual=r)
    p, _ = fk.rms_norm(x, w, residual=r, consumer=pw)
    got = fk.splice_linear(p, pw)
    want = fk.splice_linear(row.y, pw)
    assert torch.equal(got, want)
    ref = reference_linear(row.y, qw, out_dtype=torch.float32)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 5e-3
    # a ProducedInput without a consumer is its row
    assert torch.equal(fk.splice_linear(row, pw), want)


def test_a_layer_with_the_same_channels_shares_the_produced_input(poisoned):
    k = 256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, k, generator=g).bfloat16()
    qa_w, pa = _layer(32, k, 16, seed=5)
    wb = (torch.randn(48, k, generator=g) * k ** -0.5).bfloat16()
    qb = quantize_weight(wb, qa_w.bf16_channels.clone())  # the same channel set, another tensor
    pb = fk.prepare_weight(qb, name="b")
    row, _ = fk.rms_norm(x, torch.ones(k).bfloat16())
    p, _ = fk.rms_norm(x, torch.ones(k).bfloat16(), consumer=pa)
    assert torch.equal(fk.splice_linear(p, pb), fk.splice_linear(row.y, pb))


def test_bad_input_names_what_is_wrong():
    k = 256
    _, pa = _layer(32, k, 16, seed=1)
    _, pother = _layer(32, k, 16, seed=2)  # another channel set
    x = torch.randn(2, k).bfloat16()
    p, _ = fk.rms_norm(x, torch.ones(k).bfloat16(), consumer=pa)
    with pytest.raises(NVFP4Error, match="another BF16 channel set"):
        fk.splice_linear(p, pother)
    with pytest.raises(NVFP4Error, match="input_global_scale"):
        fk.splice_linear(p, pa, input_global_scale=torch.tensor([2.0]))
    with pytest.raises(NVFP4Error, match="W4A16"):
        fk.splice_linear(p, pa, act_quant=False)
    with pytest.raises(NVFP4Error, match=r"weight: expected \[256\]"):
        fk.rms_norm(x, torch.ones(128).bfloat16())
    with pytest.raises(NVFP4Error, match="residual"):
        fk.rms_norm(x, torch.ones(k).bfloat16(), residual=torch.randn(3, k).bfloat16())
    with pytest.raises(NVFP4Error, match="x: the fused producers take bf16"):
        fk.rms_norm(x.float(), torch.ones(k).bfloat16())
    with pytest.raises(NVFP4Error, match="in_features"):
        fk.silu_mul(torch.randn(2, 2 * 128).bfloat16(), consumer=pa)
    with pytest.raises(NVFP4Error, match="gate_up"):
        fk.silu_mul(torch.randn(2, 255).bfloat16())
