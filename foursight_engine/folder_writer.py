"""The one folder writer of FourSight: checkpoints (``quantize``, ``import``, ``export``) and the
model folders of ``foursight models`` are written through :func:`folder_writer`.

It writes into a temporary folder beside the destination and renames it at the end, so a failure
never leaves a half-written folder. The temporary folder holds the marker file
:data:`~foursight.schema.INCOMPLETE_MARKER` until it is complete and renamed, so a run killed
outright (no cleanup) leaves a folder that every reader refuses as incomplete
(:func:`foursight.schema.check_complete`), and the next run to the same destination removes it.
``force`` replaces only a folder that is ours (:func:`check_replaceable`): a FourSight checkpoint,
a folder a FourSight writer wrote (:data:`WRITTEN_BY_FILE`), or an incomplete one; anything else
is refused and nothing is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from foursight import schema
from foursight.schema import INCOMPLETE_MARKER, CheckpointError

#: a file each FourSight writer leaves in the folder it wrote (which writer, as JSON): how ``--force``
#: knows a folder without a FourSight ``config.json`` (a compressed-tensors export) is ours
WRITTEN_BY_FILE = ".foursight-written"


def written_by(folder: str | Path) -> str | None:
    """The writer named in ``folder``'s :data:`WRITTEN_BY_FILE` (e.g. ``"foursight export"``), or None."""
    try:
        return json.loads((Path(folder) / WRITTEN_BY_FILE).read_text()).get("written_by")
    except (OSError, ValueError, AttributeError):
        return None


#: the verbs that write checkpoints: each may replace what any of them wrote
CHECKPOINT_VERBS = ("quantize", "import", "export")


def _is_ours(out_dir: Path, verb: str) -> bool:
    if (out_dir / INCOMPLETE_MARKER).exists():
        return True
    w = written_by(out_dir)
    if w is not None:
        wv = w.removeprefix("foursight ")
        return wv == verb or (wv in CHECKPOINT_VERBS and verb in CHECKPOINT_VERBS)
    if verb not in CHECKPOINT_VERBS:
        return False
    try:
        qc = schema.read_config(out_dir).get("quantization_config") or {}
        return qc.get("quant_method") == schema.QUANT_METHOD
    except (CheckpointError, AttributeError):
        return False


def check_replaceable(out_dir: Path, verb: str = "quantize") -> None:
    """``--force`` may replace ``out_dir`` only when it is ours: for a checkpoint writer
    (:data:`CHECKPOINT_VERBS`), a FourSight checkpoint (its config.json names ``quant_method:
    foursight``) or a folder a checkpoint writer wrote (it holds :data:`WRITTEN_BY_FILE`, e.g. a
    compressed-tensors export); for another verb (``models tiny``), a folder that verb wrote; for
    every verb, an incomplete folder (:data:`INCOMPLETE_MARKER`). Anything else (a model folder
    ``models tiny`` made is not a checkpoint ``quantize --force`` may replace) raises
    :class:`FileExistsError` and nothing is deleted."""
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a folder; nothing was deleted")
    if _is_ours(out_dir, verb):
        return
    if verb in CHECKPOINT_VERBS:
        raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a FourSight checkpoint nor a folder a FourSight "
                              f"writer made (no config.json with quantization_config.quant_method = {schema.QUANT_METHOD!r}, "
                              f"no {WRITTEN_BY_FILE} naming quantize, import or export); nothing was deleted, remove it yourself or "
                              "choose another --out")
    raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a folder `foursight {verb}` wrote (no {WRITTEN_BY_FILE} "
                          "naming it); nothing was deleted, remove it yourself or choose another --out")


def remove_interrupted_runs(out_dir: Path) -> list[Path]:
    """Remove what killed writer runs to ``out_dir`` left (folders holding :data:`INCOMPLETE_MARKER`:
    their temporary folders ``<out>.tmp-*``, and ``out_dir`` itself when it is marked); returns them."""
    gone = []
    if out_dir.parent.is_dir():
        for d in [*out_dir.parent.glob(out_dir.name + ".tmp-*"), out_dir]:
            if d.is_dir() and not d.is_symlink() and (d / INCOMPLETE_MARKER).exists():
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
    return gone


def prepare_destination(out_dir: Path, force: bool, source: Path | None = None, verb: str = "quantize") -> None:
    """The checks a writer makes before any slow work: ``out_dir`` must not be the ``source`` it
    reads, nor exist unless ``force`` and ours (:func:`check_replaceable`); leftovers of killed runs
    are removed first."""
    if source is not None and Path(out_dir).resolve() == Path(source).resolve():
        raise FileExistsError(f"--out {out_dir} is the folder being read; write to another folder (nothing was changed)")
    remove_interrupted_runs(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        if not force:
            raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
        check_replaceable(out_dir, verb)


@contextmanager
def folder_writer(out_dir: str | Path, force: bool, verb: str):
    """The one folder writer: yields a temporary folder beside ``out_dir`` to write into.

    The temporary folder holds :data:`INCOMPLETE_MARKER` from the start; when the block ends
    without an error :data:`WRITTEN_BY_FILE` is written (naming ``foursight <verb>``), the folder
    replaces ``out_dir`` (only when ``force`` and :func:`check_replaceable` allow) and the marker is
    removed last. An error removes the temporary folder; a killed run leaves a marked folder that
    every reader refuses and the next run removes (:func:`prepare_destination`).
    """
    out_dir = Path(out_dir)
    prepare_destination(out_dir, force, verb=verb)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        (tmp / INCOMPLETE_MARKER).write_text(f"written by foursight {verb}; removed when the folder is complete\n")
        yield tmp
        (tmp / WRITTEN_BY_FILE).write_text(json.dumps({"written_by": f"foursight {verb}"}) + "\n")
        if out_dir.exists() or out_dir.is_symlink():
            if not force:
                raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
            check_replaceable(out_dir, verb)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out_dir / INCOMPLETE_MARKER).unlink()
