"""SGLang's loader compares a FourSight checkpoint with the model (issue 28): a checkpoint without
``model.norm.weight`` (which SGLang served before, reporting healthy) stops the server at load with
a CheckpointError naming the tensor; so does the incomplete-run marker. A subnormal global scale is
refused by the FourSight layer's own check (``schema.decode_module``, which SGLang's FourSight layers
run on every module they load: test_server.py's missing-shard refusal is that check stopping a real
server); it is checked here at that function, without starting a third server (30-45 s on 2 cores)."""

from __future__ import annotations

import shutil

import pytest

from helpers.checkpoints import edit_tensors
from helpers.sglang_engine import refused_at_load

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _no_norm(dst):
    edit_tensors(dst, lambda t: t.pop("model.norm.weight"))


def _subnormal_scale(dst):
    name = "model.layers.0.self_attn.q_proj.weight_global_scale"
    edit_tensors(dst, lambda t: t.__setitem__(name, t[name].clone().fill_(1e-40)))


def _marked(dst):
    from foursight.schema import INCOMPLETE_MARKER

    (dst / INCOMPLETE_MARKER).write_text("killed")


@pytest.mark.parametrize("case, edit, message", [
    ("no-norm", _no_norm, "CheckpointError: missing tensor model.norm.weight"),
    ("marked", _marked, ".foursight-incomplete is present"),
])
def test_sglang_refuses_a_bad_checkpoint_at_load_naming_it(tiny_ckpt, tmp_path, case, edit, message):
    bad = tmp_path / case
    shutil.copytree(tiny_ckpt, bad)
    edit(bad)
    returncode, text = refused_at_load(bad, tmp_path / "bad.log")
    assert returncode != 0
    assert message in " ".join(text.split()), text[-3000:]


def test_the_layer_check_refuses_a_subnormal_global_scale_naming_it(tiny_ckpt, tmp_path):
    """The check SGLang's FourSight layers run on each module at load (``schema.decode_module``, through
    ``quant_methods.plan``) passes the module as written and refuses it with its global scale made subnormal
    (1e-40: no finite reciprocal), naming the tensor, as the server's log did."""
    from safetensors.torch import load_file

    from foursight.schema import CheckpointError, decode_module

    bad = tmp_path / "subnormal-scale"
    shutil.copytree(tiny_ckpt, bad)
    _subnormal_scale(bad)
    name = "model.layers.0.self_attn.q_proj"

    def module(folder):
        t = load_file(str(folder / "model.safetensors"))
        return {k[len(name) + 1:]: v for k, v in t.items() if k.startswith(name + ".")}

    good_t, bad_t = module(tiny_ckpt), module(bad)
    n, k_half = good_t["weight_packed"].shape
    k = good_t["bf16_channels"].numel()
    decode_module(name, good_t, n, 2 * k_half, k)  # the module as written passes
    with pytest.raises(CheckpointError) as ei:
        decode_module(name, bad_t, n, 2 * k_half, k)
    assert f"tensor {name}.weight_global_scale must be a global scale" in str(ei.value), ei.value
