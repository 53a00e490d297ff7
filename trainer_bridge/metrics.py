"""Training-inference mismatch (TIM) metrics: framework-free torch with padding masks.

Conventions (shared by every function here, :mod:`foursight.trainer_bridge.filters` and the docs):

* ``logp_train`` and ``logp_rollout`` are float tensors [B, T] holding, for each sequence ``b``
  and response position ``t``, the log-probability of the *sampled* token under the learner
  (train) policy and under the rollout engine. ``mask`` is [B, T] (bool or 0/1), 1 on valid
  response tokens, 0 on padding. Values at padded positions are ignored (they may be NaN).
* ``r = logp_train - logp_rollout`` (the per-token log importance ratio, ``log ρ`` with
  ``ρ = π_train / π_rollout``), the same sign as verl's ``log_ratio``.
* Token estimators (verl's definitions): ``k1 = -r``, ``k2 = r²/2``, ``k3 = ρ - 1 - log ρ``
  (= ``exp(r) - 1 - r``). Their masked means estimate KL(π_rollout ‖ π_train) on rollout samples.
* Exponentials are taken of ``r`` clamped to ±:data:`SAFETY_BOUND` (verl's bound), so no
  ``tim/*`` metric overflows; every statistic listed in docs/tim.md is computed in float64.
* Sequence-level statistics are averaged over sequences that have at least one valid token;
  an empty sequence (all padding) is ignored by sequence averages and never "drifted".
* The ``rollout_corr/*`` names are verl's, so they carry verl 0.9.1's values exactly (its
  ``compute_offpolicy_metrics`` and token-level ``compute_is_metrics``, cap = ``is_cap``): there
  sequence averages count every row and k3 / the perplexities are not clamped, as in verl
  (tests/test_verl.py compares every shared name against verl's own function).

See docs/tim.md for each metric's definition and the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from foursight.trainer_bridge.filter_options import DEFAULT_TAIL_THRESHOLD  # ln 3, defined without torch for the command lines

#: |log ratio| bound before exponentiating (exp(20) ≈ 4.9e8), as in verl's rollout_corr_helper.
SAFETY_BOUND = 20.0
#: Default token IS cap used for the IS-weight statistics (TRL's default clip_max).
DEFAULT_IS_CAP = 3.0


class TIMError(ValueError):
    """Bad input to a TIM metric or filter; the message names the argument."""


def check_inputs(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the three [B, T] inputs and return (logp_train f64, logp_rollout f64, mask bool).

    Raises :class:`TIMError` naming the argument on a shape mismatch, a non-2-D input, or a
    non-finite value at a valid (unmasked) position.
    """
    for name, t in (("logp_train", logp_train), ("logp_rollout", logp_rollout), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TIMError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise TIMError(f"{name}: expected shape [B, T], got {tuple(t.shape)}")
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise TIMError(
            f"shape mismatch: logp_train {tuple(logp_train.shape)}, logp_rollout {tuple(logp_rollout.shape)}, "
            f"mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    lt = logp_train.detach().to(torch.float64)
    lr = logp_rollout.detach().to(torch.float64)
    for name, t in (("logp_train", lt), ("logp_rollout", lr)):
        bad = m & ~torch.isfinite(t)
        if bool(bad.any()):
            b, pos = (int(i) for i in bad.nonzero()[0])
            raise TIMError(f"{name}: non-finite value {float(t[b, pos])} at valid position [{b}, {pos}]")
    return lt, lr, m


def log_ratio(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``r = logp_train - logp_rollout`` as float64 [B, T], 0 at padded positions."""
    lt, lr, m = check_inputs(logp_train, logp_rollout, mask)
    return torch.where(m, lt - lr, torch.zeros_like(lt))


def token_estimators(r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token-level estimators of [B, T] log ratios ``r``: ``abs``, ``k1``, ``k2``, ``k3``, ``rho``.

    ``rho = exp(clamp(r, ±SAFETY_BOUND))``; ``k3 = rho - 1 - clamp(r)``. Same shape and dtype as ``r``.
    """
    rs = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(rs)
    return {"abs": r.abs(), "k1": -r, "k2": 0.5 * r * r, "k3": rho - 1.0 - rs, "rho": rho}


@dataclass
class SequenceStats:
    """Per-sequence TIM statistics, each float64 [B] (``num_tokens`` and ``tail_count`` int64).

    Attributes:
        num_tokens: valid tokens per sequence.
        max_abs: max |r| over valid tokens (0 for an empty sequence).
        mean: mean r over valid tokens (0 for an empty sequence). Equals −(verl's seq_mean_k1).
        mean_abs: mean |r| over valid tokens (0 for an empty sequence): a length-normalised size of
            the mismatch, which, unlike ``max_abs``, does not grow with the answer's length.
        sum: sum of r over valid tokens (log of the sequence IS ratio; −(verl's seq_sum_k1)).
        geo_mean_ratio: exp(clamp(mean)), the geometric-mean per-token ratio.
        tail_count: number of valid tokens with |r| > τ.
        valid: bool [B], sequence has at least one valid token.
    """

    num_tokens: torch.Tensor
    max_abs: torch.Tensor
    mean: torch.Tensor
    mean_abs: torch.Tensor
    sum: torch.Tensor
    geo_mean_ratio: torch.Tensor
    tail_count: torch.Tensor
    valid: torch.Tensor


def sequence_stats(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    tail_threshold: float = DEFAULT_TAIL_THRESHOLD,
) -> SequenceStats:
    """Per-sequence statistics of ``r`` (see :class:`SequenceStats`); inputs [B, T] as in the module doc."""
    if not tail_threshold >= 0:
        raise TIMError(f"tail_threshold must be >= 0, got {tail_threshold}")
    return ratio_stats(log_ratio(logp_train, logp_rollout, mask), mask.bool(), tail_threshold)


def ratio_stats(r: torch.Tensor, m: torch.Tensor, tail_threshold: float) -> SequenceStats:
    """:func:`sequence_stats` of already-checked inputs: ``r`` float64 [B, T] (0 at padding), ``m`` bool [B, T]."""
    n = m.sum(dim=1)
    valid = n > 0
    s = r.sum(dim=1)
    mean = torch.where(valid, s / n.clamp(min=1).to(r.dtype), torch.zeros_like(s))
    a = r.abs().masked_fill(~m, 0.0)
    max_abs = a.amax(dim=1) if r.shape[1] else torch.zeros_like(s)
    mean_abs = torch.where(valid, a.sum(dim=1) / n.clamp(min=1).to(r.dtype), torch.zeros_like(s))
    tail = ((r.abs() > tail_threshold) & m).sum(dim=1)
    geo = torch.exp(mean.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return SequenceStats(num_tokens=n, max_abs=max_abs, mean=mean, mean_abs=mean_abs, sum=s, geo_mean_ratio=geo, tail_count=tail,
                         valid=valid)


def tail_concentration(tail_count: torch.Tensor, fraction: float, valid: torch.Tensor | None = None) -> float:
    """Share of all tail tokens held by the worst ``fraction`` of sequences.

    The worst sequences are the ``max(1, ceil(fraction * B_valid))`` valid sequences with the most
    tail tokens. Returns a value in [0, 1]; 0.0 when there are no tail tokens (nothing to concentrate).

    Args:
        tail_count: int [B] tail tokens per sequence.
        fraction: in (0, 1].
        valid: optional bool [B]; sequences excluded from the ranking when False.
    """
    if not 0 < fraction <= 1:
        raise TIMError(f"fraction must be in (0, 1], got {fraction}")
    c = tail_count if valid is None else tail_count[valid.bool()]
    total = int(c.sum())
    if total == 0 or c.numel() == 0:
        return 0.0
    k = max(1, math.ceil(fraction * c.numel()))
    top = torch.sort(c, descending=True).values[:k]
    return float(top.sum()) / total


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = int(m.sum())
    return float((x * m).sum() / n) if n else 0.0


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(x[m].max()) if bool(m.any()) else 0.0


def _masked_min(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(x[m].min()) if bool(m.any()) else 0.0


def compute_tim_metrics(
    logp_train: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    tail_threshold: float = DEFAULT_TAIL_THRESHOLD,
    is_cap: float = DEFAULT_IS_CAP,
    prefix_tim: str = "tim/",
    prefix_verl: str = "rollout_corr/",
) -> dict[str, float]:
    """All TIM metrics of a batch as plain floats (docs/tim.md defines each one).

    Args:
        logp_train, logp_rollout: float [B, T] log-probs of the sampled tokens.
        mask: [B, T] valid-token mask.
        tail_threshold: τ; a token is a tail token when |r| > τ.
        is_cap: upper cap of the token IS weights whose statistics are logged (verl's
            ``rollout_is_threshold``; the ``rollout_is_ratio_fraction_low`` bound is 1/is_cap, as in verl).
        prefix_tim, prefix_verl: key prefixes for FourSight's own metrics and for the
            verl-compatible ``rollout_corr/*`` superset.
    Returns:
        dict name -> float. Empty batches (no valid token) give zeros and ``tim/num_tokens = 0``.
    """
    if not is_cap > 1:
        raise TIMError(f"is_cap must be > 1, got {is_cap}")
    if not tail_threshold >= 0:
        raise TIMError(f"tail_threshold must be >= 0, got {tail_threshold}")
    lt, lr, m = check_inputs(logp_train, logp_rollout, mask)
    lt, lr, r = masked_ratio(lt, lr, m)
    return tim_metrics(lt, lr, m, r, ratio_stats(r, m, tail_threshold), tail_threshold, is_cap, prefix_tim, prefix_verl)


def masked_ratio(lt: torch.Tensor, lr: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked inputs with padded positions zeroed (they may hold NaN), and ``r = lt - lr``."""
    lt = torch.where(m, lt, torch.zeros_like(lt))
    lr = torch.where(m, lr, torch.zeros_like(lr))
    return lt, lr, lt - lr


def tim_metrics(lt: torch.Tensor, lr: torch.Tensor, m: torch.Tensor, r: torch.Tensor, st: SequenceStats, tail_threshold: float,
                is_cap: float, prefix_tim: str = "tim/", prefix_verl: str = "rollout_corr/") -> dict[str, float]:
    """:func:`compute_tim_metrics` of already-checked inputs (:func:`check_inputs`, :func:`masked_ratio`)
    and their :func:`ratio_stats`: each quantity computed once per batch."""
    est = token_estimators(r)
    mf = m.to(torch.float64)
    vs = st.valid
    n_tok = int(m.sum())
    out: dict[str, float] = {}
    T, V = prefix_tim, prefix_verl

    # --- token level ------------------------------------------------------------------------
    out[T + "num_tokens"] = float(n_tok)
    out[T + "num_sequences"] = float(int(vs.sum()))
    out[T + "abs_log_ratio_mean"] = _masked_mean(est["abs"], mf)
    out[T + "abs_log_ratio_max"] = _masked_max(est["abs"], m)
    out[T + "log_ratio_mean"] = _masked_mean(r, mf)
    out[T + "k1_mean"] = _masked_mean(est["k1"], mf)
    out[T + "k2_mean"] = _masked_mean(est["k2"], mf)
    out[T + "k3_mean"] = _masked_mean(est["k3"], mf)
    # --- sequence level ---------------------------------------------------------------------
    out[T + "seq_max_abs_log_ratio_mean"] = _masked_mean(st.max_abs, vs.to(torch.float64))
    out[T + "seq_max_abs_log_ratio_max"] = _masked_max(st.max_abs, vs)
    out[T + "seq_mean_log_ratio_mean"] = _masked_mean(st.mean, vs.to(torch.float64))
    out[T + "seq_mean_log_ratio_min"] = _masked_min(st.mean, vs)
    out[T + "seq_mean_log_ratio_max"] = _masked_max(st.mean, vs)
    out[T + "seq_geo_mean_ratio_mean"] = _masked_mean(st.geo_mean_ratio, vs.to(torch.float64))
    out[T + "seq_geo_mean_ratio_min"] = _masked_min(st.geo_mean_ratio, vs)
    out[T + "seq_geo_mean_ratio_max"] = _masked_max(st.geo_mean_ratio, vs)
    # --- tails ------------------------------------------------------------------------------
    tail_total = int(st.tail_count.sum())
    out[T + "tail_threshold"] = float(tail_threshold)
    out[T + "tail_tokens"] = float(tail_total)
    out[T + "tail_token_fraction"] = tail_total / n_tok if n_tok else 0.0
    out[T + "tail_seq_fraction"] = _masked_mean((st.tail_count > 0).to(torch.float64), vs.to(torch.float64))
    out[T + "tail_share_worst_1pct"] = tail_concentration(st.tail_count, 0.01, vs)
    out[T + "tail_share_worst_5pct"] = tail_concentration(st.tail_count, 0.05, vs)

    # --- verl rollout_corr/* (verl 0.9.1's compute_offpolicy_metrics, value for value) ----------
    # verl's conventions, not the tim/* ones: sequence averages run over every row of the batch
    # (an all-padding row counts with mean logprob 0), and k3 and the perplexities are not clamped
    vf = torch.ones_like(vs, dtype=torch.float64)
    allrows = torch.ones_like(vs)
    out[V + "kl"] = _masked_mean(-r, mf)
    out[V + "k3_kl"] = _masked_mean(torch.exp(r) - r - 1.0, mf)
    seq_lp_train = torch.where(vs, (lt * mf).sum(1) / st.num_tokens.clamp(min=1), torch.zeros(1, dtype=lt.dtype))
    seq_lp_roll = torch.where(vs, (lr * mf).sum(1) / st.num_tokens.clamp(min=1), torch.zeros(1, dtype=lt.dtype))
    out[V + "training_ppl"] = _masked_mean(torch.exp(-seq_lp_train), vf)
    out[V + "training_log_ppl"] = _masked_mean(-seq_lp_train, vf)
    out[V + "rollout_ppl"] = _masked_mean(torch.exp(-seq_lp_roll), vf)
    out[V + "rollout_log_ppl"] = _masked_mean(-seq_lp_roll, vf)
    log_ppl_diff = seq_lp_roll - seq_lp_train  # = -mean r per sequence
    out[V + "log_ppl_diff"] = _masked_mean(log_ppl_diff, vf)
    out[V + "log_ppl_abs_diff"] = _masked_mean(log_ppl_diff.abs(), vf)
    out[V + "log_ppl_diff_max"] = _masked_max(log_ppl_diff, allrows)
    out[V + "log_ppl_diff_min"] = _masked_min(log_ppl_diff, allrows)
    out[V + "ppl_ratio"] = _masked_mean(torch.exp(log_ppl_diff), vf)
    out[V + "chi2_token"] = _masked_mean(est["rho"] ** 2, mf) - 1.0 if n_tok else 0.0
    rho2_seq = torch.exp(2.0 * st.sum.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    out[V + "chi2_seq"] = _masked_mean(rho2_seq, vf) - 1.0 if vs.numel() else 0.0
    # token IS weights truncated above at the cap (TIS: verl's rollout_is="token" with
    # rollout_is_threshold=cap): their mean, extremes, spread and effective sample size, as verl
    # 0.9.1's compute_is_metrics computes them (tests/test_verl.py compares every shared name)
    w = est["rho"].clamp(max=is_cap)
    out[V + "rollout_is_mean"] = _masked_mean(w, mf)
    out[V + "rollout_is_max"] = _masked_max(w, m)
    out[V + "rollout_is_min"] = _masked_min(w, m)
    var = _masked_mean(w * w, mf) - out[V + "rollout_is_mean"] ** 2
    out[V + "rollout_is_std"] = math.sqrt(max(var, 0.0)) if n_tok > 1 else 0.0
    out[V + "rollout_is_eff_sample_size"] = effective_sample_size(w, m)
    out[V + "rollout_is_ratio_fraction_high"] = _masked_mean((est["rho"] > is_cap).to(torch.float64), mf)
    out[V + "rollout_is_ratio_fraction_low"] = _masked_mean((est["rho"] < 1.0 / is_cap).to(torch.float64), mf)
    return out


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """Normalized effective sample size ``1 / E[(w / E[w])²]`` over valid tokens, in (0, 1].

    (verl's ``rollout_is_eff_sample_size``; equals ``(Σw)² / (n Σw²)``.) 1.0 for an empty mask.
    """
    m = mask.bool()
    if not bool(m.any()):
        return 1.0
    w = weights.to(torch.float64)[m]
    s2 = float((w * w).sum())
    return float(w.sum()) ** 2 / (w.numel() * s2) if s2 > 0 else 1.0


def abs_diff_summary(a: "list[torch.Tensor] | tuple[torch.Tensor, ...]", b: "list[torch.Tensor] | tuple[torch.Tensor, ...]",
                     quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """The one |Δlogp| summary of two engines' per-sequence logprobs of the same tokens (``a[i]`` and
    ``b[i]`` of equal length), over all tokens, in float64: ``mean``, ``max``, ``p50``/``p90``/``p99``
    (``quantiles``) and ``tokens``. Compare's engine table and pairwise means, its generator
    self-check, the fidelity benchmarks and the tests' engine comparisons all use it. Raises
    :class:`TIMError` naming the sequence whose lengths differ; no tokens give zeros."""
    if len(a) != len(b):
        raise TIMError(f"abs_diff_summary: {len(a)} sequences against {len(b)}")
    parts = []
    for i, (x, y) in enumerate(zip(a, b)):
        x, y = torch.as_tensor(x, dtype=torch.float64).reshape(-1), torch.as_tensor(y, dtype=torch.float64).reshape(-1)
        if x.numel() != y.numel():
            raise TIMError(f"abs_diff_summary: sequence {i} has {x.numel()} tokens against {y.numel()}")
        parts.append((x - y).abs())
    d = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    out = {"mean": float(d.mean()) if d.numel() else 0.0, "max": float(d.max()) if d.numel() else 0.0, "tokens": int(d.numel())}
    for q in quantiles:
        out[f"p{round(q * 100)}"] = float(torch.quantile(d, q)) if d.numel() else 0.0
    return out
