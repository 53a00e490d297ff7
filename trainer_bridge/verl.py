"""verl integration: a FourSight filter in place of verl's rollout-correction step.

verl (read at volcengine/verl@b178a3c) computes rollout correction in ``RayPPOTrainer.fit``.
When ``algorithm.rollout_correction`` is set, the batch has ``rollout_log_probs`` (rollout
``calculate_log_probs=True``) and ``bypass_mode`` is off, it calls
``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, cfg)``.
That function returns ``(batch, metrics)`` after it:

* ALWAYS replaces ``batch.batch["response_mask"]`` with the rejection-masked mask;
* adds ``batch.batch["rollout_is_weights"]`` when IS is on (the actor multiplies it into ``pg_losses``);
* returns metrics prefixed ``rollout_corr/``.

:func:`apply_to_verl_batch` does the same with a FourSight :class:`FilterConfig`, and
:func:`install_verl_hook` swaps it in. ``fit`` imports the function at call time, so patching
the module attribute is enough, but it must run in the process that runs ``fit`` (verl's
``TaskRunner`` Ray actor). See docs/verl.md. This module does not import verl.
"""

from __future__ import annotations

from typing import Any

from foursight.trainer_bridge.filters import FilterConfig, apply_filter


def apply_to_verl_batch(batch: Any, config: FilterConfig | dict | None = None) -> tuple[Any, dict[str, float]]:
    """Filter a verl ``DataProto`` in place (anything with a dict-like ``.batch``).

    Reads ``old_log_probs`` [B, T], ``rollout_log_probs`` [B, T] and ``response_mask`` [B, T].
    Writes ``response_mask`` ← ``response_mask · keep`` and, with ``tis_cap``, ``rollout_is_weights``
    [B, T] = min(ρ, cap) on kept tokens. Returns ``(batch, metrics)``; every metric key carries the
    ``rollout_corr/`` prefix, so that verl's logger groups them (``tim/x`` → ``rollout_corr/tim/x``).
    """
    tb = batch.batch
    for key in ("old_log_probs", "rollout_log_probs", "response_mask"):
        if key not in tb.keys():
            raise KeyError(f"verl batch has no {key!r} (set actor_rollout_ref.rollout.calculate_log_probs=True)")
    resp = tb["response_mask"]
    res = apply_filter(tb["old_log_probs"], tb["rollout_log_probs"], resp, config)
    tb["response_mask"] = (resp * res.keep[:, None].to(resp.device)).to(resp.dtype)
    if res.is_weights is not None:
        tb["rollout_is_weights"] = res.is_weights.to(device=resp.device)
    metrics = {}
    for k, v in res.metrics.items():
        metrics[k if k.startswith("rollout_corr/") else f"rollout_corr/{k}"] = v
    return batch, metrics


def install_verl_hook(config: FilterConfig | dict | None = None) -> None:
    """Replace verl's ``compute_rollout_correction_and_add_to_batch`` with the FourSight filter.

    Call in the process that runs ``RayPPOTrainer.fit`` (verl's TaskRunner), before ``fit``.
    verl's own ``rollout_correction`` thresholds are then ignored; only ``config`` applies.
    """
    import verl.trainer.ppo.rollout_corr_helper as helper

    cfg = config if isinstance(config, FilterConfig) else FilterConfig.model_validate(config or {})

    def _foursight(batch, rollout_corr_config=None):  # same signature as verl's function
        return apply_to_verl_batch(batch, cfg)

    helper.compute_rollout_correction_and_add_to_batch = _foursight
