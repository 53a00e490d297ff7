"""FourSight in the inference engines (import name ``foursight.quant_methods``).

Engine-neutral: ``config`` (the config base both engines derive from, and what an engine checks of a
checkpoint it loads), ``plan`` (the per-layer plan: ``LayerPlan``, holding a layout and a loader, its
checkpoint and online forms, and the linear-method base both engines derive from), ``layer_layout``
(a layer's shards, sizes and TP position), ``param_kinds`` (the parameters a layer registers, each kind
with its loading rule, the BF16 update of a checkpoint-mode layer among them), ``layer_loading`` (the
loaders and their bookkeeping), ``layer_state`` (the execution state, its forward and its installation in
place), ``online`` (load-time quantization settings and channels), ``sharding (fused shards, tensor parallelism), ``param_names`` (checkpoint
names -> engine parameter names), ``update_check`` (the whole-update check), ``requantize`` (the
sync's quantizer), ``weight_authority`` (who may load weights into a served engine), ``engine_hooks``
(how an engine's method is wrapped).
vLLM: ``vllm_plugin`` (entry point), ``vllm_method``, ``vllm_weight_sync`` (the worker extension, the guards of vLLM's
weight RPCs), ``vllm_weight_update`` (how an update is applied), ``vllm_weight_transfer``, the broadcast
road ``weight_broadcast`` with its communicators ``broadcast_communicators``.
SGLang: ``sglang_plugin`` (entry point), ``sglang_method``.
Nothing is imported here, so that importing the package needs no engine.
"""
