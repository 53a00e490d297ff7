"""GRPO numerics: group-relative advantages and the clipped policy loss over weighted tokens,
whole or in micro-batches (:func:`grpo_loss` with ``normalizer``; :func:`combine_loss_stats`)."""

from __future__ import annotations

import torch

from foursight.rl.config import RLError
from foursight.trainer_bridge.metrics import SAFETY_BOUND


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean (divided by the group's std if ``scale``).

    Args:
        rewards: float [P * G], grouped contiguously (G = ``group_size`` samples per prompt).
    Returns:
        float32 [P * G]; 0 for every sample of a group whose rewards are all equal.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise RLError(f"group_size={group_size} does not divide {rewards.numel()} rewards")
    r = rewards.float().view(-1, group_size)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_eps: float = 0.2,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO policy loss over weighted tokens (PPO surrogate, token-level mean).

    Args:
        logp_new: float [B, T] learner log-probs of the sampled tokens (with grad).
        logp_old: float [B, T] π_old log-probs (here the rollout engine's).
        advantages: float [B] per-sequence advantages.
        weights: float [B, T] per-token loss weights: the filter's loss mask (0 on padding and
            on dropped sequences), or its TIS weights.
        clip_eps: ε of the ratio clip [1−ε, 1+ε].
        logp_ref: optional float [B, T] frozen-reference log-probs for the k3 KL penalty.
        kl_coef: weight of the KL penalty.
        normalizer: the denominator of the token mean; default this batch's ``max(Σ 1[w>0], 1)``.
            A micro-batch of a larger batch passes the whole batch's count of live tokens, so the
            micro-batches' losses (and gradients) add up to the whole batch's.
    Returns:
        (scalar loss, stats). The loss is ``Σ w·(−min(ρA, clip(ρ)A) + β·k3) / max(Σ 1[w>0], 1)``;
        0 (with grad) when every token is masked. The stats are over this call's live tokens;
        their sums (``clipped_tokens``, ``ratio_sum``, ``kl_sum``, ``loss_tokens``) let
        :func:`combine_loss_stats` merge micro-batches.
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != weights.shape:
        raise RLError(f"shape mismatch: logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)}, weights {tuple(weights.shape)}")
    if advantages.shape != logp_new.shape[:1]:
        raise RLError(f"advantages: expected shape [{logp_new.shape[0]}], got {tuple(advantages.shape)}")
    w = weights.to(logp_new.dtype)
    live = w > 0
    old = torch.where(live, logp_old.to(logp_new.dtype), logp_new.detach())
    log_ratio = (logp_new - old).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    a = advantages.to(logp_new.dtype)[:, None]
    s1 = ratio * a
    s2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * a
    per_tok = -torch.minimum(s1, s2)
    kl = torch.zeros_like(per_tok)
    if logp_ref is not None and kl_coef > 0:
        d = (logp_ref.to(logp_new.dtype) - logp_new).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        kl = torch.exp(d) - 1.0 - d
        per_tok = per_tok + kl_coef * kl
    n = live.sum().clamp(min=1) if normalizer is None else max(float(normalizer), 1.0)
    loss = (per_tok * w).sum() / n
    with torch.no_grad():
        sums = {"clipped_tokens": float(((s2 < s1) & live).sum()), "ratio_sum": float((ratio * live).sum()),
                "kl_sum": float((kl * live).sum()), "loss_tokens": float(live.sum())}
    return loss, {"loss": float(loss.detach()), **_fractions(sums), **sums}


def _fractions(sums: dict[str, float]) -> dict[str, float]:
    nl = max(sums["loss_tokens"], 1.0)
    return {"clip_fraction": sums["clipped_tokens"] / nl, "ratio_mean": sums["ratio_sum"] / nl, "kl_ref": sums["kl_sum"] / nl}


def combine_loss_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """The stats of a whole batch from its micro-batches' :func:`grpo_loss` stats (each computed with
    the whole batch's ``normalizer``): the losses add up, the fractions are over all live tokens."""
    sums = {k: sum(p[k] for p in parts) for k in ("clipped_tokens", "ratio_sum", "kl_sum", "loss_tokens")}
    return {"loss": sum(p["loss"] for p in parts), **_fractions(sums), "loss_tokens": sums["loss_tokens"]}
