"""FourSight in the inference engines (import name ``foursight.quant_methods``).

Engine-neutral: ``config`` (the config and linear-method bases both engines derive from),
``plan`` (per-layer parameters, loaders, post-load processing, forward), ``online`` (load-time
quantization settings), ``sharding`` (fused shards, tensor parallelism).
vLLM: ``vllm_plugin`` (entry point), ``vllm_method``, ``vllm_weight_sync``, ``vllm_weight_transfer``.
SGLang: ``sglang_plugin`` (entry point), ``sglang_method``.
Nothing is imported here, so that importing the package needs no engine.
"""
