"""TRL integration: apply a FourSight TIM-aware filter to every GRPO batch.

TRL's ``GRPOTrainer`` (checked against trl 1.16.0) already collects what the filter needs when
it runs with vLLM and ``vllm_importance_sampling_correction=True``: its
``_generate_and_score_completions`` returns ``old_per_token_logps`` (learner, [B, T]),
``sampling_per_token_logps`` (vLLM, [B, T]), ``completion_mask`` [B, T] (and ``tool_mask``), and
``importance_sampling_ratio``, which ``_compute_loss`` multiplies into the per-token loss
(``per_token_loss * inputs["importance_sampling_ratio"]``).

:class:`FourSightGRPOTrainer` replaces that ratio with FourSight's per-token loss weights:
``loss_mask`` (the filter's keep mask on valid tokens), times the truncated IS weights when
``tis_cap`` is set. It logs the TIM metrics under ``foursight/*`` in TRL's metric log.
The loss normaliser (``num_items_in_batch``) is left as TRL computed it, exactly as TRL's own
``sequence_mask`` mode does: dropped tokens count as zero-loss tokens.

Use a vLLM server started with ``--logprobs-mode processed_logprobs`` only when sampling has no
top-p/top-k (TRL warns otherwise); see docs/trl.md for the raw-vs-processed convention.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from foursight.trainer_bridge.filters import FilterConfig, apply_filter
from foursight.trainer_bridge.trl_warning import trl_version_warning_once

#: TRL 1.16 warns "TRL currently supports vLLM versions from 0.22.0 to 0.31.0" from each of its modules
#: that checks vLLM (7 times in the docs/trl.md example, on vLLM 0.32, which everything here ran on)
def apply_filter_to_trl_batch(batch: dict[str, Any], config: FilterConfig | dict | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    """Filter one TRL GRPO batch in place.

    Args:
        batch: the dict returned by ``GRPOTrainer._generate_and_score_completions`` with
            ``old_per_token_logps`` [B, T], ``sampling_per_token_logps`` [B, T] and
            ``completion_mask`` [B, T] (optional ``tool_mask`` [B, T]).
        config: the filter (default ``FilterConfig()``).
    Returns:
        (batch, metrics): ``batch["importance_sampling_ratio"]`` is set to the float [B, T] loss
        weights (``completion_mask`` itself is not changed, it is also the attention mask),
        ``batch["foursight_keep"]`` to the bool [B] keep mask; metrics are floats.
    Raises:
        KeyError naming the missing batch key.
    """
    for key in ("old_per_token_logps", "sampling_per_token_logps", "completion_mask"):
        if batch.get(key) is None:
            raise KeyError(f"TRL batch has no {key!r}: run GRPOTrainer with use_vllm=True and vllm_importance_sampling_correction=True")
    lt = batch["old_per_token_logps"].detach()
    lr = batch["sampling_per_token_logps"].detach()
    mask = batch["completion_mask"].bool()
    if batch.get("tool_mask") is not None:
        mask = mask & batch["tool_mask"].bool()
    # like TRL: a token vLLM could not score (NaN) carries no evidence; it gets r = 0
    nan = torch.isnan(lr) & mask
    lr = torch.where(nan, lt, lr)
    res = apply_filter(lt, lr, mask, config)
    w = res.loss_weights().to(device=lt.device, dtype=lt.dtype)
    batch["importance_sampling_ratio"] = w
    batch["foursight_keep"] = res.keep.to(lt.device)
    metrics = dict(res.metrics)
    metrics["filter/nan_sampling_logps"] = float(int(nan.sum()))
    return batch, metrics


class FourSightRollout(BaseModel):
    """How ``FourSightGRPOTrainer(..., rollout="foursight", foursight={...})`` builds TRL's rollout engine.

    Colocate mode (``GRPOConfig.vllm_mode="colocate"``): TRL's in-process ``vllm.LLM`` is built with
    ``quantization="foursight"``. Online mode by default: the learner's BF16 folder
    (``model.name_or_path``) is quantized at load with the channels of ``channels_file`` (or
    weight-based channels of ``channel_budget``); ``checkpoint`` serves a FourSight checkpoint of the
    same model instead. Server mode (``vllm_mode="server"``): TRL's client is
    :class:`FourSightVLLMClient`, which syncs the learner's weights through a FourSight bridge.

    Attributes:
        checkpoint: a FourSight checkpoint folder the colocated engine serves (checkpoint mode).
        channels_file: ``foursight_channels.json`` for online mode (``FOURSIGHT_CHANNELS_FILE``).
        channel_budget: weight-based channel budget when there is no channels file ("32" or "2%").
        activation_dtype: ``nvfp4`` (W4A4, default) or ``bf16`` (W4A16).
        ignore: module names left unquantized (default ``lm_head``).
        enforce_eager: vLLM's ``enforce_eager``; None means True on vLLM's CPU build (which cannot
            compile the model) and vLLM's default elsewhere.
        llm_kwargs: further ``vllm.LLM`` keyword arguments (they win over TRL's).
        api_key: the bridge's API key (server mode).
        weights_dir: folder for the weight files the client hands the bridge (server mode; default
            ``/dev/shm``, passed as ``shm_name``); it must be one of the bridge's ``--weights-dir``
            (with ``upload``: where the file is written before it is sent).
        upload: send each sync's file to the bridge over HTTP (server mode, the trainer on another host
            than the bridge: docs/scale-out.md).
    """

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = None
    channels_file: str | None = None
    channel_budget: str | None = None
    activation_dtype: Literal["nvfp4", "bf16"] | None = None
    ignore: list[str] | None = None
    enforce_eager: bool | None = None
    llm_kwargs: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None
    weights_dir: str | None = None
    upload: bool = False

    def engine_env(self) -> dict[str, str]:
        """The ``FOURSIGHT_*`` variables the engine reads at load (online mode)."""
        from foursight.schema import ENV_ACTIVATION_DTYPE, ENV_CHANNEL_BUDGET, ENV_CHANNELS_FILE, ENV_IGNORE

        env = {}
        if self.channels_file:
            if not Path(self.channels_file).is_file():
                raise ValueError(f"foursight.channels_file: {self.channels_file} is not a file")
            env[ENV_CHANNELS_FILE] = str(Path(self.channels_file).resolve())
        if self.channel_budget:
            env[ENV_CHANNEL_BUDGET] = self.channel_budget
        if self.activation_dtype:
            env[ENV_ACTIVATION_DTYPE] = self.activation_dtype
        if self.ignore is not None:
            env[ENV_IGNORE] = ",".join(self.ignore)
        return env

    def llm_factory(self, llm_cls):
        """``llm_cls`` (``vllm.LLM``) with FourSight's arguments over the ones TRL passes."""
        if self.checkpoint is not None and not (Path(self.checkpoint) / "config.json").is_file():
            raise ValueError(f"foursight.checkpoint: {self.checkpoint} has no config.json")

        def build(*args, **kwargs):
            if kwargs.get("quantization") not in (None, "foursight"):
                raise ValueError(f"rollout='foursight' cannot serve a {kwargs['quantization']!r} learner (TRL chose it from the model's layers)")
            kwargs["quantization"] = "foursight"
            if self.checkpoint is not None:
                kwargs["model"] = str(self.checkpoint)
            eager = self.enforce_eager
            if eager is None:
                from vllm.platforms import current_platform

                eager = True if current_platform.is_cpu() else None
            if eager is not None:
                kwargs["enforce_eager"] = eager
            kwargs.update(self.llm_kwargs)
            return llm_cls(*args, **kwargs)

        return build


