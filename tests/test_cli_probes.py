"""Round-two probing of the command line (issue 28, class 7): a bad option gets ``error:`` naming the
flag or the folder and exit status 2, before any model is loaded, and nothing of the user's is lost.

Each case was found by running the verb as a careless user would; each failed before its fix (a raw
traceback, an errno without the flag, a check made after minutes of calibration, an option silently
ignored, or a folder overwritten or deleted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from foursight.cli import app

ENV = {"COLUMNS": "200"}


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model is the slow part a bad option must not wait for: here it fails the test."""
    import transformers

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the bad option was reported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)


def _run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _refused(r, *needles: str) -> str:
    out = " ".join(r.output.split())  # rich may wrap long messages
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    for n in needles:
        assert n in out, (n, out)
    return out


def _foreign_folder(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("the user's work")
    return d


# ---- nothing is lost: the model folders of `foursight models` go through the one folder writer


def test_models_tiny_refuses_an_existing_folder_and_force_replaces_only_its_own(tmp_path):
    mine = _foreign_folder(tmp_path)
    _refused(_run("models", "tiny", "--out", mine), f"{mine} exists; pass --force")
    _refused(_run("models", "tiny", "--out", mine, "--force"), "refusing to replace", "nothing was deleted")
    assert (mine / "notes.txt").read_text() == "the user's work"  # it was overwritten in place before
    ours = tmp_path / "tiny"
    assert _run("models", "tiny", "--out", ours).exit_code == 0
    r = _run("models", "tiny", "--out", ours, "--force", "--seed", "1")
    assert r.exit_code == 0, r.output  # a folder `models tiny` wrote is ours to replace
    assert (ours / "config.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "tiny"]


def test_models_prepare_force_does_not_delete_a_folder_it_did_not_write(tmp_path):
    mine = _foreign_folder(tmp_path)
    _refused(_run("models", "prepare", "--out", mine, "--force"), "refusing to replace", "nothing was deleted")
    assert (mine / "notes.txt").read_text() == "the user's work"  # --force deleted the folder before


# ---- options checked before the model loads, naming the flag


@pytest.mark.parametrize("verb", ["quantize", "calibrate"])
def test_a_bad_channels_value_is_named_before_the_model_loads(verb, tiny_llama_dir, tmp_path, no_model_load):
    _refused(_run(verb, "--model", tiny_llama_dir, "--out", tmp_path / "o", "--channels", "200%"), "--channels '200%'")


def test_quantize_max_length_zero_is_named(tiny_llama_dir, tmp_path, no_model_load):
    # it reached the model and failed inside attention: "cannot reshape tensor of 0 elements"
    _refused(_run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "o", "--max-length", "0"), "--max-length 0")


def test_a_missing_calibration_file_names_the_flag(tiny_llama_dir, tmp_path, no_model_load):
    _refused(_run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "o", "--calib", tmp_path / "none.jsonl"),
             "--calib", "none.jsonl", "does not exist")


