"""verl integration: a FourSight filter in place of verl's rollout-correction step.

verl (0.9.1, installed for tests/test_verl.py) computes rollout correction in its trainers'
advantage step (legacy ``RayPPOTrainer.fit``; the default v1 ``PPOTrainer._compute_advantage``).
When ``algorithm.rollout_correction`` is set, the batch has ``rollout_log_probs`` (rollout
``calculate_log_probs=True``) and ``bypass_mode`` is off, it calls
``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, cfg)``.
That function returns ``(batch, metrics)`` after it:

* ALWAYS replaces ``batch.batch["response_mask"]`` with the rejection-masked mask;
* adds ``batch.batch["rollout_is_weights"]`` when IS is on (the actor multiplies it into ``pg_losses``);
* returns metrics prefixed ``rollout_corr/``.

:func:`apply_to_verl_batch` does the same with a FourSight :class:`FilterConfig`, and
:func:`install_verl_hook` swaps it in, in the helper module and wherever verl bound it by name
(the v1 trainer does at import). It must run in the process that runs the trainer (verl's
``TaskRunner`` Ray actor). See docs/verl.md. Only the hook functions import verl.
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


def install_verl_hook(config: FilterConfig | dict | None = None) -> list[str]:
    """Replace verl's ``compute_rollout_correction_and_add_to_batch`` with the FourSight filter.

    verl 0.9.1 reaches the function two ways: the legacy ``RayPPOTrainer.fit`` imports it from
    ``verl.trainer.ppo.rollout_corr_helper`` at call time, and the default v1 trainer
    (``trainer.use_v1=true``: ``verl.trainer.ppo.v1.trainer_base``) binds it by name when it is
    imported. The hook replaces the helper module's attribute and every already-imported ``verl.*``
    module's binding of the original, so it works before or after the trainer module is imported;
    call it in the process that runs the trainer (verl's ``TaskRunner``), before ``fit()``.
    verl's own ``rollout_correction`` thresholds are then ignored; only ``config`` applies.
    Calling it again replaces the previous FourSight hook. Returns the modules it rebound.
    """
    import sys

    import verl.trainer.ppo.rollout_corr_helper as helper

    cfg = config if isinstance(config, FilterConfig) else FilterConfig.model_validate(config or {})
    current = helper.compute_rollout_correction_and_add_to_batch
    original = getattr(current, "__foursight_original__", current)

    def _foursight(batch, rollout_corr_config=None):  # same signature as verl's function
        return apply_to_verl_batch(batch, cfg)

    _foursight.__foursight_original__ = original
    targets = {original, current}
    rebound = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "verl" or name.startswith("verl.")):
            continue
        if getattr(mod, "compute_rollout_correction_and_add_to_batch", None) in targets:
            setattr(mod, "compute_rollout_correction_and_add_to_batch", _foursight)
            rebound.append(name)
    return sorted(rebound)


def uninstall_verl_hook() -> None:
    """Put verl's own function back wherever :func:`install_verl_hook` rebound it."""
    import sys

    import verl.trainer.ppo.rollout_corr_helper as helper

    current = helper.compute_rollout_correction_and_add_to_batch
    original = getattr(current, "__foursight_original__", None)
    if original is None:
        return
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "verl" or name.startswith("verl.")) and getattr(mod, "compute_rollout_correction_and_add_to_batch", None) is current:
            setattr(mod, "compute_rollout_correction_and_add_to_batch", original)
