"""The one checkpoint folder writer (foursight.folder_writer.folder_writer) behind ``quantize``,
``import`` and ``export``: ``--force`` replaces only what FourSight wrote, a killed run leaves a
marked folder that every reader refuses naming the marker, and the next run removes it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from foursight.checkpoint import quantize_model
from foursight.folder_writer import WRITTEN_BY_FILE
from foursight.cli import app
from foursight.schema import INCOMPLETE_MARKER, CheckpointError

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def fs0(tiny_llama_dir, tmp_path_factory) -> Path:
    """A plain-NVFP4 (k = 0) FourSight checkpoint of the tiny Llama, static scales (exportable)."""
    return quantize_model(tiny_llama_dir, tmp_path_factory.mktemp("fw") / "fs0", channels=0, activation_scale="static",
                          progress=False).out_dir


@pytest.fixture(scope="module")
def ct(fs0, tmp_path_factory) -> Path:
    r = CliRunner().invoke(app, ["export", str(fs0), "--out", str(tmp_path_factory.mktemp("fw-ct") / "ct")])
    assert r.exit_code == 0, r.output
    return Path(" ".join(r.output.split()).split("wrote ")[-1].strip())


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _precious(tmp_path: Path) -> Path:
    d = tmp_path / "precious"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))  # a plain model folder, not ours
    return d


@pytest.mark.parametrize("verb", ["import", "export"])
def test_force_refuses_to_replace_a_folder_that_is_not_ours(verb, fs0, ct, tmp_path):
    """`foursight import --force` / `export --force` onto a folder FourSight did not write: refused,
    nothing deleted (before: the folder was deleted and replaced)."""
    d = _precious(tmp_path)
    src = ct if verb == "import" else fs0
    r = _cli(verb, str(src), "--out", str(d), "--force")
    assert r.exit_code == 2, r.output
    assert "not a FourSight checkpoint nor a folder a FourSight writer made" in " ".join(r.output.split()) and "nothing was deleted" in " ".join(r.output.split())
    assert (d / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "thesis.tex"]


@pytest.mark.parametrize("verb", ["import", "export"])
def test_force_replaces_what_the_same_verb_wrote(verb, fs0, ct, tmp_path):
    """Ours is replaceable: a second run with --force over the first one's output succeeds, and the
    folder carries the writer's note (what --force recognizes) and no marker."""
    src = ct if verb == "import" else fs0
    out = tmp_path / "out"
    for _ in range(2):
        r = _cli(verb, str(src), "--out", str(out), "--force")
        assert r.exit_code == 0, r.output
    assert json.loads((out / WRITTEN_BY_FILE).read_text()) == {"written_by": f"foursight {verb}"}
    assert not (out / INCOMPLETE_MARKER).exists()
    assert _cli("inspect", str(out)).exit_code == 0
    r = _cli(verb, str(src), "--out", str(out))
    assert r.exit_code == 2 and "pass --force" in r.output


# the writer is killed (os._exit: no cleanup runs, as with SIGKILL) while copying the tokenizer files,
# after the tensors and config.json are written
_KILL = ("import os, shutil\n"
         "real = shutil.copy2\n"
         "def copy2(src, dst, *a, **k):\n"
         "    if 'tokenizer' in str(src):\n"
         "        open(dst, 'w').write('{\"trunc')\n"
         "        os._exit(9)\n"
         "    return real(src, dst, *a, **k)\n"
         "shutil.copy2 = copy2\n")


@pytest.mark.parametrize("verb", ["import", "export"])
def test_killed_writer_leaves_a_marked_folder_every_reader_refuses_and_a_rerun_removes(verb, fs0, ct, tmp_path):
    """A killed `import` / `export` leaves only a marked temporary folder (before: an unmarked,
    half-written folder with a truncated tokenizer that `inspect` called valid); `inspect`, the
    reference loader and transformers refuse it naming the marker; the next run removes it."""
    from transformers import AutoModelForCausalLM

    import foursight  # noqa: F401  (registers the transformers quantizer)
    from foursight.hf import load_reference_model

    src = ct if verb == "import" else fs0
    out = tmp_path / "out"
    fn = "import_compressed_tensors" if verb == "import" else "export_compressed_tensors"
    script = _KILL + f"from foursight.interop import {fn}\n{fn}({str(src)!r}, {str(out)!r})\n"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert p.returncode == 9, p.stderr[-2000:]
    assert not out.exists()
    (left,) = list(tmp_path.glob("out.tmp-*"))
    assert (left / INCOMPLETE_MARKER).exists() and (left / "config.json").exists()
    r = _cli("inspect", str(left))
    assert r.exit_code == 2 and INCOMPLETE_MARKER in " ".join(r.output.split()), r.output
    if verb == "import":  # a FourSight folder: the reference loader and transformers refuse it too
        with pytest.raises(CheckpointError, match=INCOMPLETE_MARKER):
            load_reference_model(left)
        with pytest.raises(CheckpointError, match=INCOMPLETE_MARKER):
            AutoModelForCausalLM.from_pretrained(left)
    r = _cli(verb, str(src), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert list(tmp_path.glob("out.tmp-*")) == [] and not (out / INCOMPLETE_MARKER).exists()
    assert _cli("inspect", str(out)).exit_code == 0


def test_a_marked_destination_is_refused_by_readers_and_removed_by_the_next_run(fs0, tmp_path):
    """A writer killed between its rename and the marker's removal leaves the destination itself
    marked: readers refuse it, the next run (no --force needed: it is an incomplete run of ours) replaces it."""
    import shutil

    out = tmp_path / "ck"
    shutil.copytree(fs0, out)
    (out / INCOMPLETE_MARKER).write_text("killed")
    r = _cli("inspect", str(out))
    assert r.exit_code == 2 and INCOMPLETE_MARKER in " ".join(r.output.split())
    r = _cli("export", str(fs0), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert not (out / INCOMPLETE_MARKER).exists() and (out / WRITTEN_BY_FILE).exists()


@pytest.mark.parametrize("verb", ["import", "export"])
def test_out_equal_to_the_source_is_refused_and_the_source_kept(verb, fs0, ct, tmp_path):
    """(probe) `export CK --out CK --force` replaced the checkpoint it read by its export; now refused
    before anything is written, the source unchanged."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ct if verb == "import" else fs0, src)
    before = sorted(p.name for p in src.iterdir())
    r = _cli(verb, str(src), "--out", str(src), "--force")
    assert r.exit_code == 2 and "is the folder being read" in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in src.iterdir()) == before


def test_inspect_says_what_a_folder_is_not(tiny_llama_dir, tmp_path):
    """(probe) a path that does not exist was "no config.json"; a BF16 model "no quantization_config object"."""
    r = _cli("inspect", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "does not exist" in r.output
    r = _cli("inspect", str(tiny_llama_dir))
    assert r.exit_code == 2 and "is not a quantized checkpoint" in " ".join(r.output.split()) and "foursight quantize" in " ".join(r.output.split())
