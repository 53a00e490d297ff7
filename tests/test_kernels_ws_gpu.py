"""The warp-specialized Gluon form (``foursight.kernels.experimental.gluon_ws``) on a CUDA sm_90 GPU against the
PyTorch reference run on the same GPU, and its bit-identity over repeated calls.

Marked ``gpu``: skipped without CUDA, and where :func:`foursight.kernels.experimental.gluon_ws.available` is False
(no Gluon, not sm_90, ``FOURSIGHT_WS=0``). Speed is never asserted here; see
``benchmarks/kernels/bench_ws.py``. Tolerances are those of ``tests/test_kernels_gpu.py`` for the
fragment form: bf16 output (W4A4) within ``rtol 2^-7, atol 1e-3·max|ref|``, fp32 output (W4A16,
``splice_gemm``) within 1e-5 relative (norm) and ``20·1e-5·max|ref|`` absolute.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    import foursight.kernels.api as fk
    from foursight.kernels import api, tuning
    from foursight.kernels.experimental import gluon_ws
    from foursight.kernels.configs import WS_CONFIGS, WSConfig
    from foursight.layer import reference_linear

    _AVAILABLE = gluon_ws.available()
    _WHY = f"Gluon form not available here (gluon import: {gluon_ws.GLUON_IMPORT_ERROR or 'ok'}, " \
           f"capability {torch.cuda.get_device_capability()}, FOURSIGHT_WS={os.environ.get('FOURSIGHT_WS', '0')})"
else:
    _AVAILABLE, _WHY = False, "no CUDA"

from helpers.gpu_kernels import DEV, activation, cached_layer, check_fp32, repeat_identical
from helpers.kernel_switches import kernel_switches_for_test
REPEATS = int(os.environ.get("FOURSIGHT_WS_REPEATS", "10"))
#: the three Llama-3.1-8B linear shapes (N x K) and two of SmolLM2-135M's
SHAPES = [(8192, 8192), (14336, 4096), (4096, 14336), (576, 576), (1536, 576)]
MS = [1, 16, 64, 128, 256]


def _cfg_for(m: int):
    """The Gluon tile for M (token tile at most 128; M = 256 runs two token tiles)."""
    if m <= 16:
        return WSConfig(16, 64, 4, 4)
    if m <= 64:
        return WSConfig(64, 64, 3, 4)
    if m <= 128:
        return WSConfig(64, 128, 3, 8)
    return WSConfig(128, 64, 2, 4)


@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("k", [0, 128])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_gluon_ws_matches_reference_and_repeats_gpu(N, K, k, M, mode):
    qw, pw = cached_layer(N, K, k)
    x = activation(M, K, N + K + k + M)
    cfg = _cfg_for(M)
    bias = torch.randn(N, generator=torch.Generator(device=DEV).manual_seed(M), device=DEV).bfloat16()
    if mode == "w4a4":
        def run():
            return fk.splice_linear(x, pw, bias=bias, config=cfg)
        y = run()
        ref = reference_linear(x, qw, bias=bias, out_dtype=torch.float32)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
    else:
        def run():
            return fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)
        y = run()
        check_fp32(y, reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32))
    repeat_identical(run, y, f"{cfg} {mode} {N}x{K} k={k} M={M}", REPEATS)


@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
@pytest.mark.parametrize("path", ["decode", "mid", "prefill"])
def test_every_gluon_candidate_matches_reference_gpu(path):
    """Every configuration of ``WS_CONFIGS`` (the autotuner's Gluon candidates), W4A4, on 4096 x 4096
    with k = 128, at an M of its datapath, split-K automatic, repeated calls bit-identical (W4A16 is
    covered per tile by the test above; one compile per variant is the cost on the device)."""
    qw, pw = cached_layer(4096, 4096, 128)
    m = {"decode": 13, "mid": 100, "prefill": 256}[path]
    x = activation(m, 4096, m)
    failures = []
    for cfg in WS_CONFIGS[path]:
        try:
            y = fk.splice_linear(x, pw, config=cfg)
            ref = reference_linear(x, qw, out_dtype=torch.float32)
            torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
            repeat_identical(lambda: fk.splice_linear(x, pw, config=cfg), y, str(cfg), REPEATS)
        except Exception as e:  # collect, so one run reports every broken candidate
            failures.append(f"{cfg}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_autotuner_offers_and_checks_the_gluon_candidates_gpu(request):
    """With Gluon available and ``FOURSIGHT_WS=1`` (the form is experimental: off by default) the decode
    and mid candidate lists include the Gluon tiles, and the autotuner times each only after it matched
    the reference (TUNE_LOG has a time for each)."""
    kernel_switches_for_test(request, FOURSIGHT_WS="1")
    qw, pw = cached_layer(4096, 4096, 128)
    for m, path in ((16, "decode"), (64, "mid")):
        cands = api.candidates(path, m, "linear")
        assert any(isinstance(c, WSConfig) for c in cands)
        tuning.TUNED.clear()
        x = activation(m, 4096, 7 + m)
        y = fk.splice_linear(x, pw)
        ref = reference_linear(x, qw, out_dtype=torch.float32)
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        key = api.linear_key(path, m, pw, True, False, x.dtype, False)
        ws_log = [(str(c), t, e) for c, t, e in tuning.TUNE_LOG[key] if isinstance(c, WSConfig)]
        print(f"[ws] M={m} chosen {tuning.TUNED[key]}; Gluon candidates: {ws_log}")
        bad = [entry for entry in ws_log if entry[1] is None]
        assert not bad, f"Gluon candidates rejected or failed: {bad}"
    tuning.TUNED.clear()
