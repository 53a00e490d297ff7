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


# ---------------------------------------------------------------------------------------------
# fair timing: clocks with every timing, baseline and candidate in interleaved rounds
# ---------------------------------------------------------------------------------------------

#: what :func:`gpu_clocks` asks ``nvidia-smi`` for (the names its ``--query-gpu`` takes, in this order); the last,
#: the active clock-limit reasons, is ``clocks_event_reasons.active`` on recent drivers and
#: ``clocks_throttle_reasons.active`` on older ones: both are tried
SMI_FIELDS: tuple = ("clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem", "temperature.gpu", "power.draw",
                     "clocks_event_reasons.active")
SMI_REASONS_OLD: str = "clocks_throttle_reasons.active"
#: the keys of :func:`gpu_clocks`' answer, field by field
CLOCK_KEYS: tuple = ("sm_mhz", "mem_mhz", "max_sm_mhz", "max_mem_mhz", "temp_c", "power_w", "throttle_reasons")


def parse_smi_clocks(line: str) -> dict:
    """One ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` line -> ``{CLOCK_KEYS: value}``:
    numbers as float, the throttle-reasons bit mask as its hex text, ``[N/A]`` / ``[Not Supported]`` as None."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(SMI_FIELDS):
        raise ValueError(f"nvidia-smi clocks line: expected {len(SMI_FIELDS)} fields ({', '.join(SMI_FIELDS)}), got {line!r}")
    out = {}
    for key, p in zip(CLOCK_KEYS, parts):
        if p.startswith("[") or p in ("", "N/A"):
            out[key] = None
        elif key == "throttle_reasons":
            out[key] = p
        else:
            out[key] = float(p)
    return out


def gpu_clocks(index: int = 0) -> dict:
    """The GPU's clocks now: SM and memory MHz (current and max), temperature, power and the active
    clock-throttle reasons, for the record beside a timing (an SM clock below its max during a memory-bound
    call is the first thing to rule out when two runs disagree). ``pynvml`` when importable (microseconds
    a query), else one ``nvidia-smi`` query (tens of milliseconds); ``{"error": why}`` when neither answers
    (the CPU machine)."""
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return {"sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "mem_mhz": float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                "max_sm_mhz": float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
                "max_mem_mhz": float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)),
                "temp_c": float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "throttle_reasons": hex(reasons(h)), "source": "pynvml"}
    except Exception as e:  # noqa: BLE001 - no pynvml or no NVML: try the command line
        nvml_error = f"{type(e).__name__}: {str(e)[:120]}"
    smi_error = ""
    for fields in (SMI_FIELDS, SMI_FIELDS[:-1] + (SMI_REASONS_OLD,)):
        try:
            out = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                raise RuntimeError((out.stdout + out.stderr).strip()[:200] or f"exit {out.returncode}")
            return {**parse_smi_clocks(out.stdout.splitlines()[0]), "source": "nvidia-smi"}
        except Exception as e:  # noqa: BLE001 - recorded, never fatal
            smi_error = f"{type(e).__name__}: {str(e)[:120]}"
            if isinstance(e, FileNotFoundError):
                break
    return {"error": f"no clocks: pynvml ({nvml_error}); nvidia-smi ({smi_error})"}


def spread(samples: list[float]) -> dict:
    """``{"min", "median", "max", "n"}`` of a list of times (the median of an even count: the mean of the middle two)."""
    if not samples:
        raise ValueError("spread: no samples")
    s = sorted(samples)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return {"min": s[0], "median": med, "max": s[-1], "n": n}


def interleaved_rounds(timers: dict[str, Callable[[], float]], rounds: int, clocks: Callable[[], dict] | None = None) -> dict:
    """Time several methods (a baseline and its candidates) in interleaved rounds: each round calls every
    timer once, and the order rotates by one place each round, so that no method always runs first (after
    an idle spell, or a clock still ramping) or always right after the same other method. A timer returns
    one sample (e.g. ms per call of one graph replay, :class:`GraphTimer`). ``clocks`` (e.g.
    :func:`gpu_clocks`) is read after each round, so every sample has the clocks of its round beside it.

    Returns ``{"order": [[names of round 0], ...], "samples": {name: [per round]}, "stats": {name: spread},
    "clocks": [per round]}``."""
    if rounds < 1:
        raise ValueError(f"interleaved_rounds: rounds must be >= 1, got {rounds}")
    if not timers:
        raise ValueError("interleaved_rounds: no timers")
    names = list(timers)
    samples: dict = {n: [] for n in names}
    order, clock_log = [], []
    for r in range(rounds):
        rot = names[r % len(names):] + names[: r % len(names)]
        order.append(rot)
        for n in rot:
            samples[n].append(float(timers[n]()))
        if clocks is not None:
            clock_log.append(clocks())
    return {"order": order, "samples": samples, "stats": {n: spread(v) for n, v in samples.items()}, "clocks": clock_log}


class GraphTimer:
    """One sample per call: GPU ms of one ``fn()``, from a CUDA graph captured once (``reps`` calls of ``fn``,
    each after the read flush when ``flush``) and replayed at each call, minus a graph of the flushes alone.

    The measurement of :func:`foursight.kernels.tuning.time_gpu` (the package's timer), cut in two so that rounds
    of different methods can interleave (:func:`interleaved_rounds`): ``time_gpu`` captures and replays its
    rounds back to back. ``flush=False`` for callables that rotate weight copies larger than the L2 themselves
    (the benchmarks' per-layer rows)."""

    def __init__(self, fn: Callable, reps: int = 8, flush: bool = True):
        import torch  # noqa: PLC0415

        from foursight.kernels.tuning import _flush_fn  # noqa: PLC0415

        self.reps = reps
        fl = _flush_fn("read") if flush else None
        self._fl = fl
        fn()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self.g_run, self.g_flush = torch.cuda.CUDAGraph(), (torch.cuda.CUDAGraph() if fl is not None else None)
        with torch.cuda.stream(stream):
            fn()
            if fl is not None:
                fl()
            with torch.cuda.graph(self.g_run, stream=stream):
                for _ in range(reps):
                    if fl is not None:
                        fl()
                    fn()
            if fl is not None:
                with torch.cuda.graph(self.g_flush, stream=stream):
                    for _ in range(reps):
                        fl()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def __call__(self) -> float:
        import torch  # noqa: PLC0415

        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        self.g_run.replay()
        ev[1].record()
        if self.g_flush is not None:
            self.g_flush.replay()
        ev[2].record()
        torch.cuda.synchronize()
        flush_ms = ev[1].elapsed_time(ev[2]) if self.g_flush is not None else 0.0
        return max((ev[0].elapsed_time(ev[1]) - flush_ms) / self.reps, 1e-6)
