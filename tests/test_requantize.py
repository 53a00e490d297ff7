"""The sync's re-quantizer (:mod:`foursight.quant_methods.requantize`) equals the library quantizer bit for bit.

* CPU: :func:`quantize_shard` is :func:`foursight.layer.quantize_weight`.
* The Triton path, run by the Triton interpreter on CPU tensors in a subprocess of its own
  (``TRITON_INTERPRET`` must not leak into the engines other tests start): fused layers' shards with
  and without BF16 channels, ties on the E2M1 boundaries, zero rows, a given and a computed global scale.
* ``gpu``: the same on the device, 8B-shaped, where it is the sync's path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from foursight.layer import quantize_weight
from foursight.quant_methods.requantize import quantize_fused, quantize_shard
from foursight.quant_methods.sharding import concat_shards


def _weights(n: int, k: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.logspace(-4, 1, k)).to(torch.bfloat16)
    w[0] = 0
    w[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # ties when amax sits at 6
    ch = torch.sort(torch.randperm(k, generator=g)[: max(1, k // 32)]).values.to(torch.int32)
    return w.to(device), ch.to(device)


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a.tensors(), b.tensors()))


def test_cpu_path_is_the_library_quantizer():
    w, ch = _weights(64, 256, 0)
    assert _same(quantize_shard(w, ch, name="w"), quantize_weight(w, ch, name="w"))


def test_a_fused_layer_in_one_call_equals_its_shards_one_by_one():
    """q/k/v with different amaxes (so different per-tensor scales) quantized in one call: the
    concatenation of the shards quantized one by one, bit for bit; a NaN is named by its shard."""
    from foursight.nvfp4 import NVFP4Error

    w, ch = _weights(96, 256, 4)
    w[32:48] *= 40  # k_proj's scale differs from q_proj's
    rows, names = [48, 16, 32], ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
    parts = [quantize_shard(t, ch, name=n) for t, n in zip(torch.split(w, rows), names)]
    assert _same(quantize_fused(w, ch, rows, names), concat_shards(parts, "qkv"))
    assert _same(quantize_fused(w, ch[:0], rows, names), concat_shards([quantize_shard(t, ch[:0]) for t in torch.split(w, rows)], "qkv"))
    bad = w.clone()
    bad[70, 5] = float("nan")
    with pytest.raises(NVFP4Error, match="v_proj.weight"):
        quantize_fused(bad, ch, rows, names)


def test_triton_path_equals_the_library_quantizer_in_the_interpreter(tmp_path):
    """About 10 s: the kernel on small shapes under TRITON_INTERPRET=1, in a fresh process."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        from foursight.layer import quantize_weight
        from foursight.quant_methods.requantize import quantize_shard
        from test_requantize import _weights, _same
        bad = []
        for n, k, seed in ((48, 256, 0), (32, 160, 1)):
            w, ch = _weights(n, k, seed)
            for c in (ch, ch[:0]):
                for gs in (None, torch.tensor([17.5])):
                    got = quantize_shard(w, c, global_scale=gs, name="w", device_kernel=True)
                    if not _same(got, quantize_weight(w, c, global_scale=gs, name="w")):
                        bad.append((n, k, c.numel(), gs))
        print("BAD", bad)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BAD []" in r.stdout, r.stdout[-2000:]


@pytest.mark.gpu
def test_triton_path_equals_the_library_quantizer_on_the_gpu():
    """8B-shaped shards (q_proj 4096 x 4096, down_proj 4096 x 14336) on the device: the Triton path
    against the PyTorch quantizer run on the same device."""
    for n, k in ((4096, 4096), (4096, 14336), (1024, 4096)):
        w, ch = _weights(n, k, 3, device="cuda")
        assert _same(quantize_shard(w, ch, name="w"), quantize_weight(w, ch, name="w")), (n, k)
