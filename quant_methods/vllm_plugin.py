"""vLLM plugin entry point (``[project.entry-points."vllm.general_plugins"] foursight``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers)
before it parses the model config, so ``--quantization foursight`` and checkpoints whose
``quantization_config.quant_method`` is ``foursight`` resolve to
:class:`foursight.quant_methods.vllm_method.FourSightVllmConfig`, and
``--weight-transfer-config '{"backend": "foursight_file"}'`` to
:class:`foursight.quant_methods.vllm_weight_transfer.FourSightFileEngine`.
"""

from __future__ import annotations


def register() -> None:
    """Import the module whose ``@register_quantization_config("foursight")`` registers the method.

    Idempotent (a second call re-registers the same class, which vLLM allows).
    """
    import foursight.quant_methods.vllm_method  # noqa: F401
    from foursight.quant_methods.vllm_weight_transfer import register as register_weight_transfer

    register_weight_transfer()  # the foursight_file backend of --weight-transfer-config (vLLM >= 0.32)