@contextmanager
def foursight_vllm(rollout: FourSightRollout, mode: str) -> Iterator[None]:
    """While TRL builds its vLLM side, have it build FourSight's.

    TRL 1.16 builds both in ``trl.generation.vllm_generation.VLLMGeneration._init_vllm``, from that
    module's names ``LLM`` (colocate) and ``VLLMClient`` (server); nothing in ``GRPOConfig`` reaches
    ``quantization`` or ``enforce_eager``. For the duration of the trainer's construction only, those
    two names are FourSight's (:meth:`FourSightRollout.llm_factory`, :class:`FourSightVLLMClient`)
    and the engine's ``FOURSIGHT_*`` variables are set; everything is restored on exit.
    ``tests/test_trl_grpo.py`` checks TRL still builds them there.
    """
    import trl.generation.vllm_generation as vg

    saved = {"LLM": getattr(vg, "LLM", None), "VLLMClient": vg.VLLMClient}
    env = rollout.engine_env() if mode == "colocate" else {}
    old_env = {k: os.environ.get(k) for k in env}
    try:
        if mode == "colocate":
            if saved["LLM"] is None:
                raise ImportError("rollout='foursight' needs vLLM (pip install -e '.[vllm]')")
            vg.LLM = rollout.llm_factory(saved["LLM"])
            os.environ.update(env)
        elif mode == "server":
            from foursight.trainer_bridge.trl_client import FourSightVLLMClient

            vg.VLLMClient = functools.partial(FourSightVLLMClient, api_key=rollout.api_key, weights_dir=rollout.weights_dir,
                                              upload=rollout.upload)
        else:
            raise ValueError(f"GRPOConfig.vllm_mode must be 'colocate' or 'server', got {mode!r}")
        yield
    finally:
        for k, v in saved.items():
            if v is not None:
                setattr(vg, k, v)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_foursight_engine(trainer: Any) -> None:
    """Raise ``RuntimeError`` unless TRL's colocated engine serves FourSight layers (a TRL upgrade
    that builds its ``LLM`` elsewhere must not silently give BF16 rollouts)."""
    gen = getattr(trainer, "vllm_generation", None)
    llm = getattr(gen, "llm", None)
    if llm is None:
        return
    q = llm.llm_engine.model_config.quantization
    if q != "foursight":
        raise RuntimeError(f"TRL's colocated vLLM engine was built with quantization={q!r}, not 'foursight': "
                           "this TRL version builds its LLM outside trl.generation.vllm_generation.LLM")


