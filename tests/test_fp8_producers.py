"""The FP8 baseline's fused producers (:mod:`foursight.kernels.fp8_producers`) under the Triton interpreter (CPU).

Against independent references:
- the E4M3 rounding (the kernel's integer arithmetic) against ``torch.Tensor.to(torch.float8_e4m3fn)`` on every
  E4M3 value, every midpoint between two neighbours (ties to even), values just off the midpoints, subnormals,
  ±0 and tiny values that round to ±0;
- the producer's bf16 row against PyTorch (``F.rms_norm`` after the bf16 residual add; ``F.silu(g) · u``), up to
  bf16 rounding, and the residual sum exactly;
- the codes and scales of ``exact=True`` against :func:`foursight.fp8.quantize_activation_fp8` (the package's FP8
  quantizer, what the eager baseline runs) of the kernel's own bf16 row, bit for bit, and those of the default
  (the engines' ``y · (1/scale)``) against :func:`~foursight.kernels.fp8_producers.engine_quantize_fp8`;
- the FP8 GEMM on the fused producer's output against the eager road (producer, then the quantizer, then the GEMM).
Every output starts poisoned (NaN), so an element nobody writes fails. The interpreter's own float8 conversion is
not used (it neither rounds to nearest nor saturates): the hardware conversion the GPU uses instead is checked by
``tests/test_fp8_producers_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import foursight.kernels.fp8_producers as fp  # noqa: E402
from foursight.fp8 import FP8Error, dequantize_rowwise, quantize_activation_fp8  # noqa: E402

pytestmark = interpreted_only

_REAL_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _REAL_EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else 0xAB)


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_e4m3_rounding_matches_torch_on_every_value_tie_and_subnormal():
    """The ``plain`` kind on a row whose amax is 448 (scale exactly 1, so the codes are ``e4m3(y)`` itself): every
    E4M3 value, every midpoint between two neighbours (exact ties: 4 significant bits, which bf16 holds), the bf16
    neighbours of each midpoint, values at and below half the smallest subnormal, ±0, both signs."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0 .. 448 (0x7E), 0x7F is NaN
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    # bf16 holds 8 significant bits: E4M3 values (4 bits) and their midpoints (5 bits) are exact in bf16
    assert torch.equal(mids.bfloat16().float(), mids)
    up = torch.nextafter(mids.bfloat16(), torch.tensor(1e9, dtype=torch.bfloat16))
    down = torch.nextafter(mids.bfloat16(), torch.tensor(-1e9, dtype=torch.bfloat16))
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 0.0])  # below / at half of the smallest subnormal 2^-9
    row = torch.cat([vals, mids, up.float(), down.float(), tiny, torch.tensor([448.0])])
    row = torch.cat([row, -row])
    x = row.bfloat16()[None, :]
    got, _ = fp.fp8_producer("plain", x, exact=True)
    assert got.scale.item() == 1.0
    want = x.float().to(torch.float8_e4m3fn)
    assert torch.equal(_bits(got.q), _bits(want)), (
        f"codes differ at {(_bits(got.q) != _bits(want)).nonzero()[:8].tolist()}")
    # the sign of zero and of values that round to zero
    neg0 = (x[0] < 0) | ((x[0] == 0) & (torch.signbit(x[0].float())))
    assert bool(((_bits(got.q)[0] & 0x80) != 0)[neg0].all())


def _quantized_like(out, exact: bool):
    """The kernel's codes and scales against the reference quantization of its own bf16 row, bit for bit."""
    q, scale = quantize_activation_fp8(out.y) if exact else fp.engine_quantize_fp8(out.y)
    assert torch.equal(_bits(out.q), _bits(q))
    assert torch.equal(out.scale, scale)


