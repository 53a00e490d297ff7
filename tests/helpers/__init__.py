"""The tests' shared helpers, one module per subject (``tests/`` is on ``sys.path``, so a test file
imports them as ``from helpers.logprobs import ...``; both the main and the SGLang suite do).

- :mod:`helpers.checkpoints`: the tiny FourSight checkpoints (one builder, cached per model and options),
  folder copies with tensors edited or replaced.
- :mod:`helpers.logprobs`: teacher-forced logprobs from a ``vllm.LLM`` and their comparison.
- :mod:`helpers.vllm_engine`: in-process vLLM engines (start, reach the model, close, score in a subprocess).
- :mod:`helpers.sglang_engine`: SGLang engine settings on CPU, servers, logprobs and the noise-floor rule.
- :mod:`helpers.weights`: a new policy's BF16 weights and the reference model that holds them.
- :mod:`helpers.scripts`: benchmarks and scripts loaded as modules by name.
- :mod:`helpers.producers`: the fused producers' quantized operands against the PyTorch oracle.

Nothing here ships with the product: ``foursight`` never imports it.
"""
