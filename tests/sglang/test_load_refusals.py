"""SGLang's loader compares a FourSight checkpoint with the model (issue 28): a checkpoint without
``model.norm.weight`` (which SGLang served before, reporting healthy) stops the server at load with
a CheckpointError naming the tensor; so do a subnormal global scale and the incomplete-run marker."""

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
    ("subnormal-scale", _subnormal_scale, "CheckpointError: tensor model.layers.0.self_attn.q_proj.weight_global_scale must be a global scale"),
    ("marked", _marked, ".foursight-incomplete is present"),
])
def test_sglang_refuses_a_bad_checkpoint_at_load_naming_it(tiny_ckpt, tmp_path, case, edit, message):
    bad = tmp_path / case
    shutil.copytree(tiny_ckpt, bad)
    edit(bad)
    returncode, text = refused_at_load(bad, tmp_path / "bad.log")
    assert returncode != 0
    assert message in " ".join(text.split()), text[-3000:]