def _make_trainer_class():
    trl_version_warning_once()
    from trl import GRPOTrainer

    class FourSightGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` with FourSight rollouts and a FourSight TIM-aware sequence filter.

        Extra keyword arguments:

        * ``rollout``: ``"vllm"`` (TRL's engine as configured) or ``"foursight"``: TRL's colocated
          vLLM is built with ``quantization="foursight"`` (and ``enforce_eager`` on the CPU build),
          or, in server mode, TRL's client syncs weights through a FourSight bridge
          (:class:`FourSightVLLMClient`). TRL's own sync then re-quantizes the engine's layers.
        * ``foursight``: :class:`FourSightRollout` or its dict (checkpoint, channels, bridge key).
        * ``foursight_filter``: a :class:`FilterConfig` or its dict (default: tail_count with
          τ = ln 3 and n = 2, no TIS), or ``False`` to leave TRL's own IS correction in place.
          The filter needs ``use_vllm=True`` and ``vllm_importance_sampling_correction=True``.
        """

        def __init__(self, *args, rollout: Literal["vllm", "foursight"] = "vllm", foursight: FourSightRollout | dict | None = None,
                     foursight_filter: FilterConfig | dict | bool | None = None, **kwargs):
            if rollout not in ("vllm", "foursight"):
                raise ValueError(f"rollout must be 'vllm' or 'foursight', got {rollout!r}")
            if foursight is not None and rollout != "foursight":
                raise ValueError("foursight={...} configures rollout='foursight'; pass rollout='foursight' too")
            rcfg = foursight if isinstance(foursight, FourSightRollout) else FourSightRollout.model_validate(foursight or {})
            if foursight_filter is False:
                cfg = None
            else:
                cfg = foursight_filter if isinstance(foursight_filter, FilterConfig) else FilterConfig.model_validate(foursight_filter or {})
            args_obj = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
            if cfg is not None:
                check_trl_args(args_obj)
            if rollout == "foursight":
                if args_obj is None or not getattr(args_obj, "use_vllm", False):
                    raise ValueError("rollout='foursight' needs GRPOConfig(use_vllm=True)")
                with foursight_vllm(rcfg, args_obj.vllm_mode):
                    super().__init__(*args, **kwargs)
                check_foursight_engine(self)
            else:
                super().__init__(*args, **kwargs)
            self.foursight_rollout = rcfg if rollout == "foursight" else None
            self.foursight_filter = cfg

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.foursight_filter is None:
                return out
            out, metrics = apply_filter_to_trl_batch(out, self.foursight_filter)
            mode = "train" if self.model.training else "eval"
            for k, v in metrics.items():
                self._metrics[mode][f"foursight/{k}"].append(v)
            return out

    return FourSightGRPOTrainer


def check_trl_args(args: Any) -> None:
    """Raise ``ValueError`` naming the GRPOConfig field when the filter cannot take effect."""
    if args is None:
        return
    if not getattr(args, "use_vllm", False):
        raise ValueError("GRPOConfig.use_vllm must be True: the FourSight filter needs the engine's per-token logprobs")
    if not getattr(args, "vllm_importance_sampling_correction", True):
        raise ValueError("GRPOConfig.vllm_importance_sampling_correction must be True: the filter's weights replace TRL's IS ratio")
    if getattr(args, "loss_type", None) == "vespo":
        raise ValueError("GRPOConfig.loss_type='vespo' uses the IS ratio inside its loss; the FourSight filter does not support it")


def __getattr__(name: str):
    if name == "FourSightGRPOTrainer":
        cls = _make_trainer_class()
        globals()[name] = cls
        return cls
    if name == "FourSightVLLMClient":
        from foursight.trainer_bridge.trl_client import FourSightVLLMClient

        return FourSightVLLMClient
    raise AttributeError(name)
