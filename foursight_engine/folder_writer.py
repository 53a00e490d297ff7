"""The one folder writer of FourSight: checkpoints (``quantize``, ``import``, ``export``) and the
model folders of ``foursight models`` are written through :func:`folder_writer`.

* ``--out`` is resolved before anything else (:func:`resolve_out`: ``CK/sub/..`` is ``CK``) and
  is a name, never a pattern.
* The writer fills a temporary folder ``<out>.tmp-XXXXXXXX`` beside the resolved destination and
  renames it at the end, so a failure never leaves a half-written folder. The temporary folder holds
  the marker :data:`~foursight.schema.INCOMPLETE_MARKER` until it is complete and renamed: a run
  killed outright (no cleanup) leaves a folder every reader refuses
  (:func:`foursight.schema.check_complete`), and the next run to the same destination removes it.
* A live run holds an exclusive ``flock`` on its marker for as long as it runs; the lock dies with
  the process, so the next run removes only the temporary folders of dead runs, never a concurrent
  run's work.
* At the end the writer records what it made in :data:`WRITTEN_BY_FILE` (the verb and the list of
  its files). ``force`` replaces only a folder that is ours (:func:`check_replaceable`): one a
  FourSight writer made (or a FourSight checkpoint), holding nothing the writer did not write; a
  folder holding the user's files is refused naming them, anything else is refused, and in either
  case nothing is deleted. The marker alone never makes a folder ours.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from foursight import schema
from foursight.schema import INCOMPLETE_MARKER, CheckpointError

#: a file each FourSight writer leaves in the folder it wrote, as JSON: ``written_by`` (``"foursight <verb>"``)
#: and ``files`` (every path it wrote, relative): how ``--force`` knows a folder is ours and what in it is not
WRITTEN_BY_FILE = ".foursight-written"
#: the temporary folder of a run to ``<out>`` is ``<out>`` + this + the 8 characters ``tempfile.mkdtemp`` adds
TMP_INFIX = ".tmp-"
_TMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")
#: the marker is created under this name, locked, then renamed: a marker another run sees is already locked
_PENDING_MARKER = INCOMPLETE_MARKER + ".new"

#: the verbs that write checkpoints: each may replace what any of them wrote
CHECKPOINT_VERBS = ("quantize", "import", "export")


def umask_mode(mode: int) -> int:
    """``mode`` less this process's umask: what ``mkdir``/``open`` would give (a writer's temporary folder or file,
    made private by ``tempfile``, gets it before it is renamed into place; issue 53: checkpoints were 0700/0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def _user_modes(folder: Path) -> None:
    """Every folder and regular file under ``folder`` gets the mode ``mkdir``/``open`` would give it (:func:`umask_mode`):
    some writers make their files private (transformers' safetensors shards were 0600), the folder is the user's."""
    for root, dirs, names in os.walk(folder):
        for n in dirs:
            if not os.path.islink(os.path.join(root, n)):
                os.chmod(os.path.join(root, n), umask_mode(0o777))
        for n in names:
            f = os.path.join(root, n)
            if not os.path.islink(f):
                os.chmod(f, umask_mode(0o666))


def resolve_out(out: str | Path) -> Path:
    """``--out`` as every writer uses it, resolved before anything else: an absolute path with its
    parent's ``..`` and symlinks resolved (``CK/sub/..`` is ``CK``, whether ``sub`` exists or not).
    A symlink in the last place is kept as the link (a writer refuses it, never follows it)."""
    p = Path(out)
    return p.resolve() if p.name in ("", "..") else p.parent.resolve() / p.name


