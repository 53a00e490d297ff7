"""Weight uploads: update files a trainer on another host sends the bridge over HTTP, kept so that
nothing can corrupt a file being read, fill the disk, or lose an upload a retry needs (issue 53).

``PUT /v1/weights/uploads/{name}?offset=N`` (routes in :mod:`.routes.weights`) writes one chunk into
``.foursight-uploads/`` of the first ``--weights-dir``; the upload is applied by its name (TRL's
``/update_weights {"upload": name}``, or ``POST /v1/weights`` with the ``path`` its last chunk answered).
:class:`UploadStore` keeps these rules:

* **A private file, renamed when complete.** Chunks go to ``.<name>.<upload_id>.part``, created by this
  upload alone (``O_CREAT | O_EXCL``); the upload is complete when the file holds the size its own
  safetensors header declares, and is then renamed to ``<name>``. A complete upload is never written
  again, so a reader (the bridge's finiteness check, the engine's worker) never maps a file that a
  writer can still truncate or change (before: an ``offset=0`` chunk reopened the applied file with
  ``"wb"`` and the reader died of SIGBUS). A partial upload cannot be applied.
* **One writer per name.** ``offset=0`` starts an upload and answers its ``upload_id``; every later chunk
  must carry it. A second writer gets 409 while the first is open (until it completes, is deleted or
  expires), and while a complete upload of that name waits to be applied or is being applied.
* **Bounds.** One upload may hold ``max_upload_bytes`` (checked from ``Content-Length`` before the body is
  read, and against the size the header declares as soon as the header is in), all uploads together
  ``max_uploads_bytes``; 413 beyond either. The bridge's default per-upload bound is the served
  model's BF16 size plus headers (:func:`foursight.tensor_io.update_bytes`, ``server.create_app``).
* **Expiry.** An upload not written for ``ttl_s`` (a killed trainer's partial one) or complete but not
  applied within ``ttl_s`` is removed (checked at every upload request and apply, and for leftovers
  of an earlier bridge process by their file time).
* **No link is followed.** The folder is opened ``O_DIRECTORY | O_NOFOLLOW`` and every file operation in it
  is relative to that descriptor with ``O_NOFOLLOW`` or ``follow_symlinks=False``: a link planted in the
  folder (or as the folder) is refused, never written through.
* **Removed after success only.** An apply that succeeds removes its upload; a refused one (409, 422,
  5xx) keeps it, so the trainer's retry finds it (TRL's client retries 5xx on POST); ``DELETE`` removes it
  at once (409 while it is being applied).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

#: the folder, inside the first ``--weights-dir``, that uploads are written to
UPLOADS = ".foursight-uploads"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")
_PART = ".part"
#: per-upload bound when the model folder gives no size (no safetensors files there)
FALLBACK_MAX_UPLOAD_BYTES = 256 << 30
DEFAULT_UPLOAD_TTL_S = 900.0


class UploadError(Exception):
    """An upload request the store refuses: the HTTP ``status``, the request ``field`` it names and why;
    ``final`` when the upload can never complete (it is then removed)."""

    def __init__(self, status: int, field: str, message: str, final: bool = False):
        super().__init__(message)
        self.status, self.field, self.message, self.final = status, field, message, final


def valid_name(name: str) -> bool:
    """A plain ``*.safetensors`` name of letters, digits, ``.``, ``_`` and ``-`` (no path, not hidden)."""
    return bool(_NAME.fullmatch(name)) and ".." not in name


@dataclass
class _Open:
    """An upload being written: its writer's id, private file, bytes so far and declared size."""

    id: str
    part: str
    size: int = 0
    expected: int | None = None
    touched: float = field(default_factory=time.monotonic)
    busy: bool = False


