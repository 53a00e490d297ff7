"""Tensor I/O: the one safetensors reader and the one safetensors writer of FourSight.

Every checkpoint, model folder and weight-update file FourSight reads goes through
:func:`iter_safetensors` (or, headers only, :func:`read_headers`); every checkpoint folder it writes
goes through :func:`write_safetensors`. So a truncated file, a stale shard or a NaN is refused with
the same message (naming the file and the tensor) by ``foursight inspect``, the vLLM and SGLang
loaders, the bridge's weight routes and the transformers quantizer alike.

What the tensors mean (names, shapes, the codec) is :mod:`foursight.schema`'s; how a folder is
written safely (temporary folder, incomplete-run marker, ``--force``) is :mod:`foursight.folder_writer`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

from foursight import schema
from foursight.schema import CheckpointError, FourSightConfig, check_complete, check_finite

#: the index of a sharded safetensors checkpoint (tensor name -> file), as transformers writes it
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: the largest shard :func:`write_safetensors` writes by default
SHARD_BYTES = 2 * 1024**3


def _read_index(folder: Path) -> dict[str, list[str]] | None:
    """File -> tensor names of ``folder``'s safetensors index, or None without one. Raises
    :class:`CheckpointError` naming the index or the file it lists that is missing."""
    p = folder / SAFETENSORS_INDEX
    if not p.is_file():
        return None
    try:
        wm = json.loads(p.read_text())["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map is not an object of tensor name -> file name")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p}: unreadable safetensors index ({type(e).__name__}: {e})") from None
    out: dict[str, list[str]] = {}
    for name, fname in wm.items():
        if Path(fname).name != fname:
            raise CheckpointError(f"{p}: tensor {name} maps to {fname!r}, not a file of this folder")
        out.setdefault(fname, []).append(name)
    for fname in out:
        if not (folder / fname).is_file():
            raise CheckpointError(f"{p} lists {fname} (tensor {out[fname][0]}), which does not exist")
    return out


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors file ``path``, or the files of the folder ``path``: those its
    ``model.safetensors.index.json`` lists when it has one (other files are not read, as in
    transformers), else every ``*.safetensors`` (sorted). A folder a writer left incomplete is refused
    (:func:`foursight.schema.check_complete`). Raises :class:`CheckpointError` naming the path when there is none."""
    p = Path(path)
    if p.is_dir():
        check_complete(p)
        index = _read_index(p)
        if index is not None:
            return [p / f for f in sorted(index)]
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{p}: no .safetensors files")
        return files
    if not p.is_file():
        raise CheckpointError(f"safetensors file {p} does not exist")
    return [p]