def test_calibrate_out_a_folder_is_refused_and_leaves_nothing(tiny_llama_dir, tmp_path, no_model_load):
    d = tmp_path / "ckpt"
    d.mkdir()
    # a traceback (IsADirectoryError on the rename) after the calibration, and a stray ckpt.tmp, before
    _refused(_run("calibrate", "--model", tiny_llama_dir, "--out", d), f"{d} is a folder", "foursight_channels.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and not any(d.iterdir())


def test_rl_out_that_cannot_be_written_is_named_before_the_model_loads(tiny_llama_dir, no_model_load):
    _refused(_run("rl", "--model", tiny_llama_dir, "--steps", "1", "--out", "/proc/foursight-probe/x.jsonl"),
             "--out /proc/foursight-probe/x.jsonl", "cannot write")


def test_rl_bad_channels_is_named(tiny_llama_dir, tmp_path, no_model_load):
    _refused(_run("rl", "--model", tiny_llama_dir, "--steps", "1", "--channels", "abc", "--out", tmp_path / "x.jsonl"),
             "--channels 'abc'")


# ---- compare: no option silently ignored, a bad file named before any quantization


def test_compare_refuses_a_url_for_the_in_process_hf_engine(tiny_llama_dir, tmp_path, no_model_load):
    # it ran the HF engine in process and ignored the URL
    _refused(_run("compare", "--model", tiny_llama_dir, "--engines", "hf:bf16,hf:nvfp4", "--n", "2", "--out", tmp_path / "r",
                  "--engine-url", "hf:bf16=http://127.0.0.1:9"), "--engine-url hf:bf16=http://127.0.0.1:9", "in this process")


def test_compare_refuses_a_url_for_an_engine_it_does_not_run(tiny_llama_dir, tmp_path, no_model_load):
    _refused(_run("compare", "--model", tiny_llama_dir, "--engines", "hf:bf16,hf:nvfp4", "--n", "2", "--out", tmp_path / "r",
                  "--engine-url", "vllm:nvfp4=http://127.0.0.1:9"), "--engine-url vllm:nvfp4", "not an engine of this run")


def test_compare_names_a_missing_prompts_file_before_quantizing(tiny_llama_dir, tmp_path, no_model_load):
    # a bare "[Errno 2] No such file or directory" after quantizing both checkpoints, before
    _refused(_run("compare", "--model", tiny_llama_dir, "--engines", "hf:bf16,hf:nvfp4", "--n", "2", "--out", tmp_path / "r",
                  "--prompts", tmp_path / "none.jsonl"), "--prompts", "none.jsonl: no such file")
    assert not (tmp_path / "r").exists()


def test_compare_checks_the_checkpoints_it_is_given(tiny_llama_dir, tiny_ckpt, tmp_path, no_model_load):
    base = ["compare", "--model", tiny_llama_dir, "--n", "2", "--out", tmp_path / "r"]
    # a BF16 folder as the FourSight checkpoint was served as one
    _refused(_run(*base, "--engines", "hf:bf16,hf:foursight", "--foursight-ckpt", tiny_llama_dir),
             f"--foursight-ckpt {tiny_llama_dir}", "no quantization_config")
    # a checkpoint given for a precision no engine runs was ignored
    _refused(_run(*base, "--engines", "hf:bf16,hf:foursight", "--foursight-ckpt", tiny_ckpt, "--nvfp4-ckpt", tiny_ckpt),
             f"--nvfp4-ckpt {tiny_ckpt}", "no engine of this run has precision nvfp4")
    # a compensated checkpoint as the plain-NVFP4 one
    _refused(_run(*base, "--engines", "hf:bf16,hf:nvfp4", "--nvfp4-ckpt", tiny_ckpt), "--nvfp4-ckpt", "keeps BF16 channels")


# ---- the bridge and import


def test_bridge_hf_model_that_does_not_exist_is_named(tmp_path):
    # a transformers traceback about Hub repo ids, before
    _refused(_run("bridge", "serve", "--engine", "hf", "--model", tmp_path / "none"), f"--model {tmp_path / 'none'}: no such folder")


def test_import_of_a_bf16_folder_says_what_it_is(tiny_llama_dir, tmp_path):
    # "quantization_config.quant_method is None", before
    _refused(_run("import", tiny_llama_dir, "--out", tmp_path / "o"), "no quantization_config", "not a compressed-tensors checkpoint")


# ---- a second round of the same kinds: values the option cannot take


@pytest.mark.parametrize("verb", [("serve", "{model}", "--dry-run"), ("bridge", "serve", "--engine", "hf", "--model", "{model}")])
def test_a_port_outside_the_tcp_range_is_refused(verb, tiny_llama_dir):
    # `serve --dry-run` printed a vLLM command with port 99999, and `bridge serve` reported itself running on it
    args = [a.format(model=tiny_llama_dir) for a in verb]
    r = _run(*args, "--port", "99999")
    assert r.exit_code == 2 and "--port" in r.output, r.output


@pytest.mark.parametrize("flag, value, needle", [
    ("--activations", "fp8", "--activations 'fp8': expected nvfp4 or bf16"),  # named quantization_config.activation_dtype
    ("--activation-scale", "weird", "--activation-scale 'weird'"),
    ("--error-target", "-1", "--error-target must be > 0"),  # accepted: every layer got the largest k
])
def test_quantize_values_outside_their_range_are_named_before_the_model_loads(flag, value, needle, tiny_llama_dir, tmp_path,
                                                                              no_model_load):
    _refused(_run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "o", flag, value), needle)
    assert not (tmp_path / "o").exists()


# ---- round three (issue 38, item 5): `calibrate --out` replaces a file only with --force, and only a channels file


def test_calibrate_refuses_an_existing_file_without_force(tiny_llama_dir, tmp_path, no_model_load):
    # the file was overwritten, whatever it was, before
    f = tmp_path / "notes.json"
    f.write_text('{"my": "notes"}')
    _refused(_run("calibrate", "--model", tiny_llama_dir, "--out", f), f"{f} exists; pass --force")
    _refused(_run("calibrate", "--model", tiny_llama_dir, "--out", f, "--force"), "refusing to replace", "not a channels file")
    assert f.read_text() == '{"my": "notes"}' and sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]


