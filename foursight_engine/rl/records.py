"""The records of a ``foursight rl`` run: its JSONL log (:func:`check_log_path`, :func:`open_log`,
:func:`read_log`), its resume checkpoint (:func:`save_checkpoint`, :func:`load_checkpoint`), and
what each record says about where it came from (:func:`code_commit`, :func:`state_dict_sha256`)
and what it cost (:func:`memory_record`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foursight.rl.config import RLError


def state_dict_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a model folder's tensors (sorted names; name, dtype, shape and raw bytes),
    independent of the safetensors file layout: to check that two conversions are bit-identical."""
    import hashlib

    from foursight.tensor_io import iter_safetensors

    sd = dict(iter_safetensors(model_dir, check=False))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def code_commit() -> str | None:
    """The commit the run's code is from: ``FOURSIGHT_COMMIT`` (set by the device scripts, whose copy
    of the tree has no git history), else ``git rev-parse HEAD`` of the source tree (``+dirty`` when
    it has uncommitted changes), else None."""
    import subprocess

    if os.environ.get("FOURSIGHT_COMMIT"):
        return os.environ["FOURSIGHT_COMMIT"]
    src = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``foursight rl`` JSONL log (a torn last line, from a killed run, is dropped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def save_checkpoint(path: Path, step: int, learner: nn.Module, opt, channels, wall_offset: float,
                    filter_tau: float | None = None) -> None:
    """The resume checkpoint: learner, optimizer, channel sets, RNG, step, and the filter's τ when it was fitted
    online (``--filter-tau-fit``: a resumed run keeps step 1's τ instead of fitting a new one on a later batch)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "learner": learner.state_dict(), "opt": opt.state_dict(), "channels": channels,
                "wall_s": wall_offset, "rng": torch.get_rng_state(), "filter_tau": filter_tau}, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A resume checkpoint written by :func:`save_checkpoint`, read with ``weights_only=True``:
    tensors and plain containers only, so a file that is not one (a pickle that would run code on
    load) is refused with an :class:`RLError` naming it, before anything of it runs."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError) as e:
        raise RLError(f"--resume: {path} is not a foursight rl checkpoint (it holds more than tensors and plain data, or is "
                      f"damaged: {str(e).splitlines()[0][:200]}); remove it to start over") from None
    missing = [k for k in ("step", "learner", "opt", "channels", "wall_s", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise RLError(f"--resume: {path} is not a foursight rl checkpoint (missing {missing}); remove it to start over")
    return state


def check_log_path(out: Path) -> None:
    """``--out`` must be a file FourSight can write, checked before the model loads (RLError naming it)."""
    if out.is_dir():
        raise RLError(f"--out {out} is a folder; the log is a file (e.g. {out / 'rl.jsonl'})")
    existed = out.exists()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.open("a").close()
    except OSError as e:
        raise RLError(f"--out {out}: cannot write the log there ({e.strerror or e})") from None
    if not existed:
        out.unlink(missing_ok=True)


def open_log(out: Path, start_step: int, resuming: bool):
    """The log file: new, or (resuming) rewritten with its records up to the checkpoint's step."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if not resuming:
        return out.open("w")
    kept = [r for r in read_log(out) if r.get("type") in ("config", "eval", "step", "resume") and int(r.get("step", 0)) <= start_step]
    fh = out.open("w")
    for r in kept:
        fh.write(json.dumps(r) + "\n")
    return fh


def memory_record(dev: torch.device) -> dict[str, float | None]:
    """The step's memory: ``mem/peak_reserved_gib`` and ``mem/peak_allocated_gib``, the GPU's peak
    since the step started (None on the CPU), and ``mem/max_rss_gib``, the process's peak resident
    memory so far (the CPU side; monotone)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if dev.type != "cuda":
        return {"mem/peak_reserved_gib": None, "mem/peak_allocated_gib": None, "mem/max_rss_gib": rss}
    return {"mem/peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30,
            "mem/peak_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30, "mem/max_rss_gib": rss}
