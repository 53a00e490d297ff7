"""``foursight compare``: training–inference mismatch across engines and precisions.

1. Rollouts are generated once by a reference engine (by default the first of ``--engines``).
2. The *identical* token sequences are scored, teacher-forced, by every engine and by the
   learner reference, HF BF16.

Every engine is a backend of :mod:`foursight.trainer_bridge.backends` (``generate`` and ``score``:
vLLM ``prompt_logprobs``, SGLang ``input_token_logprobs``, HF
:func:`~foursight.trainer_bridge.scoring.teacher_forced_logprobs`); rollouts are
:class:`~foursight.trainer_bridge.protocol.Rollout` records.
3. The TIM metrics of :mod:`foursight.trainer_bridge.metrics` are computed for every engine
   against the learner, plus a pairwise matrix of mean |Δlogp| between engines.
4. ``report.md``, ``metrics.json`` and PNG plots are written; a rich table is printed.
5. ``--attribute``: in the HF engine, layers of the plain-NVFP4 model are restored to BF16 one
   group at a time, and the share of the NVFP4 mismatch that disappears is ranked.

Modules: ``config`` (the options), ``spec`` (--engines), ``prompts``, ``launch`` (start and drive the
backends), ``report`` (metrics, plots, report.md), ``attribution``, ``run`` (the driver,
:func:`~foursight.compare.run.run_compare`, and the body of the ``foursight compare`` command, which
``foursight.cli`` imports only when it runs). This index re-exports the names of ``spec`` and
``report`` only, each imported when first read: the driver and the attribution load models (the HF
engine, the kernels), ``report`` imports torch, and importing a part of the package imports this
index first.

Engines are started and stopped by the tool (vLLM and SGLang as HTTP servers on 127.0.0.1, HF
in-process), or reached at ``--engine-url KIND:PRECISION=URL`` when already running.
"""

import importlib

__all__ = ["KINDS", "LEARNER", "PRECISIONS", "CompareError", "EngineSpec", "engine_metrics", "pairwise", "parse_engine_urls",
           "parse_engines"]


def __getattr__(name: str):
    """The re-exported names, each imported from its module when first read (``report`` imports torch,
    and importing any part of the package, such as the command line's ``config``, imports this index)."""
    if name not in __all__:
        raise AttributeError(name)
    module = "report" if name in ("engine_metrics", "pairwise") else "spec"
    return getattr(importlib.import_module(f"foursight.compare.{module}"), name)
