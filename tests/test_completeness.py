"""Checkpoints are compared with the model they describe, and their scales checked for range, by
every reader: ``foursight inspect``, ``foursight import``, transformers' ``from_pretrained`` and
vLLM's loader (SGLang: tests/sglang/test_load_refusals.py). A missing or unexpected tensor, a
non-finite tensor, and a global scale that is zero, subnormal, non-finite or overflowing are
refused naming the tensor."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from foursight.checkpoint import quantize_model
from foursight.quantize_config import QuantizeConfig
from foursight.cli import app
from foursight.interop import export_compressed_tensors, import_compressed_tensors
from foursight.schema import GLOBAL_SCALE_MIN, INCOMPLETE_MARKER, CheckpointError

pytest.importorskip("compressed_tensors")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's load errors reach the test as raised (as in test_vllm_engine)

Q = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fs16(tiny_llama_dir, tmp_path_factory) -> Path:
    """A FourSight checkpoint (k = 16) of the tiny Llama."""
    return quantize_model(tiny_llama_dir, tmp_path_factory.mktemp("cpl") / "fs16", QuantizeConfig(channels=16), progress=False).out_dir


@pytest.fixture(scope="module")
def ct(tiny_llama_dir, tmp_path_factory) -> Path:
    """A compressed-tensors NVFP4 export of a k = 0 checkpoint of the tiny Llama."""
    root = tmp_path_factory.mktemp("cpl-ct")
    fs0 = quantize_model(tiny_llama_dir, root / "fs0", QuantizeConfig(channels=0, activation_scale="static"), progress=False).out_dir
    return export_compressed_tensors(fs0, root / "ct")


def edited(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose tensors went through ``edit(state_dict)``."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def drop(name):
    return lambda sd: sd.pop(name)


def add(name, t):
    return lambda sd: sd.__setitem__(name, t)


def put(name, value, idx=0):
    def edit(sd):
        t = sd[name].float().clone()
        t.view(-1)[idx] = value
        sd[name] = t.to(sd[name].dtype)
    return edit


def inspect_error(folder: Path) -> str:
    r = CliRunner().invoke(app, ["inspect", str(folder)])
    assert r.exit_code == 2, r.output
    return " ".join(r.output.split())


# ---- completeness: inspect and import ----------------------------------------------------------


@pytest.mark.parametrize("case, edit, message", [
    ("no-norm", drop("model.norm.weight"), "missing tensor model.norm.weight"),
    ("no-input-norm", drop("model.layers.1.input_layernorm.weight"), "missing tensor model.layers.1.input_layernorm.weight"),
    ("stray", add("model.layers.0.mlp.extra.weight", torch.zeros(4)), "unexpected tensor model.layers.0.mlp.extra.weight"),
])
def test_incomplete_compressed_tensors_folder_is_refused_by_inspect_and_import(ct, tmp_path, case, edit, message):
    """A compressed-tensors folder missing a norm (or holding a stray tensor): `inspect` and
    `import` refuse it naming the tensor (before: both passed, and the import served garbage)."""
    bad = edited(ct, tmp_path / case, edit)
    assert message in inspect_error(bad)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        import_compressed_tensors(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_incomplete_foursight_folder_is_refused_by_inspect(fs16, tmp_path):
    assert "missing tensor model.norm.weight" in inspect_error(edited(fs16, tmp_path / "bad", drop("model.norm.weight")))


# ---- scale ranges -------------------------------------------------------------------------------

BAD_SCALES = [("zero", 0.0), ("subnormal", 1e-40), ("overflowing-reciprocal", 1e-38), ("negative", -1.0),
              ("inf", float("inf")), ("nan", float("nan"))]


@pytest.mark.parametrize("suffix", ["weight_global_scale", "input_global_scale"])
@pytest.mark.parametrize("case, value", BAD_SCALES)
def test_global_scale_out_of_range_is_refused_by_inspect_naming_it(fs16, ct, tmp_path, suffix, case, value):
    """Zero, subnormal (1e-40: "valid" before, then NaN at the first request), a scale whose
    448*6/scale overflows BF16 (1e-38), negative and non-finite global scales: `inspect` refuses the
    FourSight and the compressed-tensors folder naming the tensor, and so does import."""
    name = f"{Q}.{suffix}"
    for kind, src in (("fs", fs16), ("ct", ct)):
        bad = edited(src, tmp_path / kind, put(name, value))
        msg = inspect_error(bad)
        assert f"tensor {name}" in msg and ("global scale in" in msg or "non-finite" in msg), msg
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name}")):
        import_compressed_tensors(tmp_path / "ct", tmp_path / "out")


def test_the_scale_range_is_where_the_dequantized_weight_is_finite():
    """The lower bound is the one the numerics need: at GLOBAL_SCALE_MIN every dequantized weight of
    a layer (``q * s / gs``, up to 448*6/gs) is a finite BF16 number; at half of it (accepted before)
    the largest ones overflow to Inf."""
    from foursight.layer import QuantizedWeight, dequantize_weight, quantize_weight

    torch.manual_seed(0)
    qw = quantize_weight(torch.randn(32, 64, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int32))

    def deq(gs):
        q = QuantizedWeight(qw.weight_packed, qw.weight_scale, torch.tensor([gs]), qw.bf16_channels, qw.weight_bf16)
        return dequantize_weight(q, torch.bfloat16)

    assert bool(torch.isfinite(deq(GLOBAL_SCALE_MIN)).all())
    assert not bool(torch.isfinite(deq(GLOBAL_SCALE_MIN / 2)).all())


# ---- transformers from_pretrained --------------------------------------------------------------


@pytest.mark.parametrize("case, edit, tensor", [
    ("nan-norm", put("model.norm.weight", float("nan"), 5), "model.norm.weight"),
    ("inf-embedding", put("model.embed_tokens.weight", float("inf"), 7), "model.embed_tokens.weight"),
    ("subnormal-scale", put(f"{Q}.weight_global_scale", 1e-40), f"{Q}.weight_global_scale"),
])
def test_transformers_from_pretrained_refuses_bad_values_naming_the_tensor(fs16, tmp_path, case, edit, tensor):
    """from_pretrained of a FourSight checkpoint with a NaN norm or an Inf embedding row (before:
    loaded, non-finite logits) or a subnormal global scale: CheckpointError naming the tensor."""
    from transformers import AutoModelForCausalLM

    import foursight  # noqa: F401  (registers the quantizer)

    bad = edited(fs16, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {tensor}")):
        AutoModelForCausalLM.from_pretrained(bad)


def test_transformers_from_pretrained_names_a_truncated_file(fs16, tmp_path):
    from transformers import AutoModelForCausalLM

    import foursight  # noqa: F401

    bad = tmp_path / "trunc"
    shutil.copytree(fs16, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(Exception, match=re.escape(str(f))):
        AutoModelForCausalLM.from_pretrained(bad)


# ---- vLLM ----------------------------------------------------------------------------------------


def _truncate(folder: Path) -> None:
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _mark(folder: Path) -> None:
    (folder / INCOMPLETE_MARKER).write_text("killed")


VLLM_CASES = [
    ("no-norm", lambda d: edited(d[0], d[1], drop("model.norm.weight")), r"missing tensor model\.norm\.weight"),
    ("stray", lambda d: edited(d[0], d[1], add("model.layers.0.mlp.extra.weight", torch.zeros(4))),
     r"unexpected tensor model\.layers\.0\.mlp\.extra\.weight"),
    ("subnormal-scale", lambda d: edited(d[0], d[1], put(f"{Q}.weight_global_scale", 1e-40)),
     re.escape(f"tensor {Q}.weight_global_scale") + ".*global scale"),
    ("truncated", lambda d: (shutil.copytree(d[0], d[1]), _truncate(d[1]), d[1])[-1], r"model\.safetensors is truncated or unreadable"),
    ("marked", lambda d: (shutil.copytree(d[0], d[1]), _mark(d[1]), d[1])[-1], re.escape(INCOMPLETE_MARKER)),
]


@pytest.mark.vllm
@pytest.mark.parametrize("case, make, pattern", VLLM_CASES, ids=[c[0] for c in VLLM_CASES])
def test_vllm_refuses_to_serve_a_bad_checkpoint_naming_the_tensor(fs16, tmp_path, case, make, pattern):
    """vLLM's `LLM(...)` on a FourSight checkpoint that lacks `model.norm.weight` (before: served,
    answering "'ikipedia\\n\\n,,,,"), holds a stray tensor, has a subnormal weight global scale
    (before: loaded, then a dead engine at the first request),
    a truncated safetensors file (before: a raw traceback without the file) or the incomplete-run
    marker: the load stops with a CheckpointError naming the tensor, file or marker."""
    pytest.importorskip("vllm")
    from vllm import LLM

    bad = make((fs16, tmp_path / case))
    with pytest.raises(CheckpointError, match=pattern):
        LLM(model=str(bad), enforce_eager=True, max_model_len=128, dtype="bfloat16", seed=0)