def _record(folder: Path) -> dict:
    try:
        rec = json.loads((folder / WRITTEN_BY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def written_by(folder: str | Path) -> str | None:
    """The writer named in ``folder``'s :data:`WRITTEN_BY_FILE` (e.g. ``"foursight export"``), or None."""
    w = _record(Path(folder)).get("written_by")
    return w if isinstance(w, str) else None


def _written_files(folder: Path) -> set[str] | None:
    """The paths the writer recorded in ``folder``'s :data:`WRITTEN_BY_FILE` (None when it recorded none:
    a folder of an older FourSight)."""
    files = _record(folder).get("files")
    return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


def listing(folder: Path) -> set[str]:
    """Every path under ``folder`` (files, folders and links, relative; links not followed), less the
    marker and :data:`WRITTEN_BY_FILE`."""
    out = set()
    for root, dirs, files in os.walk(folder):
        out.update(os.path.relpath(os.path.join(root, n), folder) for n in (*dirs, *files))
    return out - {INCOMPLETE_MARKER, _PENDING_MARKER, WRITTEN_BY_FILE}


def _is_ours(out_dir: Path, verb: str) -> bool:
    """Whether ``verb`` may replace ``out_dir``: a folder a FourSight writer made (:data:`WRITTEN_BY_FILE`
    naming this verb, or any checkpoint verb when ``verb`` is one), or for a checkpoint verb a FourSight
    checkpoint (its config.json names ``quant_method: foursight``). The marker plays no part."""
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


def _users_files(out_dir: Path, new_files: set[str] | None) -> list[str]:
    """What in ``out_dir`` its writer did not write: not in its :data:`WRITTEN_BY_FILE` list, or, for a
    folder without one, not among ``new_files`` (what this run writes); [] when neither is known."""
    known = _written_files(out_dir)
    if known is None:
        known = new_files
    return [] if known is None else sorted(listing(out_dir) - known)


def check_replaceable(out_dir: Path, verb: str = "quantize", new_files: set[str] | None = None) -> None:
    """``--force`` may replace ``out_dir`` only when it is ours and holds nothing else: for a checkpoint
    writer (:data:`CHECKPOINT_VERBS`), a FourSight checkpoint or a folder a checkpoint writer wrote (it
    holds :data:`WRITTEN_BY_FILE`, e.g. a compressed-tensors export); for another verb (``models tiny``),
    a folder that verb wrote. A folder holding files its writer did not write (the user's) is refused
    naming them; anything else (a model folder ``models tiny`` made is not a checkpoint ``quantize --force``
    may replace) is refused too. Refusals raise :class:`FileExistsError`, and nothing is deleted."""
    if out_dir.is_symlink() or not out_dir.is_dir():
        raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a folder; nothing was deleted")
    if not _is_ours(out_dir, verb):
        if verb in CHECKPOINT_VERBS:
            raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a FourSight checkpoint nor a folder a "
                                  f"FourSight writer made (no config.json with quantization_config.quant_method = "
                                  f"{schema.QUANT_METHOD!r}, no {WRITTEN_BY_FILE} naming quantize, import or export); nothing was "
                                  "deleted, remove it yourself or choose another --out")
        raise FileExistsError(f"refusing to replace {out_dir} with --force: it is not a folder `foursight {verb}` wrote (no "
                              f"{WRITTEN_BY_FILE} naming it); nothing was deleted, remove it yourself or choose another --out")
    extra = _users_files(out_dir, new_files)
    if extra:
        shown = ", ".join(extra[:10]) + (f" and {len(extra) - 10} more" if len(extra) > 10 else "")
        raise FileExistsError(f"refusing to replace {out_dir} with --force: it holds what FourSight did not write there: {shown}; "
                              "nothing was deleted, move them out of it or choose another --out")


def _claim_if_dead(folder: Path) -> int | None:
    """A descriptor holding the lock of ``folder``'s marker when no live run holds it (the run that made
    it is dead); None when a live run holds it or there is no marker."""
    for name in (INCOMPLETE_MARKER, _PENDING_MARKER):
        try:
            fd = os.open(folder / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd
    return None


def _remove_if_dead(folder: Path) -> bool:
    fd = _claim_if_dead(folder)
    if fd is None:
        return False
    try:
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def remove_interrupted_runs(out_dir: Path, verb: str = "quantize") -> list[Path]:
    """Remove what killed writer runs to the resolved ``out_dir`` left, and only that: its temporary
    folders ``<out>.tmp-XXXXXXXX`` (the name taken literally, never as a pattern) whose marker no live run
    holds, and ``out_dir`` itself when a ``verb`` run was killed between its rename and clearing the marker
    (marked, ours by :data:`WRITTEN_BY_FILE`, holding nothing else). Returns what was removed."""
    gone = []
    prefix = out_dir.name + TMP_INFIX
    try:
        names = os.listdir(out_dir.parent)
    except OSError:
        names = []
    for n in names:
        d = out_dir.parent / n
        if (n.startswith(prefix) and _TMP_SUFFIX.fullmatch(n[len(prefix):]) and d.is_dir() and not d.is_symlink()
                and _remove_if_dead(d)):
            gone.append(d)
    if (out_dir.is_dir() and not out_dir.is_symlink() and (out_dir / INCOMPLETE_MARKER).exists()
            and _written_files(out_dir) is not None and _is_ours(out_dir, verb) and not _users_files(out_dir, None)
            and _remove_if_dead(out_dir)):
        gone.append(out_dir)
    return gone


def prepare_destination(out_dir: str | Path, force: bool, source: str | Path | None = None, verb: str = "quantize") -> Path:
    """The checks a writer makes before any slow work; returns the resolved destination (:func:`resolve_out`).

    ``out_dir`` must not be the ``source`` it reads nor hold it, nor exist unless ``force`` and ours
    (:func:`check_replaceable`); leftovers of killed runs are removed first (:func:`remove_interrupted_runs`)."""
    out_dir = resolve_out(out_dir)
    if source is not None:
        src = Path(source).resolve()
        if out_dir == src or out_dir in src.parents:
            what = "is the folder being read" if out_dir == src else f"holds the folder being read, {src}"
            raise FileExistsError(f"--out {out_dir} {what}; write to another folder (nothing was changed)")
    remove_interrupted_runs(out_dir, verb)
    if out_dir.exists() or out_dir.is_symlink():
        if not force:
            raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
        check_replaceable(out_dir, verb)
    return out_dir


def _mark(tmp: Path, verb: str) -> int:
    """Put the locked marker in ``tmp``; returns the descriptor that holds its lock until the run ends."""
    pending = tmp / _PENDING_MARKER
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # a filesystem without flock: the run is written, and its leftovers are never taken for a dead run's
        pass
    os.write(fd, f"written by foursight {verb} (pid {os.getpid()}); removed when the folder is complete\n".encode())
    os.replace(pending, tmp / INCOMPLETE_MARKER)
    return fd


@contextmanager
def folder_writer(out_dir: str | Path, force: bool, verb: str):
    """The one folder writer: yields a temporary folder beside the resolved ``out_dir`` to write into.

    The temporary folder holds the locked :data:`INCOMPLETE_MARKER` from the start; when the block ends
    without an error :data:`WRITTEN_BY_FILE` is written (``foursight <verb>`` and the files written), the
    folder replaces ``out_dir`` (only when ``force`` and :func:`check_replaceable` allow) and the marker is
    removed last. An error removes the temporary folder; a killed run leaves a marked folder that every
    reader refuses and the next run removes (:func:`prepare_destination`).
    """
    out_dir = prepare_destination(out_dir, force, verb=verb)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + TMP_INFIX, dir=out_dir.parent))
    lock = None
    try:
        os.chmod(tmp, umask_mode(0o777))  # mkdtemp makes it 0700; the folder it becomes is the user's, as mkdir would make it
        lock = _mark(tmp, verb)
        yield tmp
        files = listing(tmp)
        (tmp / WRITTEN_BY_FILE).write_text(json.dumps({"written_by": f"foursight {verb}", "files": sorted(files)}) + "\n")
        _user_modes(tmp)
        if out_dir.exists() or out_dir.is_symlink():
            if not force:
                raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
            check_replaceable(out_dir, verb, new_files=files)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if lock is not None:
            os.close(lock)
        raise
    (out_dir / INCOMPLETE_MARKER).unlink()
    os.close(lock)
