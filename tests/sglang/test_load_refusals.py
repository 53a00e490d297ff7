"""SGLang's loader compares a FourSight checkpoint with the model (issue 28): a checkpoint without
``model.norm.weight`` (which SGLang served before, reporting healthy) stops a real server at load with
a CheckpointError naming the tensor. That is the one real-engine refusal kept for the loader's road
(FourSight's wrappers of ``DefaultModelLoader``; test_server.py keeps the one of the layer's road, a
missing shard); the loader's other checks are checked here at the function the wrapper calls, without
starting a server each (60-120 s on 2 cores; issue 54 item 1):

* a folder a writer left incomplete (the marker): :func:`foursight.quant_methods.config.check_folder`;
* a non-finite tensor: :func:`foursight.quant_methods.config.served_weights`, which the wrapped weight
  iterator returns (test_plugin_side_effects.py checks that ``register`` wraps both loader methods);
* a subnormal global scale: the FourSight layer's own check (``schema.decode_module``), which SGLang's
  FourSight layers run on every module they load.
"""

from __future__ import annotations

import shutil

import pytest

from helpers.checkpoints import edit_tensors, nan_copy
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


def test_sglang_refuses_a_checkpoint_without_its_norm_at_load_naming_it(tiny_ckpt, tmp_path):
    bad = tmp_path / "no-norm"
    shutil.copytree(tiny_ckpt, bad)
    _no_norm(bad)
    returncode, text = refused_at_load(bad, tmp_path / "bad.log")
    assert returncode != 0
    assert "CheckpointError: missing tensor model.norm.weight" in " ".join(text.split()), text[-3000:]


def test_the_loader_check_refuses_a_folder_left_incomplete_naming_the_marker(tiny_ckpt, tmp_path):
    """What the wrapped weight iterator runs first on the folder SGLang loads (``check_folder``): the
    folder as written passes; with the incomplete-run marker it is refused naming the marker."""
    from foursight.quant_methods.config import check_folder
    from foursight.schema import CheckpointError

    bad = tmp_path / "marked"
    shutil.copytree(tiny_ckpt, bad)
    check_folder(bad)
    _marked(bad)
    with pytest.raises(CheckpointError) as ei:
        check_folder(bad)
    assert ".foursight-incomplete is present" in " ".join(str(ei.value).split()), ei.value


def test_the_loader_check_refuses_a_non_finite_tensor_naming_it(tiny_ckpt, tmp_path):
    """The stream the wrapped weight iterator gives SGLang (``served_weights``): the checkpoint as written
    passes whole; with a NaN in ``model.embed_tokens.weight`` it stops naming the tensor (as the
    server's log did when a real server was started on it)."""
    import json

    from foursight.quant_methods.config import served_weights
    from foursight.schema import CheckpointError
    from foursight.tensor_io import iter_safetensors

    qc = json.loads((tiny_ckpt / "config.json").read_text())["quantization_config"]
    assert sum(1 for _ in served_weights(iter_safetensors(tiny_ckpt, check=False), qc)) > 0
    name = "model.embed_tokens.weight"
    bad = nan_copy(tiny_ckpt, tmp_path / "nan-embed", name)
    with pytest.raises(CheckpointError) as ei:
        for _ in served_weights(iter_safetensors(bad, check=False), qc, f" in {bad}"):
            pass
    assert f"tensor {name}" in str(ei.value) and "non-finite" in str(ei.value), ei.value


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
