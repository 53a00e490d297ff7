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

from typing import Any

import torch

from foursight.trainer_bridge.filters import FilterConfig, apply_filter


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


def _make_trainer_class():
    from trl import GRPOTrainer

    class FourSightGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` with a FourSight TIM-aware sequence filter on every generated batch.

        Extra keyword argument ``foursight_filter``: a :class:`FilterConfig` or its dict
        (default: tail_count with τ = ln 3 and n = 2, no TIS). Requires ``use_vllm=True`` and
        ``vllm_importance_sampling_correction=True`` (the default) in ``GRPOConfig``.
        """

        def __init__(self, *args, foursight_filter: FilterConfig | dict | None = None, **kwargs):
            cfg = foursight_filter if isinstance(foursight_filter, FilterConfig) else FilterConfig.model_validate(foursight_filter or {})
            args_obj = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
            check_trl_args(args_obj)
            super().__init__(*args, **kwargs)
            self.foursight_filter = cfg

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
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
    raise AttributeError(name)