class UploadStore:
    """The uploads of one bridge, in ``root/.foursight-uploads`` (the module docstring gives the rules).

    Args:
        root: the first ``--weights-dir`` (resolved).
        max_upload_bytes: the largest upload.
        max_uploads_bytes: all uploads kept (partial and complete) together.
        ttl_s: seconds an upload may go unwritten (partial) or unapplied (complete) before it is removed.
    """

    def __init__(self, root: Path, max_upload_bytes: int, max_uploads_bytes: int, ttl_s: float = DEFAULT_UPLOAD_TTL_S):
        self.root = Path(root)
        self.folder = self.root / UPLOADS
        self.max_upload_bytes, self.max_uploads_bytes, self.ttl_s = int(max_upload_bytes), int(max_uploads_bytes), float(ttl_s)
        self._open: dict[str, _Open] = {}
        self._applying: set[str] = set()

    # ---- the folder, never through a link

    @contextmanager
    def _dir(self) -> Iterator[int]:
        """A descriptor of the upload folder (made 0700 when missing); a link in its place is refused."""
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                os.mkdir(UPLOADS, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            try:
                fd = os.open(UPLOADS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root)
            except OSError:
                raise UploadError(409, "name", f"the upload folder {self.folder} is not a folder (a link?): uploads are "
                                               "refused until it is one") from None
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _lstat(dfd: int, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    @staticmethod
    def _unlink(dfd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass

    # ---- expiry and the total

    def sweep(self) -> None:
        """Remove expired uploads: open ones not written for ``ttl_s``, complete ones older than ``ttl_s``
        (not while being applied), and ``.part`` files no writer of this process holds, older than ``ttl_s``."""
        now, wall = time.monotonic(), time.time()
        with self._dir() as dfd:
            for name, up in list(self._open.items()):
                if not up.busy and now - up.touched > self.ttl_s:
                    self._unlink(dfd, up.part)
                    del self._open[name]
            held = {up.part for up in self._open.values()}
            for entry in os.listdir(dfd):
                st = self._lstat(dfd, entry)
                if st is None or entry in held or entry.removesuffix(_PART) in self._applying:
                    continue
                if wall - st.st_mtime > self.ttl_s and (entry.endswith(_PART) or valid_name(entry) or stat.S_ISLNK(st.st_mode)):
                    self._unlink(dfd, entry)

    def _kept_bytes(self, dfd: int) -> int:
        total = sum(up.size for up in self._open.values())
        held = {up.part for up in self._open.values()}
        for entry in os.listdir(dfd):
            st = self._lstat(dfd, entry)
            if st is not None and entry not in held and stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total

    # ---- writing

    def begin(self, name: str, offset: int, upload_id: str | None, length: int | None) -> _Open:
        """Check one chunk before its body is read and reserve the upload for it (``busy``); returns the
        open upload. Refusals are :class:`UploadError` (409 another writer or a complete upload of that name,
        422 a wrong offset or id, 413 a bound)."""
        if not valid_name(name):
            raise UploadError(422, "name", "a name of letters, digits, '.', '_' and '-' ending in .safetensors")
        self.sweep()
        with self._dir() as dfd:
            up = self._open.get(name)
            if offset == 0:
                if up is not None:
                    raise UploadError(409, "name", f"upload {name} is being written by another writer (upload_id given at its "
                                                   f"offset 0); it expires after {self.ttl_s:g} s without a chunk, or DELETE it")
                if name in self._applying or self._lstat(dfd, name) is not None:
                    raise UploadError(409, "name", f"upload {name} exists (complete, being or not yet applied): apply it, "
                                                   "DELETE it, or use another name")
            else:
                if up is None:
                    done = self._lstat(dfd, name) is not None
                    raise UploadError(409 if done else 422, "offset",
                                      f"upload {name} is complete; it takes no more chunks" if done else
                                      f"no upload {name} is being written: start it at offset 0")
                if upload_id is None or not secrets.compare_digest(upload_id.encode(), up.id.encode()):
                    raise UploadError(409, "upload_id", f"upload {name} is being written by another writer: a chunk at an "
                                                        "offset > 0 must carry the upload_id its offset 0 answered")
                if up.busy:
                    raise UploadError(409, "offset", f"a chunk of upload {name} is being written; send the next one after it")
                if offset != up.size:
                    raise UploadError(422, "offset", f"must be the uploaded size {up.size} (or 0 for a new upload)")
            if length is not None:
                self._check_bounds(dfd, name, offset + length, length)
            if up is None:
                up = _Open(id=secrets.token_hex(16), part=f".{name}.{secrets.token_hex(8)}{_PART}")
                fd = os.open(up.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                os.close(fd)
                self._open[name] = up
            up.busy, up.touched = True, time.monotonic()
            return up

    def _check_bounds(self, dfd: int, name: str, end: int, length: int) -> None:
        if end > self.max_upload_bytes:
            raise UploadError(413, "body", f"upload {name} would hold {end} bytes, more than the bridge takes in one upload "
                                           f"({self.max_upload_bytes}: --max-upload-bytes, by default the model's BF16 size "
                                           "plus headers)", final=True)
        kept = self._kept_bytes(dfd)
        if kept + length > self.max_uploads_bytes:
            raise UploadError(413, "body", f"the uploads kept hold {kept} bytes; {length} more would pass the bridge's bound "
                                           f"{self.max_uploads_bytes} (--max-uploads-bytes); apply or DELETE uploads first")

    def write(self, name: str, up: _Open, offset: int, data: bytes) -> dict:
        """Write a chunk :meth:`begin` reserved (in a worker thread); when the upload reaches the size its
        header declares, rename it to its name. Returns the route's answer. A body that breaks a bound or is
        not a safetensors file is an :class:`UploadError` (the upload is removed when it can never complete)."""
        try:
            with self._dir() as dfd:
                if up.size == 0 and offset == 0 and not data:
                    return self._answer(name, up)
                self._check_bounds(dfd, name, offset + len(data), len(data))
                if up.expected is not None and offset + len(data) > up.expected:
                    raise UploadError(422, "body", f"the chunk ends at byte {offset + len(data)}, beyond the {up.expected} bytes "
                                                   f"upload {name}'s safetensors header declares", final=True)
                fd = os.open(up.part, os.O_RDWR | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    os.pwrite(fd, data, offset)
                    up.size = offset + len(data)
                    if up.expected is None:
                        up.expected = self._declared_size(fd, name, up.size)
                    if up.expected is not None and up.size > up.expected:
                        raise UploadError(422, "body", f"upload {name} holds {up.size} bytes, beyond the {up.expected} its "
                                                       "safetensors header declares", final=True)
                    if up.expected is not None and up.size == up.expected:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                if up.expected is not None and up.size == up.expected:
                    os.rename(up.part, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    del self._open[name]
                    return {**self._answer(name, up), "complete": True, "path": str(self.folder / name)}
                return self._answer(name, up)
        except UploadError as e:
            if e.final:
                self.discard(name)  # it can never become a complete upload
            raise
        finally:
            up.busy, up.touched = False, time.monotonic()

    @staticmethod
    def _answer(name: str, up: _Open) -> dict:
        return {"name": name, "upload_id": up.id, "size": up.size, "expected_size": up.expected, "complete": False}

    def _declared_size(self, fd: int, name: str, size: int) -> int | None:
        """The file size ``name``'s safetensors header declares (8-byte length, the JSON header, the data it
        indexes), once that much of the file is in; None before. Bounded as an upload is."""
        if size < 8:
            return None
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if 8 + n > self.max_upload_bytes:
            raise UploadError(413, "body", f"upload {name}'s safetensors header claims {n} bytes, more than the bridge takes in "
                                           f"one upload ({self.max_upload_bytes})", final=True)
        if size < 8 + n:
            return None
        try:
            header = json.loads(os.pread(fd, n, 8))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise UploadError(422, "body", f"upload {name} is not a safetensors file: its header does not parse "
                                           f"({type(e).__name__}: {e})", final=True) from None
        declared = 8 + n + max(ends, default=0)
        if declared > self.max_upload_bytes:
            raise UploadError(413, "body", f"upload {name}'s safetensors header declares {declared} bytes, more than the bridge "
                                           f"takes in one upload ({self.max_upload_bytes}: --max-upload-bytes)", final=True)
        return declared

    # ---- applying and removing

    def complete_path(self, name: str) -> Path:
        """The path of the complete upload ``name`` (a regular file, not a link), for an apply; 422 otherwise."""
        if not valid_name(name):
            raise UploadError(422, "upload", "not an upload name")
        self.sweep()
        up = self._open.get(name)
        if up is not None:
            raise UploadError(422, "upload", f"upload {name} is incomplete: {up.size} of "
                                             f"{up.expected if up.expected is not None else 'an unknown number of'} bytes")
        with self._dir() as dfd:
            st = self._lstat(dfd, name)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise UploadError(422, "upload", "not an upload of this bridge (PUT /v1/weights/uploads/{name} first)")
        return self.folder / name

    def upload_of(self, path: Path) -> str | None:
        """The upload name a resolved update ``path`` is (None: not in the upload folder). A path in the
        folder that is not a complete upload (the folder itself, a ``.part`` file) is a 422."""
        if path != self.folder and self.folder not in path.parents:
            return None
        if path.parent != self.folder:
            raise UploadError(422, "path", "not a complete upload")
        self.complete_path(path.name)
        return path.name

    def claim(self, name: str) -> None:
        """Hold upload ``name`` while it is checked and applied: a new upload of that name, DELETE and a second
        apply of it get 409 until :meth:`release`."""
        if name in self._applying:
            raise UploadError(409, "upload", f"upload {name} is being applied by another request")
        self._applying.add(name)

    def release(self, name: str, applied: bool) -> None:
        """End :meth:`claim`; an ``applied`` upload is removed, a refused one kept for a retry (until DELETE or expiry)."""
        self._applying.discard(name)
        if applied:
            self.discard(name)

    def discard(self, name: str) -> bool:
        """Remove upload ``name``, open or complete; False when there was none."""
        gone = False
        with self._dir() as dfd:
            up = self._open.pop(name, None)
            if up is not None:
                self._unlink(dfd, up.part)
                gone = True
            if self._lstat(dfd, name) is not None:
                self._unlink(dfd, name)
                gone = True
        return gone

    def delete(self, name: str) -> bool:
        """``DELETE``: :meth:`discard`, refused (409) while the upload is being applied or a chunk written."""
        if not valid_name(name):
            raise UploadError(422, "name", "not an upload name")
        if name in self._applying:
            raise UploadError(409, "name", f"upload {name} is being applied")
        up = self._open.get(name)
        if up is not None and up.busy:
            raise UploadError(409, "name", f"a chunk of upload {name} is being written")
        return self.discard(name)