def test_engine_rounding_differs_from_exact_division_somewhere_and_the_kernel_follows_each():
    """``y · (1/scale)`` and ``y / scale`` give different E4M3 codes for some rows (so the two references are
    distinct and each mode is checked against its own), and the kernel reproduces each bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=g) * 7).bfloat16()
    qe, _ = quantize_activation_fp8(x)
    qf, _ = fp.engine_quantize_fp8(x)
    assert not torch.equal(_bits(qe), _bits(qf))
    for exact in (True, False):
        out, _ = fp.fp8_producer("plain", x, write_y=True, exact=exact)
        _quantized_like(out, exact)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("m", "k", "residual"), [(3, 256, True), (2, 400, False), (1, 64, True)])
def test_rms_norm_fp8_equals_the_reference_quantizer_of_its_row(poisoned, m, k, residual, exact):
    g = torch.Generator().manual_seed(m * 7 + k)
    x = (torch.randn(m, k, generator=g) * 3).bfloat16()
    r = (torch.randn(m, k, generator=g) * 3).bfloat16() if residual else None
    w = (1 + 0.3 * torch.randn(k, generator=g)).bfloat16()
    out, s = fp.rms_norm_fp8(x, w, 1e-5, residual=r, write_y=True, exact=exact)
    sref = (x.float() + r.float()).bfloat16() if residual else x
    if residual:
        assert torch.equal(s, sref)
    else:
        assert s is None
    yref = F.rms_norm(sref.float(), (k,), w.float(), 1e-5).bfloat16()
    assert torch.allclose(out.y.float(), yref.float(), rtol=2**-7, atol=1e-6)
    _quantized_like(out, exact)
    assert out.scale.shape == (m, 1) and out.q.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(("m", "k"), [(2, 256), (3, 200)])
def test_silu_mul_fp8_equals_the_reference_quantizer_of_its_row(poisoned, m, k, exact):
    g = torch.Generator().manual_seed(m + k)
    gu = (torch.randn(m, 2 * k, generator=g) * 2).bfloat16()
    out = fp.silu_mul_fp8(gu, write_y=True, exact=exact)
    gg, uu = gu.float().chunk(2, dim=-1)
    yref = (F.silu(gg) * uu).bfloat16()
    assert torch.allclose(out.y.float(), yref.float(), rtol=2**-7, atol=1e-6)
    _quantized_like(out, exact)


def test_reference_matches_the_kernel_and_the_gemm_on_its_output_matches_the_eager_road():
    g = torch.Generator().manual_seed(5)
    m, k, n = 4, 256, 96
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    r = (torch.randn(m, k, generator=g) * 2).bfloat16()
    w = (1 + 0.2 * torch.randn(k, generator=g)).bfloat16()
    got, s = fp.rms_norm_fp8(x, w, 1e-6, residual=r, write_y=True, exact=True)
    ref, sref = fp.reference_fp8_producer("rms_norm", x, weight=w, residual=r, eps=1e-6, exact=True)
    assert torch.equal(s, sref)
    # the row may differ by the order of the fp32 sum of squares: codes equal where the rows are equal
    same = got.y == ref.y
    assert same.float().mean() > 0.9
    assert torch.equal(_bits(got.q)[same.all(dim=1)], _bits(ref.q)[same.all(dim=1)])
    wl = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    from foursight.fp8 import quantize_weight_fp8

    wq, ws = quantize_weight_fp8(wl)
    y_fused = dequantize_rowwise(got.q, got.scale) @ dequantize_rowwise(wq, ws).t()
    xq, sx = quantize_activation_fp8(got.y)  # the eager road on the same row
    y_eager = dequantize_rowwise(xq, sx) @ dequantize_rowwise(wq, ws).t()
    assert torch.equal(y_fused, y_eager)


def test_quantize_fp8_plain_row_and_zero_row():
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(3, 128, generator=g) * 50).bfloat16()
    x[1] = 0
    for exact in (True, False):
        got = fp.quantize_fp8(x, exact=exact)
        q, scale = quantize_activation_fp8(x) if exact else fp.engine_quantize_fp8(x)
        assert torch.equal(_bits(got.q), _bits(q))
        assert torch.equal(got.scale, scale)


def test_bad_inputs_name_the_tensor():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(FP8Error, match="weight"):
        fp.rms_norm_fp8(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(FP8Error, match="residual"):
        fp.rms_norm_fp8(x, torch.ones(64, dtype=torch.bfloat16), 1e-6, residual=torch.zeros(3, 64, dtype=torch.bfloat16))
    with pytest.raises(FP8Error, match="odd width"):
        fp.silu_mul_fp8(torch.zeros(2, 63, dtype=torch.bfloat16))
    with pytest.raises(FP8Error, match="bfloat16"):
        fp.quantize_fp8(torch.zeros(2, 64))
    with pytest.raises(FP8Error, match="kind"):
        fp.fp8_producer("gelu", x)
