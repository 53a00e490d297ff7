"""The engine registry: every engine kind FourSight drives, and how each verb makes one (:data:`ENGINE_KINDS`).

``foursight bridge serve --engine KIND``, ``foursight compare --engines KIND:PRECISION`` and ``foursight rl
--engine KIND`` take their choices from this one table and build their engines through its rows; none of
them lists the kinds again. A row names, as ``"module:attribute"`` (imported only when a verb uses it, so
``foursight rl --help`` never imports vLLM, SGLang or httpx):

* ``server`` — the :class:`~.base.Engine` that reaches a running engine server over HTTP
  (``bridge serve --engine-url``, ``compare --engine-url``): called ``server(url, tokenizer=..., api_key=...,
  **options)``;
* ``launcher`` — what starts such a server for ``compare`` (``launcher(model_dir, log_path=..., extra_args=...,
  max_model_len=..., python=...)`` returns a started :class:`~foursight.trainer_bridge.launch.ServerProcess`);
* ``in_process`` — the :class:`~.base.Engine` that runs the model in this process (``bridge serve --model``,
  ``compare``): ``in_process(model_dir, tokenizer=..., device=...)`` or ``in_process(model=..., tokenizer=...)``;
* ``rollout`` — ``foursight rl``'s :class:`~.base.RolloutEngine`, made by its ``for_rl(setup)`` from a
  :class:`~.base.RolloutSetup`.

A verb a row cannot serve refuses the kind by name (:func:`engine_kind`). Adding a backend: write its module
under ``backends/`` and add its row here (docs/architecture.md, "Adding an engine backend").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from foursight.precisions import PRECISIONS

#: the verbs that choose an engine kind, as their errors name them
VERBS = ("bridge", "compare", "rl")


class EngineKindError(ValueError):
    """An engine kind that does not exist, or that a verb cannot use; the message names the kind and the verb."""


def load(target: str) -> Any:
    """The object a ``"module:attribute"`` reference names (imports the module)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class EngineKind:
    """One engine kind: what each verb uses of it (see the module docstring); None where it has nothing."""

    name: str
    #: how the kind is called in messages and help ("vLLM")
    title: str
    server: str | None = None
    launcher: str | None = None
    in_process: str | None = None
    rollout: str | None = None
    #: names of ``BridgeConfig`` fields the ``server`` engine also takes (``bridge serve --weight-sync``)
    server_options: tuple[str, ...] = ()
    #: the precisions ``foursight rl``'s ``rollout`` engine serves
    rollout_precisions: tuple[str, ...] = PRECISIONS
    #: the rollout engine holds a quantized copy of the learner in this process (``.model``): it takes the
    #: calibrated channel sets, per-group k (``--error-target``), ``--bf16-layers`` and the ``follow/*`` metrics;
    #: otherwise it quantizes the model folder itself from the ``--channels`` spec
    rollout_copies_learner: bool = False
    #: the devices ``foursight rl``'s rollout engine runs on here (None: any)
    rollout_devices: tuple[str, ...] | None = None
    #: one line per verb for its ``--help``
    notes: Mapping[str, str] = field(default_factory=dict)

    def serves(self, verb: str) -> bool:
        """Whether ``verb`` can use this kind."""
        if verb == "rl":
            return self.rollout is not None
        return self.server is not None or self.in_process is not None

    def help(self, verb: str) -> str:
        note = self.notes.get(verb)
        return f"{self.name} ({note})" if note else self.name


#: every engine kind, by the name the verbs take
ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind(
        "vllm", "vLLM",
        server="foursight.trainer_bridge.backends.vllm:VLLMHTTPEngine",
        launcher="foursight.trainer_bridge.backends.vllm:launch_server",
        rollout="foursight.trainer_bridge.backends.vllm_inprocess:VLLMRollout",
        server_options=("weight_sync",),
        rollout_precisions=("nvfp4", "foursight"),
        rollout_devices=("cpu",),
        notes={"bridge": "a vLLM OpenAI server at --engine-url", "rl": "vllm.LLM in this process, CPU smoke"},
    ),
    "sglang": EngineKind(
        "sglang", "SGLang",
        server="foursight.trainer_bridge.backends.sglang:SGLangHTTPEngine",
        launcher="foursight.trainer_bridge.backends.sglang:launch_server",
        notes={"bridge": "an SGLang server at --engine-url"},
    ),
    "hf": EngineKind(
        "hf", "HF",
        in_process="foursight.trainer_bridge.backends.hf:HFEngine",
        rollout="foursight.trainer_bridge.backends.hf_rollout:HFRollout",
        rollout_copies_learner=True,
        notes={"bridge": "the model of --model in this process", "rl": "in-process; Triton kernels on CUDA"},
    ),
}


def kinds_for(verb: str) -> tuple[str, ...]:
    """The engine kinds ``verb`` can use, in table order."""
    return tuple(k for k, row in ENGINE_KINDS.items() if row.serves(verb))


def kinds_help(verb: str, sep: str = " | ") -> str:
    """The kinds of ``verb`` with their notes, for its ``--help``."""
    return sep.join(ENGINE_KINDS[k].help(verb) for k in kinds_for(verb))


def engine_kind(name: str, verb: str, flag: str) -> EngineKind:
    """The row of kind ``name`` for ``verb``; an :class:`EngineKindError` naming ``flag``, the kind and the verb
    when there is no such kind or the verb cannot use it."""
    row = ENGINE_KINDS.get(name)
    usable = kinds_for(verb)
    if row is None:
        raise EngineKindError(f"{flag}: unknown engine kind {name!r}; foursight {verb} takes {', '.join(usable)}")
    if not row.serves(verb):
        raise EngineKindError(f"{flag}: engine kind {name!r} cannot be used by foursight {verb} (it has no "
                              f"{'rollout engine' if verb == 'rl' else 'engine'} for it); use one of {', '.join(usable)}")
    return row
