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
from foursight.quantize_config import QuantizeConfig
from foursight.folder_writer import WRITTEN_BY_FILE
from foursight.cli import app
from foursight.schema import INCOMPLETE_MARKER, CheckpointError

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def fs0(tiny_llama_dir, tmp_path_factory) -> Path:
    """A plain-NVFP4 (k = 0) FourSight checkpoint of the tiny Llama, static scales (exportable)."""
    return quantize_model(tiny_llama_dir, tmp_path_factory.mktemp("fw") / "fs0", QuantizeConfig(channels=0, activation_scale="static"), progress=False).out_dir


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
    written = json.loads((out / WRITTEN_BY_FILE).read_text())
    assert written["written_by"] == f"foursight {verb}"
    assert sorted(written["files"]) == sorted(p.name for p in out.iterdir() if p.name != WRITTEN_BY_FILE)  # what it wrote
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


# ---- round three (issue 38, item 5): `--out` resolved first, never a glob; --force keeps the user's files; a marker
# alone is not ours; a second run leaves a live run's temporary folder alone. Each failed on ee7c2bc.


def test_out_through_dotdot_replaces_the_folder_it_names(fs0, tmp_path):
    """`export --force --out CK/sub/..` replaces CK (before: the temporary folder went into CK/sub, inside the folder
    being replaced, so the replacement deleted it with CK and nothing was written)."""
    ck = tmp_path / "ck"
    assert _cli("export", str(fs0), "--out", str(ck)).exit_code == 0
    r = _cli("export", str(fs0), "--out", f"{ck}/sub/..", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and not (ck / "sub").exists()
    assert _cli("inspect", str(ck)).exit_code == 0


def test_out_with_glob_characters_is_a_plain_name(fs0, tmp_path):
    """`--out 'run[1]'` writes a folder named `run[1]` and touches nothing of `run1` (before: `run[1].tmp-*` was used
    as a glob, and removed the marked temporary folder of a run to `run1`)."""
    other = tmp_path / "run1.tmp-abcd1234"
    other.mkdir()
    (other / INCOMPLETE_MARKER).write_text("a run to run1")
    (other / "model.safetensors").write_text("its work")
    r = _cli("export", str(fs0), "--out", str(tmp_path / "run[1]"))
    assert r.exit_code == 0, r.output
    assert (other / "model.safetensors").read_text() == "its work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run1.tmp-abcd1234", "run[1]"]
    assert _cli("inspect", str(tmp_path / "run[1]")).exit_code == 0


@pytest.mark.parametrize("verb", ["import", "export"])
def test_force_refuses_a_folder_of_ours_holding_the_users_files_naming_them(verb, fs0, ct, tmp_path):
    """A folder FourSight wrote, to which the user added files: `--force` names them and deletes nothing (before:
    the folder was replaced and the user's files were gone)."""
    src = ct if verb == "import" else fs0
    out = tmp_path / "out"
    assert _cli(verb, str(src), "--out", str(out)).exit_code == 0
    (out / "notes.md").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    r = _cli(verb, str(src), "--out", str(out), "--force")
    msg = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "notes.md" in msg and "eval/scores.json" in msg and "nothing was deleted" in msg, msg
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / "notes.md").read_text() == "my notes"


@pytest.mark.parametrize("verb", ["export", "models tiny"])
def test_a_stray_marker_does_not_make_a_folder_ours(verb, fs0, tmp_path):
    """A user's folder that happens to hold `.foursight-incomplete`: refused without --force and with it, nothing
    deleted (before: the marker made it "an interrupted run of ours", removed without --force)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    (mine / INCOMPLETE_MARKER).write_text("copied from somewhere")
    args = ["export", str(fs0)] if verb == "export" else ["models", "tiny"]
    r = _cli(*args, "--out", str(mine))
    assert r.exit_code == 2 and "pass --force" in r.output, r.output
    r = _cli(*args, "--out", str(mine), "--force")
    assert r.exit_code == 2 and "refusing to replace" in " ".join(r.output.split()), r.output
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in mine.iterdir()) == [INCOMPLETE_MARKER, "thesis.tex"]


# the first run stops while copying the tokenizer (its temporary folder holds the tensors and config.json) until
# the test lets it go on
_PAUSE = ("import os, shutil, sys, time\n"
          "real = shutil.copy2\n"
          "def copy2(src, dst, *a, **k):\n"
          "    if 'tokenizer' in str(src) and not os.path.exists({go!r}):\n"
          "        open({ready!r}, 'w').close()\n"
          "        while not os.path.exists({go!r}):\n"
          "            time.sleep(0.05)\n"
          "    return real(src, dst, *a, **k)\n"
          "shutil.copy2 = copy2\n"
          "from foursight.cli import app\n"
          "sys.argv = ['foursight', 'export', {src!r}, '--out', {out!r}]\n"
          "app()\n")


def test_a_second_run_leaves_a_live_runs_temporary_folder_alone(fs0, tmp_path):
    """Two `export` runs to one --out: the second does not remove the first's temporary folder while the first is
    still writing (before: it removed every marked `<out>.tmp-*`, and the first run failed); the first then finds the
    second's folder and refuses to replace it without --force."""
    import time

    out, ready, go = tmp_path / "out", tmp_path / "ready", tmp_path / "go"
    script = _PAUSE.format(go=str(go), ready=str(ready), src=str(fs0), out=str(out))
    first = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**__import__("os").environ, "COLUMNS": "200"})
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert first.poll() is None and time.monotonic() - t0 < 120, first.stdout.read() if first.stdout else ""
            time.sleep(0.1)
        (live,) = list(tmp_path.glob("out.tmp-*"))
        r = _cli("export", str(fs0), "--out", str(out))
        assert r.exit_code == 0, r.output
        assert live.is_dir() and (live / "config.json").exists(), "the second run removed the live run's temporary folder"
        go.write_text("")
        output = first.communicate(timeout=120)[0]
    finally:
        go.write_text("")
        if first.poll() is None:
            first.kill()
    assert first.returncode == 2 and "exists; pass --force" in " ".join(output.split()), output
    assert list(tmp_path.glob("out.tmp-*")) == [] and _cli("inspect", str(out)).exit_code == 0
