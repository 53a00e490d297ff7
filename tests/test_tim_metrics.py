"""TIM metrics and filters against an independent NumPy re-implementation (hypothesis) and hand values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foursight.trainer_bridge.filters import FilterConfig, apply_filter
from foursight.trainer_bridge.metrics import TIMError, compute_tim_metrics, tail_concentration

SB = 20.0


# ---------------------------------------------------------------------------------------------
# NumPy reference: loops over sequences, written from the definitions in docs/tim.md
# ---------------------------------------------------------------------------------------------
def np_metrics(lt: np.ndarray, lr: np.ndarray, mask: np.ndarray, tau: float, cap: float) -> dict[str, float]:
    seqs = []
    for b in range(lt.shape[0]):
        sel = mask[b].astype(bool)
        if sel.any():
            seqs.append((lt[b][sel].astype(np.float64), lr[b][sel].astype(np.float64)))
    r_all = np.concatenate([a - c for a, c in seqs]) if seqs else np.zeros(0)
    n = r_all.size
    out: dict[str, float] = {}

    def mean(x):
        return float(np.mean(x)) if np.size(x) else 0.0

    rho = np.exp(np.clip(r_all, -SB, SB))
    out["tim/abs_log_ratio_mean"] = mean(np.abs(r_all))
    out["tim/abs_log_ratio_max"] = float(np.max(np.abs(r_all))) if n else 0.0
    out["tim/k1_mean"] = mean(-r_all)
    out["tim/k2_mean"] = mean(0.5 * r_all**2)
    out["tim/k3_mean"] = mean(rho - 1 - np.clip(r_all, -SB, SB))
    seq_max = [float(np.max(np.abs(a - c))) for a, c in seqs]
    seq_mean = [float(np.mean(a - c)) for a, c in seqs]
    seq_tail = [int(np.sum(np.abs(a - c) > tau)) for a, c in seqs]
    out["tim/seq_max_abs_log_ratio_mean"] = mean(seq_max)
    out["tim/seq_mean_log_ratio_mean"] = mean(seq_mean)
    out["tim/seq_geo_mean_ratio_mean"] = mean(np.exp(np.clip(seq_mean, -SB, SB)))
    out["tim/tail_tokens"] = float(sum(seq_tail))
    out["tim/tail_token_fraction"] = sum(seq_tail) / n if n else 0.0
    out["tim/tail_seq_fraction"] = mean([t > 0 for t in seq_tail])
    for frac, key in ((0.01, "tim/tail_share_worst_1pct"), (0.05, "tim/tail_share_worst_5pct")):
        tot = sum(seq_tail)
        if tot == 0:
            out[key] = 0.0
        else:
            k = max(1, math.ceil(frac * len(seq_tail)))
            out[key] = sum(sorted(seq_tail, reverse=True)[:k]) / tot
    # rollout_corr/*: verl 0.9.1's conventions (every row counts, an empty one with mean logprob 0;
    # k3 and the perplexities unclamped; TIS weights truncated above only)
    rows = [(lt[b][mask[b]].astype(np.float64), lr[b][mask[b]].astype(np.float64)) for b in range(lt.shape[0])]
    rmean = lambda x: float(np.mean(x)) if x.size else 0.0  # noqa: E731
    out["rollout_corr/kl"] = mean(np.concatenate([c - a for a, c in seqs]) if seqs else [])
    out["rollout_corr/k3_kl"] = mean(np.exp(r_all) - r_all - 1)
    out["rollout_corr/training_log_ppl"] = mean([-rmean(a) for a, c in rows])
    out["rollout_corr/rollout_log_ppl"] = mean([-rmean(c) for a, c in rows])
    out["rollout_corr/log_ppl_diff"] = mean([rmean(c) - rmean(a) for a, c in rows])
    out["rollout_corr/ppl_ratio"] = mean([np.exp(rmean(c) - rmean(a)) for a, c in rows])
    out["rollout_corr/chi2_token"] = mean(rho**2) - 1 if n else 0.0
    out["rollout_corr/chi2_seq"] = mean([np.exp(2 * np.clip(np.sum(a - c), -SB, SB)) for a, c in rows]) - 1
    w = np.minimum(rho, cap)
    out["rollout_corr/rollout_is_mean"] = mean(w)
    out["rollout_corr/rollout_is_eff_sample_size"] = float(np.sum(w) ** 2 / (n * np.sum(w**2))) if n else 1.0
    out["rollout_corr/rollout_is_ratio_fraction_high"] = mean(rho > cap)
    return out


def np_keep(lt, lr, mask, cfg: FilterConfig) -> np.ndarray:
    B = lt.shape[0]
    keep = np.ones(B, dtype=bool)
    stats = []
    for b in range(B):
        sel = mask[b].astype(bool)
        if not sel.any():
            stats.append(None)
            continue
        r = lt[b][sel].astype(np.float64) - lr[b][sel].astype(np.float64)
        stats.append(r)
        if cfg.policy == "max_token":
            keep[b] = not np.any(np.abs(r) > cfg.tau)
        elif cfg.policy == "tail_count":
            keep[b] = np.sum(np.abs(r) > cfg.tau) <= cfg.max_tail_tokens
        elif cfg.policy == "mean_abs":
            keep[b] = not np.mean(np.abs(r)) > cfg.tau
        elif cfg.policy == "geo_mean":
            k1 = -np.mean(r)
            keep[b] = math.log(cfg.geo_lo) <= k1 <= math.log(cfg.geo_hi)
    if cfg.policy == "quantile":
        valid = [b for b in range(B) if stats[b] is not None]
        k = int(math.floor(cfg.quantile * len(valid)))
        # largest max|r| first; among ties the later index first
        ranked = sorted(valid, key=lambda b: (-float(np.max(np.abs(stats[b]))), -b))
        for b in ranked[:k]:
            keep[b] = False
    return keep


@st.composite
def batches(draw):
    B = draw(st.integers(1, 9))
    T = draw(st.integers(1, 12))
    floats = st.floats(-12.0, 0.0, allow_nan=False, width=32)
    lr = np.array(draw(st.lists(floats, min_size=B * T, max_size=B * T)), dtype=np.float32).reshape(B, T)
    noise = st.one_of(st.just(0.0), st.floats(-3.0, 3.0, allow_nan=False, width=32), st.floats(-0.0009765625, 0.0009765625, width=32))
    d = np.array(draw(st.lists(noise, min_size=B * T, max_size=B * T)), dtype=np.float32).reshape(B, T)
    lt = lr + d
    mask = np.array(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).reshape(B, T)
    # padded positions hold garbage (NaN) that must be ignored
    lt = np.where(mask, lt, np.nan).astype(np.float32)
    return lt, lr, mask


@settings(max_examples=150, deadline=None)
@given(batches(), st.sampled_from([0.05, math.log(2.0), math.log(3.0)]), st.sampled_from([2.0, 3.0]))
def test_metrics_match_numpy(batch, tau, cap):
    lt, lr, mask = batch
    got = compute_tim_metrics(torch.from_numpy(lt), torch.from_numpy(lr), torch.from_numpy(mask), tail_threshold=tau, is_cap=cap)
    ref = np_metrics(lt, lr, mask, tau, cap)
    for k, v in ref.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


@settings(max_examples=150, deadline=None)
@given(
    batches(),
    st.sampled_from(
        [
            FilterConfig(policy="max_token", tau=0.5),
            FilterConfig(policy="mean_abs", tau=0.3),
            FilterConfig(policy="mean_abs", tau=1.0, tis_cap=2.0),
            FilterConfig(policy="tail_count", tau=0.2, max_tail_tokens=1),
            FilterConfig(policy="geo_mean"),
            FilterConfig(policy="geo_mean", geo_lo=0.5, geo_hi=2.0),
            FilterConfig(policy="quantile", quantile=0.3),
            FilterConfig(policy="quantile", quantile=0.5, tis_cap=2.0),
        ]
    ),
)
def test_filters_match_numpy(batch, cfg):
    lt, lr, mask = batch
    res = apply_filter(torch.from_numpy(lt), torch.from_numpy(lr), torch.from_numpy(mask), cfg)
    keep = np_keep(lt, lr, mask, cfg)
    assert res.keep.numpy().tolist() == keep.tolist()
    expected_lm = (mask & keep[:, None]).astype(np.float32)
    np.testing.assert_array_equal(res.loss_mask.numpy(), expected_lm)
    if cfg.tis_cap is not None:
        r = np.where(mask, lt.astype(np.float64) - lr.astype(np.float64), 0.0)
        w = np.minimum(np.exp(np.clip(r, -SB, SB)), cfg.tis_cap) * expected_lm
        np.testing.assert_allclose(res.is_weights.numpy(), w.astype(np.float32), rtol=1e-6)
    else:
        assert res.is_weights is None
    dropped = int((~keep & mask.any(axis=1)).sum())
    assert res.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(dropped / len(keep))  # verl: over every row


def test_mean_abs_is_length_normalised_where_max_token_is_not():
    """Hand values: a long answer with one bad token among many good ones keeps its place under
    mean_abs (mean |r| 0.27) but not under max_token (max |r| 3); a short answer drifted everywhere
    is dropped by mean_abs (0.6 > 0.5) and kept by max_token; negative r counts by its size; padding
    (NaN here) is ignored; the tail metrics keep ln 3 as their threshold."""
    T = 40
    lr = torch.zeros(3, T)
    lt = torch.full((3, T), float("nan"))
    mask = torch.zeros(3, T, dtype=torch.bool)
    lt[0, :4] = torch.tensor([0.1, -0.1, 0.1, 3.0])  # short, one bad token: mean |r| 0.825
    lt[1, :40] = 0.2
    lt[1, 7] = -3.0  # long, one bad token: (39 * 0.2 + 3) / 40 = 0.27
    lt[2, :4] = 0.6  # short, drifted everywhere: 0.6
    mask[0, :4] = mask[1, :40] = mask[2, :4] = True
    ma = apply_filter(lt, lr, mask, FilterConfig(policy="mean_abs", tau=0.5))
    assert ma.keep.tolist() == [False, True, False]
    assert ma.seq_stat.tolist() == pytest.approx([0.825, 0.27, 0.6])
    assert ma.metrics["tim/tail_threshold"] == pytest.approx(math.log(3.0)) and ma.metrics["tim/tail_tokens"] == 2
    mt = apply_filter(lt, lr, mask, FilterConfig(policy="max_token", tau=2.5))
    assert mt.keep.tolist() == [False, False, True]


def test_hand_computed_values():
    # one sequence, r = [ln 2, -ln 2, 0]; padded fourth position
    lr = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    lt = lr + torch.tensor([[math.log(2), -math.log(2), 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    m = compute_tim_metrics(lt, lr, mask, tail_threshold=0.5, is_cap=3.0)
    assert m["tim/num_tokens"] == 3
    assert m["tim/abs_log_ratio_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert m["tim/k1_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["tim/k2_mean"] == pytest.approx(math.log(2) ** 2 / 3)
    # k3 = (2 - 1 - ln2) + (0.5 - 1 + ln2) + 0 = 0.5
    assert m["tim/k3_mean"] == pytest.approx(0.5 / 3)
    assert m["tim/tail_tokens"] == 2 and m["tim/tail_seq_fraction"] == 1.0
    assert m["rollout_corr/chi2_token"] == pytest.approx((4 + 0.25 + 1) / 3 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(0.0, abs=1e-6)
    assert m["tim/seq_geo_mean_ratio_mean"] == pytest.approx(1.0)


def test_tail_concentration_hand():
    tc = torch.tensor([10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] * 5)  # 100 sequences
    # worst 1% = 1 sequence holding 10 of 100 tail tokens; worst 5% = the five 10s = 50 of 100
    assert tail_concentration(tc, 0.01) == pytest.approx(0.10)
    assert tail_concentration(tc, 0.05) == pytest.approx(0.50)
    assert tail_concentration(torch.zeros(7, dtype=torch.long), 0.05) == 0.0


def test_planted_drift_removed_by_each_policy():
    g = torch.Generator().manual_seed(0)
    B, T = 64, 40
    lr = -torch.rand(B, T, generator=g) * 6
    lt = lr + torch.randn(B, T, generator=g) * 1e-4  # near-identical policies
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[::3, 30:] = False
    planted = [5, 17, 42]
    for b in planted:
        lt[b, 3:12] -= 1.5  # a burst of drifted tokens
    for cfg in (
        FilterConfig(policy="max_token"),
        FilterConfig(policy="tail_count", max_tail_tokens=2),
        FilterConfig(policy="geo_mean"),
        FilterConfig(policy="quantile", quantile=3 / 64 + 1e-9),
    ):
        res = apply_filter(lt, lr, mask, cfg)
        assert sorted((~res.keep).nonzero().flatten().tolist()) == planted, cfg.policy
        assert res.loss_mask[planted].sum() == 0
        assert res.metrics["filter/dropped_sequences"] == 3


def test_bad_inputs_name_the_argument():
    with pytest.raises(TIMError, match="logp_rollout"):
        compute_tim_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(TIMError, match="logp_train"):
        compute_tim_metrics(torch.tensor([[float("nan")]]), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="geo_lo"):
        FilterConfig(geo_lo=1.1, geo_hi=1.0)
    with pytest.raises(ValueError, match="polic"):
        FilterConfig(policy="nope")


def test_apply_filter_checks_once_and_agrees_with_the_parts(monkeypatch):
    """One apply_filter call validates its inputs once and computes r and the sequence stats once,
    with the same metrics and keep mask as compute_tim_metrics and keep_mask called separately."""
    from foursight.trainer_bridge import filters, metrics

    g = torch.Generator().manual_seed(0)
    lt = -torch.rand(4, 7, generator=g, dtype=torch.float64) * 3
    lr = lt + torch.randn(4, 7, generator=g, dtype=torch.float64) * 0.8
    m = torch.rand(4, 7, generator=g) > 0.2
    lt[~m] = float("nan")  # padding may hold anything
    cfg = filters.FilterConfig(policy="max_token", tis_cap=2.0)
    calls = {"check": 0, "stats": 0}
    check, stats = metrics.check_inputs, metrics.ratio_stats

    def counted_check(*a):
        calls["check"] += 1
        return check(*a)

    def counted_stats(*a):
        calls["stats"] += 1
        return stats(*a)

    monkeypatch.setattr(filters, "check_inputs", counted_check)
    monkeypatch.setattr(filters, "ratio_stats", counted_stats)
    res = filters.apply_filter(lt, lr, m, cfg)
    assert calls == {"check": 1, "stats": 1}
    monkeypatch.undo()
    ref = metrics.compute_tim_metrics(lt, lr, m, tail_threshold=cfg.tau, is_cap=cfg.is_cap)
    assert {k: v for k, v in res.metrics.items() if k in ref} == ref
    keep, _ = filters.keep_mask(lt, lr, m, cfg)
    assert torch.equal(res.keep, keep)
