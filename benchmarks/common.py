"""What the benchmark scripts of several subject folders share: where a result came from (the commit
and the kernels' hash), one channel set per layer from a rule for k, and the sampling options of the
fidelity measurements.

The scripts are run by path (``python benchmarks/<subject>/<script>.py``), not as a package; each one
that needs this module puts ``benchmarks/`` on ``sys.path`` first. Timing is the package's
(:func:`foursight.kernels.tuning.time_gpu`), relative error the package's
(:func:`foursight.channels.relative_error`), FP8 the package's (:mod:`foursight.fp8`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]

# The kernel benchmarks measure the autotuner: its choices are timed afresh, never read from its disk cache
# (kernels/tuning.py). The engine benchmarks set a folder before importing this module, as users get it.
os.environ.setdefault("FOURSIGHT_TUNE_CACHE", "0")


def git_commit(short: bool = False) -> str:
    """The commit of the tree: ``FOURSIGHT_COMMIT`` when set (a device copy has no git), else
    ``git rev-parse HEAD``; ``"unknown"`` when neither answers."""
    commit = os.environ.get("FOURSIGHT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=REPO,
                                    timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git, not a checkout: say so in the result
            return "unknown"
    return commit[:12] if short else commit


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for the machine field of a CPU measurement."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels_sha256(kernels_dir: str | Path | None = None) -> str:
    """sha256 over the ``*.py`` files (name, then bytes, in name order) of the kernels folder: the one
    ``foursight.kernels`` is imported from by default (the same hash as device_v3.sh's ``KSHA``)."""
    if kernels_dir is None:
        import foursight.kernels as fk  # noqa: PLC0415

        kernels_dir = Path(fk.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(Path(kernels_dir).glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def ms_per_call(fns: list[Callable]) -> float:
    """GPU milliseconds of one call of ``fns``, timed as one pass over all of them by the package's timer
    (:func:`foursight.kernels.tuning.time_gpu`: CUDA-graph replays with the L2 flushed before each pass)
    and divided by their number. The callables run the same work on different copies of the weights, so
    that a pass streams more bytes than the L2 holds."""
    from foursight.kernels.tuning import time_gpu  # noqa: PLC0415

    def one_pass():
        for f in fns:
            f()

    return time_gpu(one_pass) / len(fns)


def channels_by_layer(groups: dict, k_of_group: Callable) -> dict:
    """``{layer name: BF16 channel indices}``: for every input group of a calibration
    (:func:`foursight.calibration.collect_stats`), the top-``k_of_group(group)`` channels by variance
    (:func:`foursight.channels.select_channels`), shared by the group's members."""
    from foursight.channels import select_channels  # noqa: PLC0415

    out = {}
    for g in groups.values():
        ch = select_channels(g.stats.variance, k_of_group(g))
        for n in g.members:
            out[n] = ch
    return out


def add_sampling_args(ap: argparse.ArgumentParser, n: int, max_tokens: int) -> None:
    """The options of a fidelity measurement's completions: ``--model`` (default the packaged
    SmolLM2-135M-Instruct), ``--n`` prompts, ``--max-tokens`` per completion, ``--seed``."""
    ap.add_argument("--model", default=None, help="BF16 model folder (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--n", type=int, default=n, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per completion")
    ap.add_argument("--seed", type=int, default=0)
