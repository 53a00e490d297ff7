"""The engine backends: FourSight's only clients of the inference engines, one module per engine.

* :mod:`.base` — the :class:`~.base.Engine` interface every backend implements (generate, score,
  health, served state, versioned weight update), :class:`~.base.EngineError`, the local tokenizer;
* :mod:`.http` — what the engines reached over HTTP share (connection, health, the sample flow);
* :mod:`.vllm` — a vLLM OpenAI server (:class:`~.vllm.VLLMHTTPEngine`);
* :mod:`.sglang` — an SGLang server (:class:`~.sglang.SGLangHTTPEngine`);
* :mod:`.hf` — a Hugging Face model in this process (:class:`~.hf.HFEngine`, its scheduler, and
  ``foursight rl``'s :class:`~.hf_rollout.HFRollout`), sampled by :mod:`foursight.trainer_bridge.hf_sampling`;
* :mod:`.vllm_inprocess` — ``vllm.LLM`` in this process, ``foursight rl``'s :class:`~.vllm_inprocess.VLLMRollout`;
* :mod:`.registry` — the one table of engine kinds (``vllm``, ``sglang``, ``hf``) the bridge, ``compare`` and
  ``rl`` choose from, naming the classes above.

Import from the module you need; this package imports none of them (an HTTP client does not pull
in torch models, nor the HF engine httpx).
"""
