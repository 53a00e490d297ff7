"""`foursight quantize` checkpoints: round trip, config schema, and errors that name the culprit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from foursight import schema
from foursight.checkpoint import quantize_model
from foursight.quantize_config import QuantizeConfig
from foursight.tensor_io import read_quant_config
from foursight.hf import load_reference_model, quantize_hf_model
from typer.testing import CliRunner
from foursight.schema import CheckpointError, FourSightConfig
from helpers.checkpoints import copy_folder, edit_tensors, edited_copy


def test_checkpoint_layout_and_config(tiny_qwen2_ckpt):
    out = tiny_qwen2_ckpt
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "foursight" and cfg["group_size"] == 16 and cfg["format_version"] == 1
    assert cfg["ignore"] == ["lm_head"]
    t = load_file(str(out / "model.safetensors"))
    p = "model.layers.0.self_attn.q_proj"
    assert t[f"{p}.weight_packed"].dtype == torch.uint8 and t[f"{p}.weight_packed"].shape == (128, 64)
    assert t[f"{p}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{p}.weight_scale"].shape == (128, 8)
    assert t[f"{p}.weight_global_scale"].shape == (1,) and t[f"{p}.input_global_scale"].shape == (1,)
    assert t[f"{p}.bf16_channels"].dtype == torch.int32 and t[f"{p}.bf16_channels"].numel() == 16
    assert t[f"{p}.weight_bf16"].shape == (128, 16) and f"{p}.bias" in t  # qwen2 has q/k/v bias
    assert "lm_head.weight" in t and "lm_head.weight_packed" not in t  # ignored stays BF16
    assert f"{p}.weight" not in t
    # q/k/v share one channel set, gate/up share one
    for a, b in [("k_proj", "q_proj"), ("v_proj", "q_proj")]:
        assert torch.equal(t[f"model.layers.0.self_attn.{a}.bf16_channels"], t[f"model.layers.0.self_attn.{b}.bf16_channels"])
    assert torch.equal(t["model.layers.1.mlp.gate_proj.bf16_channels"], t["model.layers.1.mlp.up_proj.bf16_channels"])
    assert not torch.equal(t["model.layers.1.mlp.down_proj.bf16_channels"], t["model.layers.1.mlp.up_proj.bf16_channels"])
    for f in ("tokenizer.json", "foursight_layers.json", "foursight_channels.json"):
        assert (out / f).exists()
    assert not list(out.parent.glob("*.tmp-*"))


def test_tiny_outlier_channels_are_found_and_help(quantize_tiny, tiny_qwen2_dir):
    """The tiny model plants 4 outlier channels in the residual stream (RMSNorm gains of 12)."""
    rows = [r for r in quantize_tiny(tiny_qwen2_dir).layers if r.name.endswith(("q_proj", "gate_proj"))]
    for r in rows:
        assert r.err_foursight < 0.7 * r.err_nvfp4, r


def test_round_trip_equals_in_memory_quantization(tiny_qwen2_ckpt, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    ref = load_reference_model(tiny_qwen2_ckpt)
    mem = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.bfloat16)
    chans = json.loads((tiny_qwen2_ckpt / schema.CHANNELS_FILE).read_text())["channels"]
    quantize_hf_model(mem, {k: torch.tensor(v, dtype=torch.int32) for k, v in chans.items()})
    ids = torch.randint(0, 400, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, mem(ids).logits)


def test_plain_nvfp4_with_zero_channels(tiny_qwen2_dir, tmp_path):
    res = quantize_model(tiny_qwen2_dir, tmp_path / "fp4", QuantizeConfig(channels=0), progress=False)
    assert all(r.k == 0 for r in res.layers)
    assert read_quant_config(res.out_dir).channel_selection == "none"
    t = load_file(str(res.out_dir / "model.safetensors"))
    assert t["model.layers.0.mlp.up_proj.weight_bf16"].shape == (256, 0)


def test_error_target_gives_per_layer_budgets(tiny_qwen2_dir, tmp_path):
    res = quantize_model(tiny_qwen2_dir, tmp_path / "et", QuantizeConfig(error_target=0.08, max_k=64), progress=False)
    ks = {r.k for r in res.layers}
    assert len(ks) > 1, ks  # layers with heavier outliers got more channels
    for r in res.layers:
        assert r.err_foursight <= 0.08 or r.k == 64


def test_percentage_budget(tiny_qwen2_dir, tmp_path):
    res = quantize_model(tiny_qwen2_dir, tmp_path / "pct", QuantizeConfig(channels="10%"), progress=False)
    by = {r.name: r.k for r in res.layers}
    assert by["model.layers.0.self_attn.q_proj"] == 16  # 10% of 128 = 12.8 -> one block of 16
    assert by["model.layers.0.mlp.down_proj"] == 32  # 10% of 256 = 25.6 -> 32


# ---- bad input: clear errors, nothing half-written --------------------------------------------


def test_k_not_multiple_of_16_names_layer(tmp_path):
    from foursight.models import build_tiny_model

    src = build_tiny_model(tmp_path / "odd", hidden_size=40, intermediate_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj: in_features=40 is not a multiple of 16"):
        quantize_model(src, tmp_path / "out", QuantizeConfig(channels=0), progress=False)
    assert not (tmp_path / "out").exists()


def test_non_finite_weights_name_layer(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("inf")
    src = tmp_path / "bad"
    m.save_pretrained(src)
    shutil.copy(tiny_llama_dir / "tokenizer.json", src)
    shutil.copy(tiny_llama_dir / "tokenizer_config.json", src)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj: weight has non-finite"):
        quantize_model(src, tmp_path / "out", QuantizeConfig(channels=16), progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))


def test_k_at_least_K_is_rejected(tiny_llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj: --channels 128 gives k=128 but the layer has K=128"):
        quantize_model(tiny_llama_dir, tmp_path / "out", QuantizeConfig(channels=128), progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_clobbered(tiny_qwen2_ckpt, tiny_qwen2_dir):
    with pytest.raises(FileExistsError):
        quantize_model(tiny_qwen2_dir, tiny_qwen2_ckpt, QuantizeConfig(channels=0), progress=False)


@pytest.mark.parametrize(
    "patch,msg",
    [
        ({"format_version": 7}, "quantization_config.format_version: .*unsupported FourSight format_version 7"),
        ({"bf16_channels_per_layer": 3}, "quantization_config.bf16_channels_per_layer: Extra inputs are not permitted"),
        ({"group_size": 32}, "quantization_config.group_size"),
    ],
)
def test_bad_config_names_field(tiny_qwen2_ckpt, tmp_path, patch, msg):
    d = copy_folder(tiny_qwen2_ckpt, tmp_path / "copy")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=msg):
        load_reference_model(d)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"), r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight_scale"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.weight_bf16", torch.zeros(128, 8, dtype=torch.bfloat16)),
     r"tensor model\.layers\.0\.self_attn\.o_proj\.weight_bf16 has shape \[128, 8\], expected \[128, 16\]"),
    (lambda t: t.pop("model.layers.0.input_layernorm.weight"), r"missing tensor model\.layers\.0\.input_layernorm\.weight"),
], ids=["missing-tensor", "wrong-shape", "missing-plain-tensor"])
def test_bad_tensor_named(tiny_qwen2_ckpt, tmp_path, edit, message):
    d = edited_copy(tiny_qwen2_ckpt, tmp_path / "copy", edit)
    with pytest.raises(CheckpointError, match=message):
        load_reference_model(d)


def test_config_parse_roundtrip():
    c = FourSightConfig(channels={"a.q_proj": 16}, ignore=["lm_head", "re:.*gate$"])
    assert FourSightConfig.parse(c.model_dump()) == c
    assert c.is_ignored("lm_head") and c.is_ignored("model.lm_head") and c.is_ignored("mlp.gate")
    assert not c.is_ignored("mlp.gate_proj")
    with pytest.raises(CheckpointError, match="channels"):
        FourSightConfig.parse({"channels": {"x": -1}})


# ---- nothing non-finite passes `foursight inspect` / the checkpoint reader (issue 14) --------


def _inspect(d: Path):
    from typer.testing import CliRunner

    from foursight.cli import app

    return CliRunner().invoke(app, ["inspect", str(d)])


@pytest.mark.parametrize("name,index,value", [
    ("model.layers.0.mlp.down_proj.weight_scale", (0, 0), "nan"),
    ("model.embed_tokens.weight", (3, slice(None)), "inf"),
    ("model.norm.weight", (5,), "nan"),
    ("model.layers.0.self_attn.q_proj.bias", (2,), "nan"),
    ("model.layers.1.mlp.gate_proj.weight_bf16", (0, 1), "inf"),
])
def test_inspect_rejects_non_finite_tensor_naming_it(tiny_qwen2_ckpt, tmp_path, name, index, value):
    d = copy_folder(tiny_qwen2_ckpt, tmp_path / "copy")

    def edit(t):
        x = t[name].clone()
        if x.dtype == torch.float8_e4m3fn:
            x.view(torch.uint8)[index] = 0x7F  # the e4m3fn NaN
        else:
            x[index] = float(value)
        t[name] = x

    edit_tensors(d, edit)
    r = _inspect(d)
    assert r.exit_code == 2, r.output
    assert f"tensor {name}" in r.output and "non-finite" in r.output
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {name} in ") + r".*model\.safetensors holds"):
        load_reference_model(d)


def test_decode_module_rejects_nan_weight_scale(tiny_qwen2_ckpt):
    from foursight.tensor_io import load_quantized_tensors

    cfg, mods, _ = load_quantized_tensors(tiny_qwen2_ckpt)
    name = "model.layers.0.self_attn.o_proj"
    t = dict(mods[name])
    t["weight_scale"] = t["weight_scale"].clone()
    t["weight_scale"].view(torch.uint8)[1, 0] = 0xFF  # -NaN in e4m3fn
    n, k2 = t["weight_packed"].shape
    with pytest.raises(CheckpointError, match=rf"tensor {name}\.weight_scale holds 1 non-finite"):
        schema.decode_module(name, t, n, 2 * k2, cfg.channels_for(name))


def test_truncated_safetensors_names_the_file(tiny_qwen2_ckpt, tmp_path):
    d = copy_folder(tiny_qwen2_ckpt, tmp_path / "copy")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"safetensors file {f} is truncated or unreadable"):
        load_reference_model(d)
    r = _inspect(d)
    assert r.exit_code == 2 and str(f) in r.output.replace("\n", "") and "Traceback" not in r.output


def test_force_replaces_only_a_foursight_checkpoint(tiny_qwen2_ckpt, tiny_llama_dir, tmp_path):
    """--force on a folder that is not a FourSight checkpoint (a planted file, a BF16 model folder):
    a clear error naming the folder and nothing deleted; on a checkpoint it replaces it."""
    from foursight.checkpoint import quantize_model

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"refusing to replace .*plain.*not a FourSight checkpoint.*nothing was deleted"):
        quantize_model(tiny_llama_dir, plain, QuantizeConfig(channels="16", force=True), progress=False)
    assert (plain / "precious.txt").read_text() == "keep me"
    bf16 = copy_folder(tiny_llama_dir, tmp_path / "bf16" / "copy")
    with pytest.raises(FileExistsError, match="not a FourSight checkpoint"):
        quantize_model(tiny_llama_dir, bf16, QuantizeConfig(channels="16", force=True), progress=False)
    assert (bf16 / "model.safetensors").exists()
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        quantize_model(tiny_llama_dir, f, QuantizeConfig(channels="16", force=True), progress=False)
    assert f.read_text() == "x"
    ck = copy_folder(tiny_qwen2_ckpt, tmp_path / "ck" / "copy")
    (ck / "notes.txt").write_text("the user's")  # a file added to a checkpoint of ours is the user's: named, kept (issue 38)
    with pytest.raises(FileExistsError, match=r"refusing to replace .*copy.*notes\.txt.*nothing was deleted"):
        quantize_model(tiny_llama_dir, ck, QuantizeConfig(channels="8", force=True), progress=False)
    (ck / "notes.txt").unlink()
    quantize_model(tiny_llama_dir, ck, QuantizeConfig(channels="8", force=True), progress=False)
    assert json.loads((ck / "config.json").read_text())["quantization_config"]["quant_method"] == "foursight"
    r = CliRunner().invoke(__import__("foursight.cli", fromlist=["app"]).app,
                           ["quantize", "--model", str(tiny_llama_dir), "--out", str(plain), "--channels", "16", "--force"])
    assert r.exit_code != 0 and "not a FourSight checkpoint" in " ".join(r.output.split()), r.output
    assert (plain / "precious.txt").exists()


def test_killed_quantize_leaves_a_folder_every_reader_refuses_and_the_next_run_removes(tiny_llama_dir, tmp_path):
    """A quantize process killed while writing (os._exit: no cleanup runs, as with SIGKILL) leaves
    its temporary folder; inspect and the loader refuse it as incomplete, and the next quantize to
    the same destination removes it."""
    import subprocess
    import sys

    from foursight.checkpoint import quantize_model
    from foursight.schema import INCOMPLETE_MARKER

    out = tmp_path / "ckpt"
    script = ("import os, foursight.channels_file as s\n"
              "s.ChannelsFile.write = lambda self, path: os._exit(9)\n"
              "from foursight.checkpoint import quantize_model\n"
              "from foursight.quantize_config import QuantizeConfig\n"
              f"quantize_model({str(tiny_llama_dir)!r}, {str(out)!r}, QuantizeConfig(channels='16'), progress=False)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 9, p.stderr[-2000:]
    left = list(tmp_path.glob("ckpt.tmp-*"))
    assert len(left) == 1 and (left[0] / INCOMPLETE_MARKER).exists() and (left[0] / "config.json").exists()
    assert not out.exists()
    r = _inspect(left[0])
    assert r.exit_code != 0 and "incomplete checkpoint" in " ".join(r.output.split()), r.output
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load_reference_model(left[0])
    quantize_model(tiny_llama_dir, out, QuantizeConfig(channels="16"), progress=False)
    assert list(tmp_path.glob("ckpt.tmp-*")) == [] and not (out / INCOMPLETE_MARKER).exists()
    assert _inspect(out).exit_code == 0


def test_quantize_model_takes_the_commands_options_with_the_carve_out_inside(tiny_llama_dir, tmp_path):
    """``quantize_model(src, out, QuantizeConfig)`` (issue 54 item 5): the options of ``foursight quantize`` written
    once, the BF16 carve-out resolved inside (the CLI did it before), and a bad option refused before any work,
    naming its flag."""
    res = quantize_model(tiny_llama_dir, tmp_path / "carved", QuantizeConfig(channels="16", bf16_layers=["attention"]), progress=False)
    names = set(load_file(str(res.out_dir / "model.safetensors")))
    assert res.bf16_layers and "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight_packed" not in names and "model.layers.0.mlp.up_proj.weight_packed" in names
    with pytest.raises(ValueError, match="--activations 'fp8'"):
        quantize_model(tiny_llama_dir, tmp_path / "bad", QuantizeConfig(activations="fp8"), progress=False)
    assert not (tmp_path / "bad").exists()

