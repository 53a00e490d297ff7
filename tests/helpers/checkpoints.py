"""The tiny FourSight checkpoints the tests share, and copies of a folder with some tensors changed.

:class:`TinyCheckpoints` is the one builder: ``foursight.checkpoint.quantize_model`` on a tiny model
folder, written once per (model, options) in a session (the ``quantize_tiny`` fixture of
tests/conftest.py; ``tiny_ckpt`` and ``tiny_qwen2_ckpt`` are its two common cases).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable


class TinyCheckpoints:
    """FourSight checkpoints of tiny model folders, each written once (cached by folder and options)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._done: dict[tuple, Any] = {}

    def __call__(self, model_dir: Path, channels: str | int = "16", **options: Any):
        """``quantize_model(model_dir, ..., QuantizeConfig(channels=channels, **options))``: its ``QuantizeResult``
        (``.out_dir`` is the checkpoint folder)."""
        from foursight.checkpoint import quantize_model
        from foursight.quantize_config import QuantizeConfig

        key = (str(model_dir), str(channels), tuple(sorted((k, str(v)) for k, v in options.items())))
        if key not in self._done:
            out = self.root / f"ckpt-{len(self._done)}"
            self._done[key] = quantize_model(model_dir, out, QuantizeConfig(channels=channels, **options), progress=False)
        return self._done[key]


def copy_folder(src: Path, dst: Path) -> Path:
    """A copy of model or checkpoint folder ``src`` at ``dst`` (to edit without touching a shared fixture)."""
    return Path(shutil.copytree(src, dst))


def edit_tensors(folder: Path, fn: Callable[[dict], Any]) -> None:
    """Apply ``fn`` to the tensors of ``folder/model.safetensors`` (a dict it edits in place) and write them back."""
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    fn(t)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edited_copy(src: Path, dst: Path, fn: Callable[[dict], Any]) -> Path:
    """A copy of ``src`` at ``dst`` whose tensors ``fn`` edited (:func:`edit_tensors`): a broken checkpoint, a new policy."""
    copy_folder(src, dst)
    edit_tensors(dst, fn)
    return dst


def nan_copy(src: Path, dst: Path, name: str) -> Path:
    """A copy of ``src`` at ``dst`` whose tensor ``name`` holds NaN at index 3 (an element of a vector, a row of
    a matrix): a checkpoint or update every FourSight reader must refuse naming ``name``."""

    def edit(t):
        t[name] = t[name].clone()
        t[name][3] = float("nan")

    return edited_copy(src, dst, edit)


def folder_with(src: Path, dst: Path, tensors: dict) -> Path:
    """A copy of model folder ``src`` at ``dst`` with ``tensors`` (HF names) replacing or adding to its own."""
    return edited_copy(src, dst, lambda t: t.update(tensors))


def library_ct_checkpoint(model_dir: Path, out: Path, **kw: Any) -> Path:
    """The compressed-tensors library's own NVFP4 checkpoint of BF16 folder ``model_dir`` (made by the
    library alone: the independent side of the interop tests; ``benchmarks/**/ct_library.py``, ``**kw`` its options)."""
    from helpers.scripts import load_benchmark

    return load_benchmark("ct_library").library_ct_checkpoint(model_dir, out, **kw)