def _open(f: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own and OS errors
        raise CheckpointError(f"safetensors file {f} is truncated or unreadable ({type(e).__name__}: {e})") from None


def iter_safetensors(path: str | os.PathLike, check: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a safetensors file or folder (:func:`safetensors_files`), one tensor
    at a time (memory-mapped, never a whole file), in file order.

    The one reader of checkpoints and weight updates: a truncated or unreadable file raises
    :class:`CheckpointError` naming the file; in a sharded folder every tensor the index lists
    must be in its file and every tensor of a listed file in the index (a stale or mixed-up shard
    is named); with ``check`` every tensor goes through :func:`foursight.schema.check_finite` (the
    error names the tensor and the file).
    """
    p = Path(path)
    files = safetensors_files(path)  # refuses a folder a writer left incomplete
    index = _read_index(p) if p.is_dir() else None
    for f in files:
        with _open(f) as handle:
            keys = list(handle.keys())
            if index is not None:
                listed = index[f.name]
                missing = sorted(set(listed) - set(keys))
                if missing:
                    raise CheckpointError(f"tensor {missing[0]}: {SAFETENSORS_INDEX} puts it in {f}, which does not hold it")
                extra = sorted(set(keys) - set(listed))
                if extra:
                    raise CheckpointError(f"tensor {extra[0]} in {f} is not in {SAFETENSORS_INDEX} (a stale or mixed-up shard?)")
            for name in keys:
                try:
                    t = handle.get_tensor(name)
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"safetensors file {f}: tensor {name} is unreadable ({type(e).__name__}: {e})") from None
                if check:
                    check_finite(name, t, f" in {f}")
                yield name, t


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file or folder, as a dict (:func:`iter_safetensors`: each checked finite)."""
    return dict(iter_safetensors(path))


def read_headers(path: str | os.PathLike) -> dict[str, list[int]]:
    """Tensor name -> shape of every tensor of a safetensors file or folder (:func:`safetensors_files`),
    from the headers only (nothing is read): a truncated or unreadable file raises
    :class:`CheckpointError` naming it before an engine reads it."""
    shapes: dict[str, list[int]] = {}
    for f in safetensors_files(path):
        with _open(f) as handle:
            for name in handle.keys():
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


def check_headers(path: str | os.PathLike) -> int:
    """:func:`read_headers` of ``path``; returns the number of tensors."""
    return len(read_headers(path))


def check_safetensors(path: str | os.PathLike) -> int:
    """Read every tensor of a safetensors file or folder and check it is finite
    (:func:`iter_safetensors`); returns the number of tensors."""
    return sum(1 for _ in iter_safetensors(path))


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = None,
                      metadata: dict[str, str] | None = None) -> list[str]:
    """The one writer: ``tensors`` into ``folder`` as ``model.safetensors``, or as
    ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` when they
    exceed ``max_shard_bytes`` (default :data:`SHARD_BYTES`): huggingface_hub's splitter, the
    layout transformers, vLLM and SGLang read. Every file carries ``metadata`` (default: the
    FourSight metadata; a compressed-tensors export passes its own). Returns the file names.
    ``folder`` is the temporary folder of :func:`foursight.folder_writer.folder_writer`."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_bytes or SHARD_BYTES)
    meta = metadata or {"format": "pt", "quant_method": schema.QUANT_METHOD, "format_version": str(schema.FORMAT_VERSION)}
    for fname, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / fname), metadata=meta)
    if split.is_sharded:
        (folder / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, indent=2))
    return list(split.filename_to_tensors)


#: headroom of :func:`update_bytes` over the model's tensors: the safetensors header (names, shapes, offsets)
#: and a few small tensors a learner may send besides the model's own
UPDATE_HEADER_BYTES = 16 << 20


def update_bytes(folder: str | os.PathLike | None) -> int | None:
    """The bytes of a whole BF16 weight update of the model in ``folder`` (a BF16 HF folder or a FourSight
    checkpoint), from its safetensors headers (nothing else is read), plus :data:`UPDATE_HEADER_BYTES`; None when
    the folder has no safetensors files. A FourSight layer counts as its BF16 ``weight`` (4 bytes per
    packed byte of ``weight_packed``; its scales and channels are derived, never sent), every other tensor
    at 2 bytes a value; a model with tied embeddings counts ``embed_tokens`` twice (a learner may send
    ``lm_head.weight`` too)."""
    if folder is None:
        return None
    try:
        shapes = read_headers(folder)
        tied = bool(schema.read_config(folder).get("tie_word_embeddings", False))
    except (CheckpointError, OSError):
        return None
    total = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= int(d)
        suffix = name.rsplit(".", 1)[-1]
        if suffix == schema.WEIGHT_PACKED:
            total += 4 * n
        elif suffix in schema.TENSOR_SUFFIXES:
            continue
        else:
            total += 2 * n * (2 if tied and name.endswith("embed_tokens.weight") else 1)
    return total + UPDATE_HEADER_BYTES if total else None


# ---------------------------------------------------------------------------------------------
# the checkpoint reader


def read_quant_config(ckpt_dir: str | Path) -> FourSightConfig:
    """Parse and validate ``config.json["quantization_config"]`` (CheckpointError names the field)."""
    path = Path(ckpt_dir) / "config.json"
    raw = schema.read_config(ckpt_dir).get("quantization_config")
    if raw is None:
        raise CheckpointError(f"{path}: no quantization_config: {ckpt_dir} is not a quantized checkpoint (a BF16 model? "
                              f"make one with `foursight quantize --model {ckpt_dir}`)")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: quantization_config is not an object")
    if raw.get("quant_method") != schema.QUANT_METHOD:
        raise CheckpointError(f"{path}: quantization_config.quant_method is {raw.get('quant_method')!r}, not 'foursight'")
    return FourSightConfig.parse(raw)


def split_modules(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Split a flat state dict into FourSight modules (prefix → {suffix: tensor}) and the rest."""
    mods: dict[str, dict[str, torch.Tensor]] = {}
    prefixes = {n[: -len(schema.WEIGHT_PACKED) - 1] for n in tensors if n.endswith("." + schema.WEIGHT_PACKED)}
    rest: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        pre, _, suf = n.rpartition(".")
        if pre in prefixes and (suf in schema.TENSOR_SUFFIXES or suf == schema.BIAS):
            mods.setdefault(pre, {})[suf] = t
        else:
            rest[n] = t
    return mods, rest


def load_quantized_tensors(ckpt_dir: str | Path) -> tuple[FourSightConfig, dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(config, modules, rest)`` of a checkpoint: the validated config, the FourSight modules
    (prefix → {suffix: tensor}) and every other tensor (plain BF16 params). A folder left by an
    interrupted writer (it holds :data:`INCOMPLETE_MARKER`) raises :class:`CheckpointError` naming it."""
    schema.check_complete(ckpt_dir)
    cfg = read_quant_config(ckpt_dir)
    mods, rest = split_modules(read_tensors(ckpt_dir))
    return cfg, mods, rest