def test_calibrate_force_replaces_a_channels_file(tiny_llama_dir, tmp_path):
    from foursight.channels_file import ChannelsFile

    f = ChannelsFile(channels={"model.layers.0.mlp.down_proj": [3]}, input_amax={"model.layers.0.mlp.down_proj": 1.0}).write(tmp_path / "ch.json")
    _refused(_run("calibrate", "--model", tiny_llama_dir, "--out", f, "--channels", "32"), "exists; pass --force")
    assert ChannelsFile.read(f).channels == {"model.layers.0.mlp.down_proj": [3]}
    r = _run("calibrate", "--model", tiny_llama_dir, "--out", f, "--channels", "32", "--force")
    assert r.exit_code == 0, r.output
    assert {len(v) for v in ChannelsFile.read(f).channels.values()} == {32}


# ---- round four (issue 53, item 0): `quantize --report` follows --out's rules, checked before any work


def test_report_never_overwrites_the_source_model_or_the_new_checkpoint(tiny_llama_dir, tmp_path, no_model_load):
    # d00d877: the model loaded and quantized, then the Markdown table replaced the source's model.safetensors
    # (or the new checkpoint's config.json, so it would not load); --force does not make either allowed
    src = tiny_llama_dir / "model.safetensors"
    before = src.read_bytes()
    out = tmp_path / "ckpt"
    for force in ((), ("--force",)):
        _refused(_run("quantize", "--model", tiny_llama_dir, "--out", out, "--report", src, *force),
                 f"--report {src}", "the model folder being read")
        _refused(_run("quantize", "--model", tiny_llama_dir, "--out", out, "--report", out / "config.json", *force),
                 f"--report {out / 'config.json'}", "inside the checkpoint folder --out")
    assert src.read_bytes() == before and not out.exists()


def test_report_refuses_an_existing_file_a_folder_and_an_unwritable_path_before_the_model_loads(tiny_llama_dir, tmp_path,
                                                                                                no_model_load):
    # d00d877: an existing file was overwritten silently; a folder or an unwritable path failed after the quantization
    notes = tmp_path / "notes.md"
    notes.write_text("the user's notes")
    base = ("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "o")
    _refused(_run(*base, "--report", notes), f"--report {notes} exists; pass --force")
    _refused(_run(*base, "--report", notes, "--force"), f"--report {notes}", "not a layer report")
    assert notes.read_text() == "the user's notes"
    folder = tmp_path / "reports"
    folder.mkdir()
    _refused(_run(*base, "--report", folder), f"--report {folder} is a folder")
    _refused(_run(*base, "--report", "/proc/foursight-probe/r.md"), "--report /proc/foursight-probe/r.md", "cannot write")
    under_a_file = notes / "r.md"
    _refused(_run(*base, "--report", under_a_file), f"--report {under_a_file}", "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md", "reports"]


def test_report_force_replaces_a_layer_report(tiny_llama_dir, tmp_path):
    rep = tmp_path / "layers.md"
    r = _run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "a", "--channels", "16", "--report", rep)
    assert r.exit_code == 0, r.output
    first = rep.read_text()
    assert first.startswith("| layer | K | k |")
    _refused(_run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "b", "--channels", "16", "--report", rep),
             f"--report {rep} exists; pass --force")
    r = _run("quantize", "--model", tiny_llama_dir, "--out", tmp_path / "b", "--channels", "0", "--report", rep, "--force")
    assert r.exit_code == 0, r.output
    assert rep.read_text() != first and "| 0 |" in rep.read_text()


# ---- round four (issue 53, item 9): the lows


def test_a_config_nested_beyond_the_parser_is_named(tmp_path, no_model_load):
    # d00d877: a RecursionError traceback
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    _refused(_run("quantize", "--model", deep, "--out", tmp_path / "o"), "config.json", "nests deeper")


def test_written_folders_get_the_users_umask_not_0700(tmp_path):
    # d00d877: checkpoints and model folders were 0700 (tempfile.mkdtemp's mode, kept through the rename)
    import os
    import stat

    old = os.umask(0o022)
    try:
        r = _run("models", "tiny", "--out", tmp_path / "tiny")
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert stat.S_IMODE((tmp_path / "tiny").stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tiny").iterdir()} == {0o644}
