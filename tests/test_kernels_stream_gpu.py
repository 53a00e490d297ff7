"""The register-streaming Gluon form (``foursight.kernels.experimental.gluon_stream``) on a CUDA sm_90 GPU against the
PyTorch reference run on the same GPU, and its bit-identity over repeated calls.

Marked ``gpu``: skipped without CUDA and where :func:`foursight.kernels.experimental.gluon_stream.available` is False
(no Gluon, not sm_90). Speed is never asserted here (``benchmarks/kernels/probe_stream.py`` times it).
Tolerances are those of ``tests/test_kernels_ws_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    import foursight.kernels.api as fk
    from foursight.kernels import api, tuning
    from foursight.kernels.experimental import gluon_stream, gluon_ws
    from foursight.kernels.configs import STREAM_CONFIGS, StreamConfig
    from foursight.layer import reference_linear

    _AVAILABLE = gluon_stream.available()
    _WHY = f"Gluon form not available here (gluon import: {gluon_ws.GLUON_IMPORT_ERROR or 'ok'}, " \
           f"capability {torch.cuda.get_device_capability()})"
else:
    _AVAILABLE, _WHY = False, "no CUDA"

from helpers.gpu_kernels import DEV, activation, cached_layer, check_fp32, repeat_identical
from helpers.kernel_switches import kernel_switches, kernel_switches_for_test
REPEATS = int(os.environ.get("FOURSIGHT_STREAM_REPEATS", "10"))
#: the three Llama-3.1-8B linear shapes (N x K) and two of SmolLM2-135M's
SHAPES = [(8192, 8192), (14336, 4096), (4096, 14336), (576, 576), (1536, 576)]
MS = [1, 5, 16]

@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
@pytest.mark.parametrize("k", [0, 128])
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N,K", SHAPES, ids=lambda v: str(v))
def test_gluon_stream_matches_reference_and_repeats_gpu(N, K, k, M, mode):
    qw, pw = cached_layer(N, K, k)
    x = activation(M, K, N + K + k + M)
    cfg = StreamConfig(8 if M <= 8 else 16, 2)
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
@pytest.mark.parametrize("M", [1, 13, 40])
def test_every_stream_candidate_matches_reference_gpu(M):
    """Every configuration of ``STREAM_CONFIGS``, W4A4 dynamic and static, on 4096 x 4096 with k = 128,
    split-K automatic (M = 40: several token tiles), repeated calls bit-identical."""
    qw, pw = cached_layer(4096, 4096, 128)
    x = activation(M, 4096, M)
    failures = []
    for cfg in STREAM_CONFIGS:
        for gs in (None, torch.tensor([23.0], device=DEV)):
            try:
                y = fk.splice_linear(x, pw, input_global_scale=gs, config=cfg)
                ref = reference_linear(x, qw, input_global_scale=gs, out_dtype=torch.float32)
                torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
                repeat_identical(lambda: fk.splice_linear(x, pw, input_global_scale=gs, config=cfg), y, str(cfg), REPEATS)
            except Exception as e:  # collect, so one run reports every broken candidate
                failures.append(f"{cfg} static={gs is not None}: {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not _AVAILABLE, reason=_WHY)
def test_autotuner_offers_and_checks_the_stream_candidates_gpu(request):
    """By default (``FOURSIGHT_STREAM`` unset) the decode candidates leave the streaming tiles out; with
    ``FOURSIGHT_STREAM=1`` they come after the measured ones, and the autotuner times each only after it
    matched the reference (TUNE_LOG has a time for each)."""
    with kernel_switches(FOURSIGHT_STREAM=None):
        assert not any(isinstance(c, StreamConfig) for c in api.candidates("decode", 1, "linear"))
    kernel_switches_for_test(request, FOURSIGHT_STREAM="1")
    assert not isinstance(api.candidates("decode", 1, "linear")[0], StreamConfig)
    qw, pw = cached_layer(4096, 4096, 128)
    for m in (1, 16):
        assert any(isinstance(c, StreamConfig) for c in api.candidates("decode", m, "linear"))
        tuning.TUNED.clear()
        x = activation(m, 4096, 7 + m)
        y = fk.splice_linear(x, pw)
        ref = reference_linear(x, qw, out_dtype=torch.float32)
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        key = api.linear_key("decode", m, pw, True, False, x.dtype, False)
        log = [(str(c), t, e) for c, t, e in tuning.TUNE_LOG[key] if isinstance(c, StreamConfig)]
        print(f"[stream] M={m} chosen {tuning.TUNED[key]}; streaming candidates: {log}")
        assert log and not [entry for entry in log if entry[1] is None], f"streaming candidates rejected or failed: {log}"
    tuning.TUNED.clear()
