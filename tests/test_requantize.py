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


def test_a_requantized_shard_skips_the_checkpoint_checks_until_a_checkpoint_tensor_is_loaded():
    """Checkpoint mode, q/k/v: after a BF16 sync (``weight`` loaders) the layer's state equals a fresh
    load of ``quantize_weight(new W, channels)``, and process() trusts what our quantizer wrote; a
    checkpoint tensor loaded directly afterwards (a negative block scale in k_proj) is checked again
    and refused by name."""
    from foursight.quant_methods.plan import CheckpointPlan
    from foursight.schema import CheckpointError, FourSightConfig, encode_module

    names = [f"model.layers.0.self_attn.{n}_proj" for n in "qkv"]
    rows, k_dim = [64, 32, 32], 128
    plan = CheckpointPlan.for_layer("model.layers.0.self_attn.qkv_proj", rows, k_dim, k_dim, FourSightConfig(channels={n: 4 for n in names}),
                               {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    params: dict[str, torch.nn.Parameter] = {}

    def engine_loader(param, w, shard_id=None):
        i = ["q", "k", "v"].index(shard_id)
        param.data.narrow(0, sum(rows[:i]), rows[i]).copy_(w)

    for spec in plan.param_specs():
        p = torch.nn.Parameter(spec.initial_tensor(), requires_grad=False)
        p.weight_loader = plan.loader.make_loader(spec, engine_loader, lambda: params)
        params[spec.name] = p
    ch = torch.tensor([3, 17, 64, 100], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    w0, w1 = ([(torch.randn(r, k_dim, generator=g) * 0.02).to(torch.bfloat16) for r in rows] for _ in range(2))
    for sid, name, w in zip("qkv", names, w0):
        for key, t in encode_module(name, quantize_weight(w, ch)).items():
            p = params[key.rpartition(".")[2]]
            p.weight_loader(p, t, sid)
    plan.process(params)
    for sid, w in zip("qkv", w1):
        params["weight"].weight_loader(params["weight"], w, sid)
    assert plan.loader.requantized == {0, 1, 2}
    want = concat_shards([quantize_weight(w, ch, name=n) for w, n in zip(w1, names)], "qkv")
    assert _same(plan.process(params).qw, want)
    bad = quantize_weight(w1[1], ch).weight_scale.clone()
    bad.view(torch.uint8)[0, 0] = 0xB8  # -1.0 in E4M3
    params["weight_scale"].weight_loader(params["weight_scale"], bad, "k")
    assert plan.loader.requantized == {0, 2}
    with pytest.raises(CheckpointError, match="k_proj.weight_scale holds negative block scales"):
        plan.process(params)
