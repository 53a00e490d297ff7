"""FourSight in the inference engines (import name ``foursight.quant_methods``).

Engine-neutral: ``config`` (the config base both engines derive from, and what an engine checks of a
checkpoint it loads), ``plan`` (the per-layer plan: post-load processing and forward, and the
linear-method base both engines derive from), ``layer_layout`` (the parameters a layer registers),
``layer_loading`` (its loaders and the BF16 update of a checkpoint-mode layer), ``online`` (load-time
quantization settings), ``sharding`` (fused shards, tensor parallelism), ``param_names`` (checkpoint
names -> engine parameter names), ``update_check`` (the whole-update check), ``requantize`` (the
sync's quantizer), ``weight_authority`` (who may load weights into a served engine), ``engine_hooks``
(how an engine's method is wrapped).
vLLM: ``vllm_plugin`` (entry point), ``vllm_method``, ``vllm_weight_sync``, ``vllm_weight_transfer``.
SGLang: ``sglang_plugin`` (entry point), ``sglang_method``.
Nothing is imported here, so that importing the package needs no engine.
"""
