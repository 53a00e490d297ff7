"""TIM-aware sequence filters: exclude drifted sequences from the policy loss.

Four policies decide which sequences to keep, and ``none`` keeps all (inputs [B, T] as in :mod:`.metrics`):

* ``max_token``  — drop a sequence if any valid token has |r| > τ.
* ``mean_abs``   — drop a sequence whose mean |r| over its valid tokens exceeds τ: length-normalised
  (``max_token``'s statistic grows with the answer's length, so at one τ it drops long, complete
  answers first); τ is meant to be fitted on the user's own engine and answer lengths
  (docs/tim.md; ``benchmarks/rl/rl_filter_tau.py`` fits it for the RL study).
* ``tail_count`` — drop a sequence if more than ``n`` valid tokens have |r| > τ.
* ``geo_mean``   — drop a sequence whose mean k1 (= −mean r) lies outside [ln lo, ln hi];
  exactly verl's ``rollout_rs="seq_mean_k1"`` with ``rollout_rs_threshold="lo_hi"``
  (the geometric-mean ratio exp(mean r) must lie in [1/hi, 1/lo]).
* ``quantile``   — drop the ``floor(q · B_valid)`` sequences with the largest max |r|
  (adaptive per batch; ties broken by batch order, lowest index kept first).
* ``none``       — keep everything (metrics only).

Each returns a :class:`FilterResult`: a keep mask [B], a token loss mask [B, T]
(``mask & keep``), optional token-level truncated-IS weights (TIS, ``min(exp(r), cap)``,
zero where the loss mask is zero), and the metrics (``tim/*``, ``rollout_corr/*`` and the
filter's own ``filter/*``). Defaults are justified in docs/tim.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from foursight.trainer_bridge.filter_options import Policy  # defined without torch, for the command lines
from foursight.trainer_bridge.metrics import (
    DEFAULT_IS_CAP,
    DEFAULT_TAIL_THRESHOLD,
    SAFETY_BOUND,
    SequenceStats,
    TIMError,
    check_inputs,
    masked_ratio,
    ratio_stats,
    sequence_stats,
    tim_metrics,
)

log = logging.getLogger("foursight.filters")


def _bounds_text(cfg: "FilterConfig") -> str:
    if cfg.policy == "geo_mean":
        return f"kept: mean k1 in [ln {cfg.geo_lo}, ln {cfg.geo_hi}] = [{math.log(cfg.geo_lo):.4g}, {math.log(cfg.geo_hi):.4g}]"
    if cfg.policy == "tail_count":
        return f"kept: at most {cfg.max_tail_tokens} tokens with |r| > {cfg.tau:.4g}"
    if cfg.policy == "max_token":
        return f"kept: max |r| <= {cfg.tau:.4g}"
    if cfg.policy == "mean_abs":
        return f"kept: mean |r| <= {cfg.tau:.4g}"
    return f"policy {cfg.policy}"


class FilterConfig(BaseModel):
    """Configuration of a TIM-aware sequence filter (pydantic; unknown keys are rejected).

    Attributes:
        policy: which sequences to drop (see the module doc).
        tau: tail threshold τ on |r| for ``max_token``/``tail_count`` and for the tail metrics
            (default ln 3: the token's ratio left [1/3, 3], TRL's default IS cap); for ``mean_abs``
            the bound on a sequence's mean |r| (no default fits every engine: fit it, docs/tim.md).
        max_tail_tokens: ``n`` of ``tail_count`` (drop when a sequence has more than n tail tokens).
        geo_lo, geo_hi: ratio bounds of ``geo_mean`` (verl's geometric preset 0.999_1.001).
        quantile: ``q`` of ``quantile`` in [0, 1) (fraction of sequences dropped per batch).
        tis_cap: if set, token-level truncated IS weights ``min(exp(r), tis_cap)`` are returned
            for the kept tokens (TRL's ``token_truncate`` with clip_max; verl's token TIS).
        is_cap: cap used by the IS-weight *statistics* in the metrics (not by the loss).
    """

    model_config = ConfigDict(extra="forbid")

    policy: Policy = "tail_count"
    tau: float = Field(DEFAULT_TAIL_THRESHOLD, gt=0)
    max_tail_tokens: int = Field(2, ge=0)
    geo_lo: float = Field(0.999, gt=0)
    geo_hi: float = Field(1.001, gt=0)
    quantile: float = Field(0.02, ge=0, lt=1)
    tis_cap: float | None = Field(None, gt=1)
    is_cap: float = Field(DEFAULT_IS_CAP, gt=1)

    @model_validator(mode="after")
    def _bounds(self) -> "FilterConfig":
        if not self.geo_lo < self.geo_hi:
            raise ValueError(f"geo_lo ({self.geo_lo}) must be < geo_hi ({self.geo_hi})")
        return self


@dataclass
class FilterResult:
    """Output of :func:`apply_filter`.

    Attributes:
        keep: bool [B], True for sequences that stay in the update.
        loss_mask: float32 [B, T], ``mask & keep[:, None]``.
        is_weights: float32 [B, T] TIS weights (0 outside ``loss_mask``) or None when TIS is off.
        metrics: dict of floats: ``tim/*``, ``rollout_corr/*`` and ``filter/*``.
        seq_stat: float64 [B], the statistic the policy thresholds (max|r|, mean |r|, tail count, mean k1).
    """

    keep: torch.Tensor
    loss_mask: torch.Tensor
    is_weights: torch.Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)
    seq_stat: torch.Tensor | None = None

    def loss_weights(self) -> torch.Tensor:
        """The per-token factor for the policy loss: ``is_weights`` if TIS is on, else ``loss_mask``."""
        return self.is_weights if self.is_weights is not None else self.loss_mask


def keep_mask(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    config: FilterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sequences a policy keeps. Returns (keep bool [B], the thresholded statistic float64 [B])."""
    return keep_from_stats(sequence_stats(logp_train, logp_rollout, mask, config.tau), config)


def keep_from_stats(st: SequenceStats, config: FilterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`keep_mask` from a batch's :class:`SequenceStats` (computed once by the caller)."""
    p = config.policy
    if p == "none":
        return torch.ones_like(st.valid), st.max_abs
    if p == "max_token":
        stat = st.max_abs
        keep = ~(stat > config.tau)
    elif p == "mean_abs":
        stat = st.mean_abs
        keep = ~(stat > config.tau)
    elif p == "tail_count":
        stat = st.tail_count.to(torch.float64)
        keep = ~(st.tail_count > config.max_tail_tokens)
    elif p == "geo_mean":
        stat = -st.mean.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # mean k1
        keep = (stat >= math.log(config.geo_lo)) & (stat <= math.log(config.geo_hi))
    elif p == "quantile":
        stat = st.max_abs
        keep = torch.ones_like(st.valid)
        idx = st.valid.nonzero().flatten()
        k = int(math.floor(config.quantile * idx.numel()))
        if k:
            # stable sort, descending by max|r|: among ties the later sequence is dropped first
            order = torch.sort(stat[idx].flip(0), descending=True, stable=True).indices
            drop = idx.flip(0)[order[:k]]
            keep[drop] = False
    else:  # pragma: no cover - pydantic restricts the literal
        raise TIMError(f"unknown filter policy {p!r}")
    keep = keep | ~st.valid  # an empty sequence contributes nothing and is never "drifted"
    return keep, stat


def truncated_is_weights(r: torch.Tensor, loss_mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Token TIS weights ``min(exp(clamp(r)), cap) * loss_mask`` as float32 [B, T] (detached)."""
    if not cap > 1:
        raise TIMError(f"tis_cap must be > 1, got {cap}")
    w = torch.exp(r.detach().to(torch.float64).clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=cap)
    return (w * loss_mask.to(torch.float64)).to(torch.float32)


def apply_filter(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    config: FilterConfig | dict | None = None,
) -> FilterResult:
    """Apply a TIM-aware sequence filter (and TIS when ``config.tis_cap`` is set).

    Args:
        logp_train: float [B, T] learner log-probs of the sampled tokens.
        logp_rollout: float [B, T] engine log-probs of the same tokens.
        mask: [B, T] valid response tokens.
        config: a :class:`FilterConfig` (or its dict); default ``FilterConfig()`` (tail_count, τ = ln 3, n = 2).
    Returns:
        :class:`FilterResult`. Metrics are computed on the *unfiltered* batch, plus
        ``filter/kept_seq_fraction``, ``filter/masked_token_fraction``, ``rollout_corr/rollout_rs_masked_fraction``
        and ``rollout_corr/rollout_rs_seq_masked_fraction`` (verl's names) for the dropped part, and
        ``filter/zero_keep_step`` (1.0 when every sequence was dropped: the step trains on nothing;
        a warning is logged on ``foursight.filters`` each time).
    """
    cfg = config if isinstance(config, FilterConfig) else FilterConfig.model_validate(config or {})
    if not cfg.is_cap > 1:
        raise TIMError(f"is_cap must be > 1, got {cfg.is_cap}")
    lt, lr, m = check_inputs(logp_train, logp_rollout, mask)  # validated once; r and the stats computed once
    lt, lr, r = masked_ratio(lt, lr, m)
    tail_tau = DEFAULT_TAIL_THRESHOLD if cfg.policy == "mean_abs" else cfg.tau  # mean_abs's τ bounds a mean, not a token
    st = ratio_stats(r, m, tail_tau)
    keep, stat = keep_from_stats(st, cfg)
    loss_mask = (m & keep[:, None]).to(torch.float32)
    is_w = truncated_is_weights(r, loss_mask, cfg.tis_cap) if cfg.tis_cap is not None else None

    metrics = tim_metrics(lt, lr, m, r, st, tail_tau, cfg.is_cap)
    valid = m.any(dim=1)
    n_valid = int(valid.sum())
    n_tok = int(m.sum())
    dropped = valid & ~keep
    masked_tokens = int((m & ~keep[:, None]).sum())
    metrics["filter/kept_seq_fraction"] = (n_valid - int(dropped.sum())) / n_valid if n_valid else 1.0
    # a step whose filter drops every sequence trains on nothing (zero gradient): say so every time
    zero = bool(n_valid) and int(dropped.sum()) == n_valid
    metrics["filter/zero_keep_step"] = 1.0 if zero else 0.0
    if zero:
        lo, hi = float(stat[valid].min()), float(stat[valid].max())
        log.warning("FourSight filter %s kept 0 of %d sequences: this step trains on nothing (its statistic ranged %.4g..%.4g; "
                    "%s). Loosen the filter: docs/tim.md", cfg.policy, n_valid, lo, hi, _bounds_text(cfg))
    metrics["filter/dropped_sequences"] = float(int(dropped.sum()))
    metrics["filter/masked_token_fraction"] = masked_tokens / n_tok if n_tok else 0.0
    metrics["rollout_corr/rollout_rs_masked_fraction"] = metrics["filter/masked_token_fraction"]
    # verl's name, verl's value: over every row of the batch (an empty row is never dropped)
    metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = int(dropped.sum()) / keep.numel() if keep.numel() else 0.0
    if is_w is not None:
        lm = loss_mask.bool()
        w = is_w.to(torch.float64)[lm]
        metrics["filter/tis_weight_mean"] = float(w.mean()) if w.numel() else 0.0
        raw = torch.exp(r.clamp(-SAFETY_BOUND, SAFETY_BOUND))[lm]
        metrics["filter/tis_clip_fraction"] = float((raw > cfg.tis_cap).to(torch.float64).mean()) if raw.numel() else 0.0
    return FilterResult(keep=keep, loss_mask=loss_mask, is_weights=is_w, metrics=metrics, seq_stat=stat)
