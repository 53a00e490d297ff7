"""transformers' ``from_pretrained`` on a FourSight checkpoint on CUDA: every FourSight layer runs the
Triton kernels (``foursight.dispatch``'s Triton backend), and the logits are those of the PyTorch
reference model on the CPU, up to the kernels' accumulation order.

Marked ``gpu``: skipped on a machine without CUDA (run on the H200 through the device tool,
docs/ecosystem.md). The CPU half of the same path is tests/test_hf_quantizer.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tiny_qwen2_dir, tmp_path_factory):
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    out = tmp_path_factory.mktemp("ckpt") / "tiny-fs"
    quantize_model(tiny_qwen2_dir, out, QuantizeConfig(channels=16, activation_scale="static"), progress=False)
    return out


@pytest.mark.parametrize("placement", ["device_map", "to_cuda"])
def test_from_pretrained_on_cuda_runs_the_triton_kernels_and_matches_the_reference(ckpt, tiny_qwen2_dir, placement):
    from transformers import AutoModelForCausalLM

    import foursight  # noqa: F401
    from foursight.channels import relative_error as _rel
    from foursight.hf import FourSightLinear, load_reference_model

    if placement == "device_map":
        m = AutoModelForCausalLM.from_pretrained(ckpt, device_map="cuda")
    else:
        m = AutoModelForCausalLM.from_pretrained(ckpt).to("cuda")
    layers = {n: x for n, x in m.named_modules() if isinstance(x, FourSightLinear)}
    assert layers and {x._prepared.backend.name for x in layers.values()} == {"triton"}, \
        {n: x._prepared.backend.name for n, x in layers.items()}
    ref = load_reference_model(ckpt)  # CPU: the PyTorch reference backend
    ref_layers = {n: x for n, x in ref.named_modules() if isinstance(x, FourSightLinear)}
    assert set(ref_layers) == set(layers) and {x._prepared.backend.name for x in ref_layers.values()} == {"reference"}
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.bfloat16)
    ids = torch.randint(0, m.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [x.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, (inp[0].cpu(), out.cpu())))
             for n, x in layers.items()]
    with torch.no_grad():
        got = m(ids.cuda()).logits.cpu()
        want = ref(ids).logits
        orig = bf16(ids).logits
        # layer by layer: each CUDA layer's output against the reference layer on the same input
        layer_err = {n: _rel(y, ref_layers[n](x)) for n, (x, y) in seen.items()}
    for h in hooks:
        h.remove()
    assert seen.keys() == layers.keys()
    worst = max(layer_err, key=layer_err.get)
    err, damage = _rel(got, want), _rel(orig, want)
    print(f"{placement}: worst layer {worst} {layer_err[worst]:.2e}; logits |cuda - reference| / |reference| = {err:.2e}; "
          f"quantization damage |bf16 - reference| / |reference| = {damage:.2e}")
    # each layer reproduces the reference's numerics up to accumulation order (the kernel tests' 5e-3 bound,
    # with headroom for the activations' own rounding); through the model a one-ulp difference can move an
    # activation across an FP4 rounding boundary in the next layer, so the logits are held to a tenth of the
    # quantization's own effect
    assert layer_err[worst] < 1e-2, layer_err
    assert err < 0.1 * damage, (err, damage)
