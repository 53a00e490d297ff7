"""SGLang's loader compares a FourSight checkpoint with the model (issue 28): a checkpoint without
``model.norm.weight`` (which SGLang served before, reporting healthy) stops the server at load with
a CheckpointError naming the tensor; so do a subnormal global scale and the incomplete-run marker."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from sglang_helpers import STARTUP_TIMEOUT, free_port, launch_server, stop_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _no_norm(dst):
    from safetensors.torch import load_file, save_file

    t = load_file(str(dst / "model.safetensors"))
    del t["model.norm.weight"]
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


def _subnormal_scale(dst):
    from safetensors.torch import load_file, save_file

    t = load_file(str(dst / "model.safetensors"))
    t["model.layers.0.self_attn.q_proj.weight_global_scale"] = t["model.layers.0.self_attn.q_proj.weight_global_scale"].clone().fill_(1e-40)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


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
    log = tmp_path / "bad.log"
    proc = launch_server(bad, free_port(), log)
    try:
        proc.wait(STARTUP_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_server(proc)
        raise AssertionError(f"server with a bad checkpoint ({case}) did not exit:\n{log.read_text()[-3000:]}")
    finally:
        stop_server(proc)
    text = log.read_text()
    assert proc.returncode != 0
    assert message in " ".join(text.split()), text[-3000:]
