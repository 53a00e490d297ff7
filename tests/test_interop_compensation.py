"""Activation-side compensation added to an imported compressed-tensors NVFP4 checkpoint
(``foursight import CT --out DIR --channels K``, :func:`foursight.interop.compensate_import`).

The compressed-tensors checkpoint is made by the compressed-tensors library alone
(``helpers.checkpoints.library_ct_checkpoint``); its own decompression (``NVFP4PackedCompressor``) and
transformers' compressed-tensors loader are the independent references for the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from foursight import schema
from foursight.channels_file import ChannelsFile
from foursight.cli import app
from foursight.compressed_tensors_format import read_compressed_tensors
from foursight.hf import load_reference_model
from foursight.interop import compensate_import, import_compressed_tensors, write_checkpoint_folder
from foursight.schema import CheckpointError
from helpers.checkpoints import library_ct_checkpoint
from foursight.trainer_bridge.metrics import abs_diff_summary
from helpers.logprobs import fixed_sequences
from helpers.vllm_engine import subprocess_prompt_logprobs_each

ct = pytest.importorskip("compressed_tensors")


#: evaluation texts, none of them in the calibration set (foursight/data/calib_default.jsonl)
EVAL_TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp before the ships came in.",
    "def area(r):\n    import math\n    return math.pi * r * r\n\nprint(area(2.5))",
    "Q: A train leaves at 3 pm and travels 120 km at 60 km/h. When does it arrive? A: At 5 pm.",
    "Im Herbst fallen die Blätter von den Bäumen, und die Tage werden kürzer und kälter.",
    "User: Can you suggest a name for a small bakery? Assistant: How about 'The Rising Loaf'?",
    "Photosynthesis converts light energy, water and carbon dioxide into glucose and oxygen.",
]
GROUPS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


@pytest.fixture(scope="module")
def ct_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return library_ct_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("ctlib") / "ct")


@pytest.fixture(scope="module")
def k16(ct_dir, tmp_path_factory) -> Path:
    """The compensated import, through the CLI (``--channels 16``)."""
    out = tmp_path_factory.mktemp("k16") / "fs"
    r = CliRunner().invoke(app, ["import", str(ct_dir), "--out", str(out), "--channels", "16"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    return out


def _modules(sd: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n[: -len(".weight_packed")] for n in sd if n.endswith(".weight_packed"))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def test_nvfp4_tensors_stay_the_librarys_bit_for_bit(ct_dir, k16):
    lib = load_file(str(ct_dir / "model.safetensors"))
    fs = load_file(str(k16 / "model.safetensors"))
    mods = _modules(lib)
    assert len(mods) == 14 and _modules(fs) == mods
    for n in mods:
        for s in ("weight_packed", "weight_scale"):
            assert _same_bits(fs[f"{n}.{s}"], lib[f"{n}.{s}"]), f"{n}.{s}"
        assert fs[f"{n}.weight_global_scale"].dtype == torch.float32
        assert torch.equal(fs[f"{n}.weight_global_scale"], lib[f"{n}.weight_global_scale"].float().reshape(1)), n
    # every tensor that is not a quantized module's is copied unchanged (embeddings, norms, lm_head)
    plain = [k for k in lib if k.rsplit(".", 1)[0] not in mods]
    assert plain and all(_same_bits(fs[k], lib[k]) for k in plain)
    qc = json.loads((k16 / "config.json").read_text())["quantization_config"]
    assert qc["channels"] == {n: 16 for n in mods}
    assert (qc["channel_selection"], qc["channel_budget"], qc["activation_scale"], qc["activation_dtype"]) == (
        "calibration", "16", "static", "nvfp4")


def test_weight_bf16_is_the_dequantized_columns_and_fused_inputs_share_s(ct_dir, k16):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    lib = load_file(str(ct_dir / "model.safetensors"))
    fs = load_file(str(k16 / "model.safetensors"))
    cf = ChannelsFile.read(k16)
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for n in _modules(lib):
        ch = fs[f"{n}.bf16_channels"]
        assert ch.dtype == torch.int32 and ch.numel() == 16 and bool((ch[1:] > ch[:-1]).all())
        assert cf.channels[n] == ch.tolist()
        local = {k.rsplit(".", 1)[1]: v for k, v in lib.items() if k.rsplit(".", 1)[0] == n}
        deq = NVFP4PackedCompressor.decompress(local, scheme)["weight"]  # the library's own decode, BF16
        assert torch.equal(fs[f"{n}.weight_bf16"], deq[:, ch.long()].to(torch.bfloat16)), n
    for layer in (0, 1):
        for members in GROUPS:
            part = "self_attn" if "q_proj" in members else "mlp"
            names = [f"model.layers.{layer}.{part}.{m}" for m in members]
            chans = [fs[f"{n}.bf16_channels"] for n in names]
            assert all(torch.equal(c, chans[0]) for c in chans), names
            igs = [fs[f"{n}.input_global_scale"] for n in names]
            assert all(torch.equal(g, igs[0]) for g in igs), names
            # the static scale is quantize's: 448*6 / calibrated amax of the FP4 part (S zeroed)
            assert torch.equal(igs[0], schema.static_input_scale([cf.input_amax[n] for n in names]))
        # o_proj and down_proj read their own inputs: their S is chosen on their own
        assert not torch.equal(fs[f"model.layers.{layer}.self_attn.o_proj.bf16_channels"],
                               fs[f"model.layers.{layer}.self_attn.q_proj.bf16_channels"])


def test_s_is_the_top_variance_channels_of_the_dequantized_model(ct_dir, k16):
    """S of q/k/v is the top-16 input channels by variance of the q_proj input in the model that
    transformers' compressed-tensors loader dequantizes (an independent dequantized model), on the
    built-in calibration texts (one text per forward: no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    from foursight.calibration import builtin_texts

    m = AutoModelForCausalLM.from_pretrained(ct_dir, quantization_config=CompressedTensorsConfig(dequantize=True),
                                             dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(ct_dir)
    rows = []
    h = m.get_submodule("model.layers.1.self_attn.q_proj").register_forward_pre_hook(lambda mod, a: rows.append(a[0][0].float()))
    with torch.no_grad():
        for t in builtin_texts():
            m(**tok(t, return_tensors="pt", truncation=True, max_length=256))
    h.remove()
    var = torch.cat(rows).double().var(0, unbiased=False)
    ch = load_file(str(k16 / "model.safetensors"))["model.layers.1.self_attn.q_proj.bf16_channels"].long()
    rest = torch.ones_like(var, dtype=torch.bool)
    rest[ch] = False
    # the smallest selected variance is not below the largest unselected one (to BF16 forward noise)
    assert float(var[ch].min()) >= 0.98 * float(var[rest].max())


def _mean_abs_dlogp(model, ref_lps, seqs) -> float:
    from foursight.trainer_bridge.scoring import sequence_logprobs

    got = sequence_logprobs(model, seqs)
    return float(torch.cat([(a - b).abs() for a, b in zip(got, ref_lps)]).mean())


def test_compensated_import_is_closer_to_bf16_than_the_k0_imports(tiny_llama_dir, ct_dir, k16, tmp_path):
    """Teacher-forced on texts outside the calibration set, the compensated import's reference
    model is closer to the BF16 model than the k = 0 import and than a k = 0 import whose static
    input scales are recalibrated the same way (so the gain is the BF16 channels', not the scales')."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.trainer_bridge.scoring import sequence_logprobs

    k0 = import_compressed_tensors(ct_dir, tmp_path / "k0")
    cfg, tensors, cf = compensate_import(ct_dir, *read_compressed_tensors(ct_dir), "0", progress=False)
    assert cfg["quantization_config"]["channel_selection"] == "none" and not any(cfg["quantization_config"]["channels"].values())
    k0r = write_checkpoint_folder(tmp_path / "k0r", ct_dir, cfg, tensors, False, "import", channels_file=cf)
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), EVAL_TEXTS, 64)
    ref = sequence_logprobs(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval(), seqs)
    d = {name: _mean_abs_dlogp(load_reference_model(p), ref, seqs) for name, p in (("k0", k0), ("k0 recal", k0r), ("k16", k16))}
    print(f"\nmean |dlogp| vs BF16 on {sum(len(s) - 1 for s in seqs)} tokens: {d}")
    assert d["k16"] < d["k0"] and d["k16"] < d["k0 recal"]


@pytest.fixture(scope="module")
def k16_zeroed(k16, tmp_path_factory) -> Path:
    """``k16`` with the packed codes of each module's S columns set to 0 (the format's 'W with S
    zeroed'), by hand: even column = low nibble."""
    d = Path(shutil.copytree(k16, tmp_path_factory.mktemp("zeroed") / "fs"))
    sd = load_file(str(d / "model.safetensors"))
    changed = 0
    for n in _modules(sd):
        p = sd[f"{n}.weight_packed"].clone()
        for c in sd[f"{n}.bf16_channels"].tolist():
            p[:, c // 2] &= 0xF0 if c % 2 == 0 else 0x0F
        changed += int((p != sd[f"{n}.weight_packed"]).sum())
        sd[f"{n}.weight_packed"] = p
    assert changed > 0  # the imported S codes really are non-zero
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_unzeroed_s_codes_give_the_same_output_as_zeroed_ones(k16, k16_zeroed):
    """The imported packed weights keep their codes in the S columns; zeroing them changes no logit
    of the reference model: it multiplies them by exact zeros (X[:, S] is zeroed before quantizing)."""
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = load_reference_model(k16)(ids).logits, load_reference_model(k16_zeroed)(ids).logits
    assert torch.equal(a, b)


def test_bad_requests_fail_naming_the_field_or_layer(tiny_llama_dir, ct_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.layers\.\d\.\S+: --channels 999 gives k=999 but the layer has K=(128|256); k must be < K"):
        import_compressed_tensors(ct_dir, tmp_path / "a", channels="999")
    with pytest.raises(CheckpointError, match=r"--channels 'lots': expected a non-negative integer or a percentage"):
        import_compressed_tensors(ct_dir, tmp_path / "b", channels="lots")
    with pytest.raises(FileNotFoundError):
        import_compressed_tensors(ct_dir, tmp_path / "c", channels="16", calib=tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no calibration texts"):
        import_compressed_tensors(ct_dir, tmp_path / "c", channels="16", calib=tmp_path / "empty.jsonl")
    w4a16 = library_ct_checkpoint(tiny_llama_dir, tmp_path / "ct16", w4a4=False)
    with pytest.raises(CheckpointError, match=r"W4A16 \(quantization_config\.config_groups\.\*\.input_activations is null\).*--channels 0"):
        import_compressed_tensors(w4a16, tmp_path / "d", channels="16")
    r = CliRunner().invoke(app, ["import", str(w4a16), "--out", str(tmp_path / "e"), "--channels", "2%"], env={"COLUMNS": "250"})
    assert r.exit_code == 2 and r.output.startswith("error: ") and "W4A16" in r.output, r.output
    r = CliRunner().invoke(app, ["import", str(ct_dir), "--out", str(tmp_path / "f"), "--channels", "128"], env={"COLUMNS": "250"})
    assert r.exit_code == 2 and "gives k=128 but the layer has K=128" in r.output, r.output
    assert not any((tmp_path / x).exists() for x in "abcdef")  # refused before anything is written
    # k = 0 (the default, and any budget that gives k = 0) is the plain import: W4A16 is fine there
    assert json.loads((import_compressed_tensors(w4a16, tmp_path / "g", channels="0%") / "config.json").read_text())[
        "quantization_config"]["channel_budget"] == "0"


@pytest.fixture(scope="module")
def vllm_logprobs(ct_dir, k16, k16_zeroed, tmp_path_factory) -> dict[str, tuple]:
    """vLLM's teacher-forced logprobs (``--quantization foursight``) on the compensated import, the
    compressed-tensors folder unconverted, the compensated import with its S codes zeroed and the plain
    import (k = 0): ``name -> (sequences, logprobs)``, from one subprocess with one engine after another
    (vLLM imported once instead of four times). Adjacent ones must differ (k = 16 vs k = 0), so an
    engine that kept its predecessor's weights would be caught by the equalities the tests check."""
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("vllm-interop")
    k0 = import_compressed_tensors(ct_dir, tmp / "k0")
    names = {"k16": k16, "ct": ct_dir, "k16_zeroed": k16_zeroed, "k0": k0}
    got = dict(zip(names, subprocess_prompt_logprobs_each(list(names.values()), tmp / "engine")))
    for a, b in (("k16", "ct"), ("ct", "k16_zeroed"), ("k16_zeroed", "k0")):
        assert abs_diff_summary(got[a][1], got[b][1])["max"] > 0, f"{a} and {b} gave the same logprobs: an engine served its predecessor's weights"
    return got


@pytest.mark.vllm
def test_vllm_serves_the_compensated_import(tiny_llama_dir, k16, vllm_logprobs):
    """vLLM (CPU build, --quantization foursight) serves the compensated import (about 20 s per engine start).

    * The engine gives the same logprobs with the S codes as imported and with them zeroed (its
      fused q/k/v and gate/up layers multiply them by zeros too).
    * Against the FourSight reference model: W4A4 amplifies the engine's BF16 differences (vLLM's
      fused RMSNorm / rotary / attention) through FP4 activation rounding, so the W4A16 tolerance of
      test_interop.py::test_vllm_serves_an_imported_library_checkpoint (mean < 0.05) does not apply
      (docs/vllm.md: 0.12 mean for W4A4 k = 16 on this model); the bound is the W4A4 one of
      test_vllm_engine.py::test_teacher_forced_logprobs_close_to_reference: the engine-vs-reference
      gap well below the reference's own distance to BF16."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.scoring import sequence_logprobs

    (seqs, eng), (seqs_z, eng_z) = vllm_logprobs["k16"], vllm_logprobs["k16_zeroed"]
    assert seqs_z == seqs
    assert abs_diff_summary(eng, eng_z)["max"] == 0.0
    ref = sequence_logprobs(load_reference_model(k16), seqs)
    bf = sequence_logprobs(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval(), seqs)
    gap, effect = abs_diff_summary(eng, ref), abs_diff_summary(ref, bf)
    print(f"\ncompensated import (k=16, W4A4 static) in vLLM vs reference: mean {gap['mean']:.4f} max {gap['max']:.4f} "
          f"({gap['tokens']} tokens); reference vs BF16: mean {effect['mean']:.4f}")
    assert gap["mean"] < 0.6 * effect["mean"]


@pytest.mark.vllm
def test_vllm_serves_the_compressed_tensors_folder_directly(vllm_logprobs):
    """``--quantization foursight`` on the compressed-tensors library's own W4A4 folder, unconverted:
    vLLM's method-name check is overridden, its config is read as FourSight k = 0 and the engine's
    weight iterator adds the empty k = 0 tensors. The engine's logprobs equal, bit for bit, those it
    gives the same folder converted by ``foursight import`` (a separate path: the conversion writes
    the tensors to disk and its config lists every unquantized layer)."""
    (seqs, direct), (seqs_i, imported) = vllm_logprobs["ct"], vllm_logprobs["k0"]
    assert seqs_i == seqs
    assert abs_diff_summary(direct, imported)["max"] == 0.0


@pytest.mark.vllm
def test_vllm_config_takes_over_only_compressed_tensors_nvfp4(ct_dir, tmp_path):
    """The vLLM config's two hooks without an engine: ``--quantization foursight`` takes over a
    compressed-tensors checkpoint (and no other method, nor a compressed-tensors one without the flag),
    reads its NVFP4 scheme as static-scale k = 0 with its ignore list, and refuses another
    compressed-tensors scheme naming the field."""
    pytest.importorskip("vllm")
    from foursight.quant_methods.vllm_method import FourSightVllmConfig

    qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert FourSightVllmConfig.override_quantization_method(qc, "foursight") == "foursight"
    assert FourSightVllmConfig.override_quantization_method(qc, None) is None
    assert FourSightVllmConfig.override_quantization_method(qc, "compressed-tensors") is None
    assert FourSightVllmConfig.override_quantization_method({"quant_method": "awq"}, "foursight") is None
    fs = FourSightVllmConfig.from_config(qc).fs_config
    assert (fs.activation_dtype, fs.activation_scale, fs.channels) == ("nvfp4", "static", {})
    assert fs.ignore == qc["ignore"] and fs.is_ignored("lm_head")
    with pytest.raises(CheckpointError, match="quantization_config.format is 'float-quantized'"):
        FourSightVllmConfig.from_config(dict(qc, format="float-quantized"))
