"""The FP8 baseline's fused producers (``foursight.kernels.fp8_producers``) on a GPU, at the 8B decoder's widths.

What the interpreter tests cannot check: the hardware E4M3 conversion (``cvt.rn.satfinite``; the interpreter's
float8 conversion neither rounds to nearest nor saturates, so there the kernel rounds in integer arithmetic) and
the CUDA scale arithmetic (``SCALE_RECIP``). On the same device, bit for bit against the kernel's own bf16 row:

- ``exact=True`` equals :func:`foursight.fp8.quantize_activation_fp8` (the package's quantizer);
- the default (the engines' ``y · (1/scale)``) equals :func:`~foursight.kernels.fp8_producers.engine_quantize_fp8`;
- every E4M3 value, midpoint and neighbour through the ``plain`` kind (scale 1) equals ``torch``'s cast;
- the FP8 GEMM on the fused producer's output, captured in a CUDA graph, replays to the eager output.

Marked ``gpu``: skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import foursight.kernels.fp8_producers as fp  # noqa: E402
from foursight.fp8 import quantize_activation_fp8, quantize_weight_fp8, scaled_mm_rowwise  # noqa: E402

DEV = torch.device("cuda")
H, I = 4096, 14336  # the 8B decoder's hidden and intermediate widths


def _same(out, exact: bool):
    q, scale = quantize_activation_fp8(out.y) if exact else fp.engine_quantize_fp8(out.y)
    assert torch.equal(out.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out.scale, scale)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_rms_norm_and_silu_mul_fp8_bit_identical_on_the_gpu(m, exact):
    g = torch.Generator(device=DEV).manual_seed(m)
    x = (torch.randn(m, H, device=DEV, generator=g) * 3).bfloat16()
    r = (torch.randn(m, H, device=DEV, generator=g) * 3).bfloat16()
    w = (1 + 0.3 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    out, s = fp.rms_norm_fp8(x, w, 1e-5, residual=r, write_y=True, exact=exact)
    assert torch.equal(s, (x.float() + r.float()).bfloat16())
    _same(out, exact)
    gu = (torch.randn(m, 2 * I, device=DEV, generator=g) * 2).bfloat16()
    _same(fp.silu_mul_fp8(gu, write_y=True, exact=exact), exact)
    o = (torch.randn(m, H, device=DEV, generator=g) * 50).bfloat16()
    got = fp.quantize_fp8(o, exact=exact)
    q, scale = quantize_activation_fp8(o) if exact else fp.engine_quantize_fp8(o)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, scale)


def test_hardware_e4m3_conversion_rounds_like_torch():
    codes = torch.arange(0, 127, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    up = torch.nextafter(mids.bfloat16(), torch.tensor(1e9, dtype=torch.bfloat16)).float()
    down = torch.nextafter(mids.bfloat16(), torch.tensor(-1e9, dtype=torch.bfloat16)).float()
    row = torch.cat([vals, mids, up, down, torch.tensor([2.0**-10, 2.0**-11, 0.0, 448.0])])
    x = torch.cat([row, -row]).bfloat16()[None, :].to(DEV)
    for exact in (True, False):
        got = fp.quantize_fp8(x, exact=exact)
        assert got.scale.item() == 1.0
        assert torch.equal(got.q.view(torch.uint8), x.float().to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_gemm_on_the_fused_producer_replays_in_a_cuda_graph():
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(16, H, device=DEV, generator=g).bfloat16()
    r = torch.randn(16, H, device=DEV, generator=g).bfloat16()
    w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    wq, ws = quantize_weight_fp8((torch.randn(6144, H, device=DEV, generator=g) * H**-0.5).bfloat16())

    def step():
        p, _ = fp.rms_norm_fp8(x, w, 1e-5, residual=r)
        return scaled_mm_rowwise(p.q, p.scale, wq, ws, fast_accum=True)

    eager = step().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
