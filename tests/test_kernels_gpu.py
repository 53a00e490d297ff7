"""The Triton kernels on a CUDA GPU at real sizes, against the PyTorch reference run on the same GPU.

Marked ``gpu``: skipped on a machine without CUDA (run on the H200 through the device tool, see
docs/kernels.md). Speed is never asserted here; see benchmarks/kernels/bench_splice_gemm.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    import foursight.kernels.api as fk
    from foursight.layer import QuantizedWeight, quantize_activation, quantize_weight, reference_linear

DEV = "cuda"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _channels(K: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.sort(torch.randperm(K, generator=g, device=DEV)[:k]).values.to(torch.int32)


def _act(M: int, K: int, g: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(M, K, generator=g, device=DEV) * torch.exp(torch.randn(1, K, generator=g, device=DEV))
    x[:, :: max(1, K // 7)] *= 30.0
    return x.to(dtype)


def _layer(N: int, K: int, k: int, g: torch.Generator) -> "QuantizedWeight":
    w = torch.randn(N, K, generator=g, device=DEV) * 0.02
    return quantize_weight(w, _channels(K, k, g))


def _assert_qa_equal(a, r):
    assert torch.equal(a.packed, r.packed), f"packed codes differ at {int((a.packed != r.packed).sum())} bytes"
    sa, sr = a.scale.view(torch.uint8), r.scale.view(torch.uint8)
    assert torch.equal(sa, sr), f"E4M3 scale bytes differ at {int((sa != sr).sum())} places"
    assert torch.equal(a.global_scale, r.global_scale), "global scales differ"
    assert torch.equal(a.x_bf16, r.x_bf16), "gathered channels differ"


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64, 4096])
@pytest.mark.parametrize("K,k", [(4096, 0), (4096, 128), (14336, 256), (4112, 16), (20480, 64)])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_activation_bit_exact_gpu(M, K, k, static):
    g = _gen(M + K + k)
    x = _act(M, K, g)
    ch = _channels(K, k, g)
    gs = torch.tensor([3.0], device=DEV) if static else None
    _assert_qa_equal(fk.quantize_activation(x, ch, gs), quantize_activation(x, ch, gs))


def test_quantize_activation_noncontiguous_fp16_gpu():
    g = _gen(5)
    x = _act(2048, 64, g, torch.float16).t()
    ch = _channels(2048, 128, g)
    _assert_qa_equal(fk.quantize_activation(x, ch), quantize_activation(x, ch))


def _check(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5):
    assert torch.isfinite(y).all()
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    err = (y.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert rel <= tol and err <= 20 * tol * scale, f"rel {rel:.3e}, max abs err {err:.3e} (output scale {scale:.3e})"


@pytest.mark.parametrize("M", [1, 3, 16, 17, 64, 256, 1024])
@pytest.mark.parametrize("N,K", [(4096, 4096), (1024, 4112)])  # 4112: ragged last K tile
@pytest.mark.parametrize("k", [0, 16, 128])
def test_splice_linear_w4a4_gpu(M, N, K, k):
    g = _gen(M * 3 + N + K + k)
    qw = _layer(N, K, k, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, K, g, torch.float32).bfloat16().float()  # fp32 in and out: tight comparison
    bias = torch.randn(N, generator=g, device=DEV)
    _check(fk.splice_linear(x, pw, bias=bias), reference_linear(x, qw, bias=bias))


@pytest.mark.parametrize("path", ["decode", "mid", "prefill"])
@pytest.mark.parametrize("M", [16, 64])
def test_splice_linear_forced_datapaths_static_gpu(path, M):
    g = _gen(M + len(path))
    qw = _layer(2048, 4096, 128, g)
    qw = QuantizedWeight(qw.weight_packed, qw.weight_scale,
                         qw.weight_global_scale.expand(2048) * torch.linspace(0.5, 2, 2048, device=DEV),
                         qw.bf16_channels, qw.weight_bf16)
    pw = fk.prepare_weight(qw)
    x = _act(M, 4096, g, torch.float32)
    gs = torch.tensor([5.0], device=DEV)
    _check(fk.splice_linear(x, pw, input_global_scale=gs, path=path), reference_linear(x, qw, input_global_scale=gs))


def test_splice_linear_bf16_noncontiguous_gpu():
    g = _gen(9)
    qw = _layer(4096, 4096, 128, g)
    pw = fk.prepare_weight(qw)
    for M in (4, 300):
        x = _act(2 * M, 4096, g)[::2]  # non-contiguous rows
        bias = torch.randn(4096, generator=g, device=DEV).bfloat16()
        y = fk.splice_linear(x, pw, bias=bias)
        ref = reference_linear(x, qw, bias=bias, out_dtype=torch.float32)
        assert y.dtype == torch.bfloat16
        _check(y, ref, tol=4e-3)  # one bf16 rounding of the output


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 16, 64, 512])
def test_splice_gemm_w4a16_gpu(dtype, M):
    g = _gen(M + (dtype == torch.float16))
    qw = _layer(4096, 4096, 128, g)
    pw = fk.prepare_weight(qw)
    x = _act(M, 4096, g, dtype)
    y = fk.splice_gemm(x, pw, None, out_dtype=torch.float32)
    _check(y, reference_linear(x, qw, act_quant=False, out_dtype=torch.float32))


def test_small_block_scales_fp16_subnormals_gpu():
    """Blocks whose E2M1 x E4M3 products sit in fp16's subnormal range (the decode keeps them as
    value * 2^-14): one large column per row sets the global scale, every other block is ~1e-3 of
    it, and X touches only the small blocks, so the whole output comes from subnormal operands."""
    g = _gen(21)
    N, K = 1024, 4096
    w = torch.randn(N, K, generator=g, device=DEV) * 1e-3
    w[:, 0] = 1.0
    qw = quantize_weight(w, torch.tensor([], dtype=torch.int32, device=DEV))
    pw = fk.prepare_weight(qw)
    x = torch.randn(64, K, generator=g, device=DEV).bfloat16()
    x[:, :16] = 0
    for M in (8, 64):
        xm = x[:M].contiguous()
        _check(fk.splice_gemm(xm, pw, None, out_dtype=torch.float32), reference_linear(xm, qw, act_quant=False, out_dtype=torch.float32))
        _check(fk.splice_linear(xm.float(), pw), reference_linear(xm.float(), qw))


def test_prepare_weight_idempotent_gpu():
    g = _gen(3)
    qw = _layer(512, 1024, 64, g)
    p1, p2 = fk.prepare_weight(qw), fk.prepare_weight(qw)
    for name in ("weight_packed", "weight_scale", "weight_global_scale", "bf16_channels", "channel_mask", "weight_bf16"):
        assert torch.equal(getattr(p1, name), getattr(p2, name)), name
    x = _act(8, 1024, g)
    assert torch.equal(fk.splice_linear(x, p1), fk.splice_linear(x, p2))


def test_dispatcher_picks_the_kernels_gpu():
    from foursight.dispatch import TritonBackend, prepare_linear

    g = _gen(4)
    qw = _layer(1024, 2048, 32, g)
    p = prepare_linear(qw)
    assert isinstance(p.backend, TritonBackend)
    assert isinstance(p.state, fk.PreparedWeight)
    x = _act(5, 2048, g, torch.float32)
    _check(p(x), reference_linear(x, qw))


def test_blackwell_gate_false_on_hopper():
    major, _ = torch.cuda.get_device_capability()
    if major == 9:
        from foursight.kernels.backends import blackwell_fp4_available

        assert blackwell_fp4_available() is False


def _all_configs():
    from foursight.kernels.configs import DECODE_CONFIGS, FP16_CONFIGS, MID_CONFIGS, PREFILL_CONFIGS

    return ([("decode", c) for c in DECODE_CONFIGS] + [("mid", c) for c in MID_CONFIGS] + [("prefill", c) for c in PREFILL_CONFIGS]
            + [(p, c) for p, cs in FP16_CONFIGS.items() for c in cs])


@pytest.mark.parametrize("path_cfg", _all_configs() if torch.cuda.is_available() else [], ids=str)
def test_every_tile_config_gpu(path_cfg):
    """Each candidate the autotuner may pick computes the same function (W4A4 and W4A16)."""
    path, cfg = path_cfg
    g = _gen(sum(ord(c) for c in str(cfg)))
    qw = _layer(1536, 4112, 128, g)  # ragged K for every BLOCK_K
    pw = fk.prepare_weight(qw)
    ms = [1] if isinstance(cfg, fk.GemvConfig) else [{"decode": 13, "mid": 100, "prefill": 300}[path]]
    for M in ms:
        x = _act(M, 4112, g, torch.float32).bfloat16()
        bias = torch.randn(1536, generator=g, device=DEV)
        gs = torch.tensor([7.0], device=DEV)
        if isinstance(cfg, fk.DequantConfig):  # bf16 only; bf16 rounding of the operands
            for aq, s in ((True, None), (True, gs), (False, None)):
                y = fk.splice_linear(x, pw, bias=bias.bfloat16(), input_global_scale=s, act_quant=aq, path=path, config=cfg)
                _check(y, reference_linear(x, qw, bias=bias.bfloat16(), input_global_scale=s, act_quant=aq, out_dtype=torch.float32), tol=4e-3)
            continue
        if isinstance(cfg, fk.FragmentConfig):  # bf16 activations only: W4A4 dynamic, bf16 output
            y = fk.splice_linear(x, pw, bias=bias.bfloat16(), path=path, config=cfg)
            ref = reference_linear(x, qw, bias=bias.bfloat16(), out_dtype=torch.float32)
            torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        else:
            y = fk.splice_linear(x.float(), pw, bias=bias, path=path, config=cfg)
            _check(y, reference_linear(x.float(), qw, bias=bias))
        y = fk.splice_linear(x, pw, input_global_scale=gs, path=path, config=cfg)
        ref = reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32)
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        y16 = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, path=path, config=cfg)
        _check(y16, reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32))


def test_autotuner_rejects_a_wrong_candidate_gpu(monkeypatch):
    """A candidate whose output is off the reference is logged and never chosen."""
    import foursight.kernels.api as fk_api
    import foursight.kernels.tuning as tuning

    g = _gen(77)
    qw = _layer(2048, 4096, 64, g)
    pw = fk.prepare_weight(qw)
    x = _act(64, 4096, g)
    cands = fk_api.candidates("mid", 64, "linear")
    bad = cands[0]
    real = fk_api.linear_run

    def broken(cfg, x2, p, bias, s, aq, out):
        real(cfg, x2, p, bias, s, aq, out)
        if cfg == bad:
            out.mul_(1.5)

    monkeypatch.setattr(fk_api, "linear_run", broken)
    tuning.TUNED.clear()
    y = fk.splice_linear(x, pw, path="mid")
    key = fk_api.linear_key("mid", 64, pw, True, False, x.dtype, False)
    assert tuning.TUNED[key] != bad
    assert any(c == bad and t is None and "reference" in (e or "") for c, t, e in tuning.TUNE_LOG[key])
    _check(y, reference_linear(x, qw, out_dtype=torch.float32), tol=4e-3)
    tuning.TUNED.clear()
