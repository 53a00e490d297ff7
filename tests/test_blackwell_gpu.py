"""GPU tests of the Blackwell native-FP4 backends (docs/blackwell.md). Skipped on CPU.

* On any CUDA GPU: the dot_scaled form through Triton's compiled ``tl.dot_scaled`` against the
  reference. On sm_90 (H200) Triton emulates the block-scaled MMA in BF16 (``HGMMA`` after decoding,
  offline SASS), so this checks the kernel's layouts and epilogue compiled, not the FP4 tensor cores.
* On sm_100/sm_103/sm_120/sm_121 only: the same on the FP4 tensor cores, and the FlashInfer backend
  (where ``flashinfer`` imports) against the reference. These have never run: no Blackwell GPU is lent
  to this project. Passing them is what would let ``auto`` pick a native backend
  (``foursight.kernels.backends.VERIFIED_NATIVE``).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _case(n, k_dim, m, channels, seed=0):
    from foursight.layer import quantize_weight

    g = torch.Generator().manual_seed(seed)
    qw = quantize_weight(torch.randn(n, k_dim, generator=g), torch.tensor(channels, dtype=torch.int64)).to("cuda")
    x = torch.randn(m, k_dim, generator=g) * 2
    if channels:
        x[:, list(channels)] *= 20
    return qw, x.to(torch.bfloat16).cuda()


def _close(y, ref, extra=None):
    err = (y.float() - ref).abs()
    tol = 2.0**-8 * ref.abs() + 1e-4 * ref.abs().max() + (0 if extra is None else extra)
    assert (err <= tol).all(), (err.max().item(), ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 16, 33, 64, 200])
@pytest.mark.parametrize("static", [False, True])
def test_dot_scaled_matches_the_reference_gpu(m, static):
    from foursight.kernels.experimental.dot_scaled import dot_scaled_linear, prepare_native_weight
    from foursight.layer import reference_linear

    qw, x = _case(512, 1024, m, (3, 77, 500, 1023))
    igs = torch.tensor([2688.0 / 60], device="cuda") if static else None
    bias = torch.randn(512, device="cuda").to(torch.bfloat16)
    y = dot_scaled_linear(x, prepare_native_weight(qw), bias, igs)
    _close(y, reference_linear(x, qw, bias, igs, out_dtype=torch.float32))


def _blackwell():
    from foursight.kernels.backends import native_fp4

    return native_fp4(tuple(torch.cuda.get_device_capability()))


@pytest.mark.skipif(not torch.cuda.is_available() or not _blackwell(), reason="needs a Blackwell GPU (sm_100/sm_120)")
@pytest.mark.parametrize("m", [1, 16, 128, 300])
def test_flashinfer_backend_matches_the_reference_gpu(m, monkeypatch):
    pytest.importorskip("flashinfer")
    from foursight import dispatch
    from foursight.layer import reference_linear

    monkeypatch.setenv("FOURSIGHT_KERNEL_BACKEND", "flashinfer")
    qw, x = _case(512, 1024, m, (3, 77, 500, 1023))
    p = dispatch.prepare_linear(qw, "gpu.flashinfer")
    assert p.backend.name == "flashinfer"
    igs = torch.tensor([2688.0 / 60], device="cuda")
    bias = torch.randn(512, device="cuda").to(torch.bfloat16)
    ref = reference_linear(x, qw, bias, igs, out_dtype=torch.float32)
    ch = qw.bf16_channels.long()
    l1_rounding = 2.0**-8 * (x[:, ch].float().abs() @ qw.weight_bf16.float().abs().t())
    _close(p(x, bias, igs), ref, l1_rounding)


@pytest.mark.skipif(not torch.cuda.is_available() or not _blackwell(), reason="needs a Blackwell GPU (sm_100/sm_120)")
def test_dot_scaled_backend_through_the_dispatcher_gpu(monkeypatch):
    from foursight import dispatch
    from foursight.layer import reference_linear

    monkeypatch.setenv("FOURSIGHT_KERNEL_BACKEND", "dot_scaled")
    qw, x = _case(512, 1024, 16, (3, 77))
    p = dispatch.prepare_linear(qw, "gpu.dot_scaled")
    assert p.backend.name == "dot_scaled"
    _close(p(x, None, None), reference_linear(x, qw, None, None, out_dtype=torch.float32))
