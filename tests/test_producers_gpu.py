"""The fused producers (``foursight.kernels.api.rms_norm`` / ``silu_mul``) on a GPU, at the 8B decoder's widths.

- The quantized operands equal :func:`foursight.layer.quantize_activation` (the PyTorch oracle) of the
  kernel's own bf16 row, bit for bit, on the same device (dynamic and static scale, k = 128 and k = 0).
- The linear on the produced input equals the same tile on the row (the standalone quantizer + GEMM), bit
  for bit, and 20 repeats of the chain are bit-identical.
- A chain ``rms_norm → qkv``, ``silu_mul → down`` captured in a CUDA graph (autotuning done before) replays
  to the eager outputs bit for bit.

Marked ``gpu``: skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import foursight.kernels.api as fk  # noqa: E402
from foursight.kernels.configs import FragmentConfig  # noqa: E402
from foursight.layer import quantize_weight  # noqa: E402
from helpers.producers import assert_quantized_like_oracle  # noqa: E402

DEV = torch.device("cuda")
H, I = 4096, 14336  # the 8B decoder's hidden and intermediate widths


def _layer(n: int, k: int, ks: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).bfloat16()
    ch = torch.sort(torch.randperm(k, device=DEV, generator=g)[:ks]).values.to(torch.int32)
    return fk.prepare_weight(quantize_weight(w, ch), name=f"layer{seed}")


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize(("ks", "static"), [(128, False), (0, False), (128, True)])
def test_producers_quantize_like_the_oracle(m, ks, static):
    g = torch.Generator(device=DEV).manual_seed(m + ks)
    x = torch.randn(m, H, device=DEV, generator=g).bfloat16()
    r = torch.randn(m, H, device=DEV, generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(H, device=DEV, generator=g)).bfloat16()
    gu = (2 * torch.randn(m, 2 * I, device=DEV, generator=g)).bfloat16()
    gs_static = torch.tensor([11.0], device=DEV) if static else None
    pw_h, pw_i = _layer(256, H, ks, 1), _layer(256, I, ks, 2)

    row, s_row = fk.rms_norm(x, w, 1e-5, residual=r)
    assert torch.equal(s_row, x + r)
    y_ref = F.rms_norm((x + r).float(), (H,), w.float(), 1e-5)
    assert (row.y.float() - y_ref).abs().max() <= 2 ** -7 * y_ref.abs().max()
    p, s = fk.rms_norm(x, w, 1e-5, residual=r, consumer=pw_h, input_global_scale=gs_static)
    assert torch.equal(s, s_row)
    assert_quantized_like_oracle(p, row.y, pw_h.bf16_channels, gs_static)

    act = fk.silu_mul(gu)
    gate, up = gu.float().chunk(2, dim=-1)
    a_ref = F.silu(gate) * up
    assert (act.y.float() - a_ref).abs().max() <= 2 ** -7 * a_ref.abs().max()
    assert_quantized_like_oracle(fk.silu_mul(gu, consumer=pw_i, input_global_scale=gs_static), act.y, pw_i.bf16_channels, gs_static)


@pytest.mark.parametrize("m", [1, 16, 64])
def test_linear_on_produced_input_equals_the_unfused_linear(m):
    g = torch.Generator(device=DEV).manual_seed(7 + m)
    x = torch.randn(m, H, device=DEV, generator=g).bfloat16()
    w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    pw = _layer(6144, H, 128, 3)
    cfg = FragmentConfig(16, 128) if m <= 16 else FragmentConfig(64, 64)
    row, _ = fk.rms_norm(x, w)
    p, _ = fk.rms_norm(x, w, consumer=pw)
    want = fk.splice_linear(row.y, pw, config=cfg)
    got = fk.splice_linear(p, pw, config=cfg)
    assert torch.equal(got, want)
    tuned = fk.splice_linear(p, pw)  # the autotuned tile: the reference check ran inside the autotuner
    for _ in range(20):
        p2, _ = fk.rms_norm(x, w, consumer=pw)
        assert torch.equal(fk.splice_linear(p2, pw), tuned)


def test_chain_in_a_cuda_graph_equals_eager():
    m = 4
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(m, H, device=DEV, generator=g).bfloat16()
    r = torch.randn(m, H, device=DEV, generator=g).bfloat16()
    w = torch.ones(H, device=DEV, dtype=torch.bfloat16)
    gu_pw, down_pw = _layer(2 * I, H, 128, 4), _layer(H, I, 128, 5)

    def chain():
        p, s = fk.rms_norm(x, w, residual=r, consumer=gu_pw)
        gu = fk.splice_linear(p, gu_pw)
        return s + fk.splice_linear(fk.silu_mul(gu, consumer=down_pw), down_pw)

    eager = chain()  # the autotuners time their candidates here, before any capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
