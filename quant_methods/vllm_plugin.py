"""vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"] foursight``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers)
before it parses the model config, so ``--quantization foursight`` and checkpoints whose
``quantization_config.quant_method`` is ``foursight`` resolve to
:class:`foursight.quant_methods.vllm_method.FourSightVllmConfig`, and
``--weight-transfer-config '{"backend": "foursight_file"}'`` to
:class:`foursight.quant_methods.vllm_weight_transfer.FourSightFileEngine` (``"foursight_nccl"``:
:class:`foursight.quant_methods.vllm_broadcast_backend.FourSightBroadcastEngine`).
"""

from __future__ import annotations


def register() -> None:
    """Import the module whose ``@register_quantization_config("foursight")`` registers the method,
    and install the checkpoint-load check (:func:`foursight.quant_methods.vllm_method.install_load_check`) and
    the guards of vLLM's own weight RPCs (:func:`foursight.quant_methods.vllm_weight_sync.install_worker_guards`).

    Idempotent (a second call re-registers the same class, which vLLM allows).
    """
    _request_amx()
    from foursight.quant_methods.vllm_compat import check_version

    warning = check_version()
    if warning:
        import logging

        logging.getLogger("foursight.quant_methods").warning(warning)
    from foursight.quant_methods.vllm_method import install_load_check  # its import registers the method

    install_load_check()  # wraps vLLM's checkpoint loader (why: foursight.quant_methods.engine_hooks)
    from foursight.quant_methods.vllm_weight_transfer import register as register_weight_transfer

    register_weight_transfer()  # the foursight_file backend of --weight-transfer-config (vLLM >= 0.32)
    from foursight.quant_methods.vllm_broadcast_backend import register as register_broadcast

    register_broadcast()  # the foursight_nccl backend: the learner's tensors over a broadcast group
    from foursight.quant_methods.vllm_weight_sync import install_worker_guards

    install_worker_guards()  # vLLM's own weight RPCs: reload checked whole, every weight change a new weights id


def _request_amx() -> None:
    """Ask Linux for the AMX tile state in this process, where the CPU has AMX.

    vLLM's CPU attention picks its AMX kernel whenever the CPU has AMX tiles
    (``torch.cpu._is_amx_tile_supported()``), but a process may only execute AMX instructions after
    requesting the state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``). In vLLM 0.32's CPU build nothing in a worker
    process does so before its first attention call unless a oneDNN AMX matmul happened to run first, so on
    AMX hosts an engine worker can die of SIGILL at its first forward (seen here: ``cpu_attention_with_kv_cache``,
    exit code -4, FourSight or not). Requesting it is harmless elsewhere (torch returns False where there is no AMX).
    """
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
    except Exception:  # noqa: BLE001 - an older torch without these helpers: vLLM behaves as before
        pass
