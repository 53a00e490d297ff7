"""benchmarks/rl/rl_summary.py on tiny synthetic logs: every number of the table against hand values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers.scripts import load_benchmark

rl_summary = load_benchmark("rl_summary")


def _write(folder: Path, name: str, evals: dict[int, float], steps: list[dict], done: bool = True, kfrac: float = 0.0) -> None:
    lines = [{"type": "config", "channels_k_fraction": kfrac}]
    for s in range(0, max(evals) + 1):
        if s > 0:
            lines.append({"type": "step", "step": s, **steps[s - 1]})
        if s in evals:
            lines.append({"type": "eval", "step": s, "eval_acc": evals[s]})
    if done:
        lines.append({"type": "done", "step": max(evals)})
    (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def _steps(n: int, r: float, filt: float = 0.0, t_sync: float = 0.1) -> list[dict]:
    # step times: the first 3 (warm-up) are 10 s and are excluded from the means
    return [{"reward": 0.5, "tim/abs_log_ratio_mean": r, "tim/k3_mean": r / 10, "filtered_fraction": filt,
             "time/sync": 10.0 if i < 3 else t_sync, "time/rollout": 1.0, "time/score": 0.2, "time/update": 0.3,
             "time/step": 10.0 if i < 3 else t_sync + 1.5} for i in range(n)]


def test_summary_numbers_against_hand_values(tmp_path):
    ev = lambda *a: dict(zip(range(0, 5 * len(a), 5), a))  # noqa: E731  evals at 0, 5, 10, ...
    # BF16 final accuracies 0.8, 0.6, 0.7 -> mean 0.7, target 0.9 * 0.7 = 0.63
    _write(tmp_path, "bf16_s0", ev(0.1, 0.5, 0.7, 0.8), _steps(15, 0.01))
    _write(tmp_path, "bf16_s1", ev(0.1, 0.64, 0.6, 0.6), _steps(15, 0.03))
    _write(tmp_path, "bf16_s2", ev(0.1, 0.3, 0.63, 0.7), _steps(15, 0.02))
    # NVFP4 reaches 0.63 only in seed 0 (at 15); seeds 1, 2 never (counted as the last step, 15)
    _write(tmp_path, "nvfp4_s0", ev(0.1, 0.2, 0.3, 0.65), _steps(15, 0.6))
    _write(tmp_path, "nvfp4_s1", ev(0.1, 0.0, 0.0, 0.0), _steps(15, 0.8))
    _write(tmp_path, "nvfp4_s2", ev(0.1, 0.0, 0.1, 0.2), _steps(15, 0.7), done=False)
    # FourSight + filter reaches at 10, 5 and 10
    _write(tmp_path, "fs_filter_s0", ev(0.1, 0.4, 0.7, 0.7), _steps(15, 0.4, filt=0.2), kfrac=0.03)
    _write(tmp_path, "fs_filter_s1", ev(0.1, 0.63, 0.7, 0.7), _steps(15, 0.5, filt=0.1), kfrac=0.03)
    _write(tmp_path, "fs_filter_s2", ev(0.1, 0.5, 0.9, 0.7), _steps(15, 0.3, filt=0.3), kfrac=0.03)
    (tmp_path / "unrelated.jsonl").write_text("{}\n")  # not <config>_s<seed>: ignored
    s = rl_summary.summarise(rl_summary.load_runs(tmp_path))
    assert s["ref_final_acc"] == pytest.approx(0.7) and s["target_acc"] == pytest.approx(0.63)
    b, n, f = s["configs"]["bf16"], s["configs"]["nvfp4"], s["configs"]["fs_filter"]
    # BF16 reaches 0.63 at 10 (s0: 0.7 at 10), 5 (s1: 0.64), 10 (s2: 0.63 = target counts)
    assert b["steps_to_target_per_seed"] == {"0": 10, "1": 5, "2": 10}
    assert b["steps_to_target_mean"] == pytest.approx(25 / 3)
    assert b["steps_to_target_spread"] == pytest.approx(math.sqrt(((10 - 25 / 3) ** 2 * 2 + (5 - 25 / 3) ** 2) / 2))
    assert b["final_acc_mean"] == pytest.approx(0.7) and b["final_acc_spread"] == pytest.approx(0.1)
    assert n["reached"] == 1 and n["steps_to_target_mean"] == 15 and n["steps_to_target_spread"] == 0.0
    assert n["done"] == 2 and n["last_step"] == 15
    # ratio vs NVFP4: NVFP4 did not reach in 2 seeds -> no ratio (n/a), not a bound read off the last step
    assert f["steps_to_target_mean"] == pytest.approx(25 / 3)
    assert f["ratio_vs_base"] is None and n["ratio_vs_base"] is None
    # mean |r| per step: seeds 0.4, 0.5, 0.3 -> 0.4 ± 0.1; filtered 0.2 ± 0.1
    assert f["tim_abs_log_ratio_mean"] == pytest.approx(0.4) and f["tim_abs_log_ratio_spread"] == pytest.approx(0.1)
    assert f["filtered_fraction_mean"] == pytest.approx(0.2) and f["filtered_fraction_spread"] == pytest.approx(0.1)
    assert f["k3_mean"] == pytest.approx(0.04) and f["channels_k_fraction"] == 0.03
    # times: warm-up steps (10 s) excluded -> sync 0.1, step 1.6
    assert f["t_sync"] == pytest.approx(0.1) and f["t_step"] == pytest.approx(1.6) and f["t_generate"] == pytest.approx(1.0)  # v1 name read
    md = rl_summary.to_markdown(s)
    assert "≥" not in md and "| n/a |" in md and "8.3 ± 2.9" in md and "**0.630**" in md
    # every base seed reaching: an exact ratio
    _write(tmp_path, "nvfp4_s1", ev(0.1, 0.0, 0.0, 0.65), _steps(15, 0.8))
    _write(tmp_path, "nvfp4_s2", ev(0.1, 0.0, 0.7, 0.7), _steps(15, 0.7))
    s = rl_summary.summarise(rl_summary.load_runs(tmp_path))
    assert s["configs"]["nvfp4"]["steps_to_target_mean"] == pytest.approx(40 / 3)
    assert s["configs"]["bf16"]["ratio_vs_base"] == pytest.approx((40 / 3) / (25 / 3))
    # finished runs only: a run whose log does not end in done is left out, by name
    _write(tmp_path, "nvfp4_s2", ev(0.1, 0.0, 0.7, 0.7), _steps(15, 0.7), done=False)
    left: list[str] = []
    runs = rl_summary.load_runs(tmp_path, finished_only=True, unfinished=left)
    assert left == ["nvfp4_s2"] and sorted(runs["nvfp4"]) == [0, 1] and sorted(runs["bf16"]) == [0, 1, 2]


def test_sign_flip_test_by_enumeration():
    """The exact paired sign-flip p against hand enumeration."""
    p = rl_summary.sign_flip_p
    assert p([]) is None
    assert p([0.2, 0.1, 0.3]) == pytest.approx(2 / 8)  # all positive: only the all-+ and all-- assignments reach |0.6|
    # (+.3, -.1, +.2): |sum| = 0.4; of the 8 assignments |sum| >= 0.4 for (.3,.1,.2)->.6, (.3,-.1,.2)->.4 and negatives: 4
    assert p([0.3, -0.1, 0.2]) == pytest.approx(4 / 8)
    assert p([0.1] * 6) == pytest.approx(2 / 64)
    assert p([0.0, 0.0]) == 1.0


def test_reading_follows_the_preregistered_rule():
    """supported / contradicted only at p <= 0.05 with the mean's sign; fewer seeds than planned say so."""
    r = rl_summary.reading
    p6 = rl_summary.sign_flip_p([0.1] * 6)  # 2/64
    assert r(0.1, p6, 6) == "supported" and r(-0.1, p6, 6) == "contradicted"
    assert r(0.1, rl_summary.sign_flip_p([0.1, 0.2, -0.05, 0.1, 0.1, 0.1]), 6) == "not resolved"
    assert r(0.04, rl_summary.sign_flip_p([0.04] * 5), 5) == "not resolved (5 of 6 seeds)"  # 5 seeds: p >= 1/16
    assert r(None, None, 0) == "n/a" and r(0.1, 0.05, 6) == "supported" and r(0.1, 0.0501, 6) == "not resolved"


def test_primary_contrasts_paired_auc(tmp_path):
    """The pre-registered contrasts: per-seed AUC differences over steps 0..upto, only seeds where both
    runs finished, with the sign-flip p; a missing arm gives n = 0, not an error."""
    ev = lambda *a: dict(zip(range(0, 3 * len(a), 3), a))  # noqa: E731  evals at 0, 3, 6
    st = [{"reward": 0.0, "time/step": 1.0}] * 6
    for sd, (a_fs, a_nv) in enumerate([((0.5, 0.6, 0.7), (0.5, 0.4, 0.3)), ((0.5, 0.5, 0.5), (0.5, 0.5, 0.6)),
                                       ((0.5, 0.7, 0.9), (0.5, 0.5, 0.5))]):
        _write(tmp_path, f"fs_comp_s{sd}", ev(*a_fs), st)
        _write(tmp_path, f"nvfp4_s{sd}", ev(*a_nv), st)
    _write(tmp_path, "nvfp4_s3", ev(0.5, 0.5, 0.5), st)  # no fs_comp seed 3: not paired
    pr = rl_summary.primary(rl_summary.load_runs(tmp_path), upto=6)
    c = pr["contrasts"]["fs_comp - nvfp4"]
    # AUC = (3*(a0+a1)/2 + 3*(a1+a2)/2) / 6 = (a0 + 2 a1 + a2) / 4
    want = [(0.5 + 1.2 + 0.7) / 4 - (0.5 + 0.8 + 0.3) / 4, (0.5 + 1.0 + 0.5) / 4 - (0.5 + 1.0 + 0.6) / 4,
            (0.5 + 1.4 + 0.9) / 4 - (0.5 + 1.0 + 0.5) / 4]
    assert c["n"] == 3 and [c["per_seed"][k] for k in ("0", "1", "2")] == pytest.approx(want)
    assert c["mean"] == pytest.approx(sum(want) / 3) and c["positive_seeds"] == 2
    assert c["p"] == pytest.approx(rl_summary.sign_flip_p(want))
    assert c["reading"] == "not resolved (3 of 6 seeds)"
    assert pr["contrasts"]["fs_filter - fs_comp"]["n"] == 0 and pr["contrasts"]["fs_filter - fs_comp"]["p"] is None


def test_torn_line_and_resumed_evals(tmp_path):
    """A killed run's torn last line is dropped; a step re-evaluated after a resume counts once (the last)."""
    p = tmp_path / "bf16_s0.jsonl"
    recs = [{"type": "config"}, {"type": "eval", "step": 0, "eval_acc": 0.1}, {"type": "eval", "step": 5, "eval_acc": 0.2},
            {"type": "resume", "step": 5}, {"type": "eval", "step": 5, "eval_acc": 0.4}]
    p.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"type": "st')
    r = rl_summary.read_log(p)
    assert r["evals"] == [(0, 0.1), (5, 0.4)] and not r["done"]


def test_statistics_auc_bootstrap_and_paired_differences(tmp_path):
    """AUC (trapezoid / steps) and accuracy at the common step by hand; the bootstrap interval holds
    the mean and lies within the seeds' range; paired differences are per seed; health means over steps."""
    ev = lambda *a: dict(zip(range(0, 10 * len(a), 10), a))  # noqa: E731  evals at 0, 10, 20
    st = lambda kl, flips: [{"reward": 0.5, "rollout_corr/kl": kl, "follow/code_flip_fraction": flips, "reward_kept": 0.6,  # noqa: E731
                             "reward_dropped": None, "time/step": 1.0} for _ in range(20)]
    _write(tmp_path, "bf16_s0", ev(0.1, 0.3, 0.5), st(0.01, 0.0))
    _write(tmp_path, "bf16_s1", ev(0.1, 0.5, 0.7), st(0.03, 0.0))
    _write(tmp_path, "nvfp4_s0", ev(0.1, 0.1, 0.0), st(0.5, 1e-3))
    _write(tmp_path, "nvfp4_s1", ev(0.1, 0.2, 0.4), st(0.7, 3e-3))
    _write(tmp_path, "nvfp4_s2", ev(0.1, 0.2, 0.4, 0.5), st(0.7, 3e-3) + st(0.7, 3e-3)[:10])  # longer: compared at 20
    runs = rl_summary.load_runs(tmp_path)
    out = rl_summary.statistics(runs)
    assert out["step"] == 20
    b, n = out["configs"]["bf16"], out["configs"]["nvfp4"]
    # AUC of (0, .1) (10, .3) (20, .5): (10*(.1+.3)/2 + 10*(.3+.5)/2) / 20 = 0.3; seed 1: 0.45
    assert b["auc"]["per_seed"] == {"0": pytest.approx(0.3), "1": pytest.approx(0.45)}
    assert b["acc"]["mean"] == pytest.approx(0.6)
    lo, hi = b["acc"]["ci"]
    assert 0.5 <= lo <= 0.6 <= hi <= 0.7
    assert n["acc"]["per_seed"] == {"0": 0.0, "1": 0.4, "2": 0.4}
    d = n["paired"]["acc_minus_bf16"]
    assert d["per_seed"] == {"0": pytest.approx(-0.5), "1": pytest.approx(-0.3)} and d["n"] == 2 and d["positive_seeds"] == 0
    assert d["mean"] == pytest.approx(-0.4) and d["ci"][0] <= -0.4 <= d["ci"][1]
    assert b["kl"] == pytest.approx(0.02) and n["code_flip_fraction"] == pytest.approx((1e-3 + 3e-3 + 3e-3) / 3)
    assert b["reward_kept"] == pytest.approx(0.6) and b["reward_dropped"] is None
    assert rl_summary.bootstrap_ci([0.3]) == (0.3, 0.3) and rl_summary.bootstrap_ci([]) == (None, None)
    assert "| NVFP4 (k=0) | 3 |" in rl_summary.stats_markdown(out)


def test_timing_medians_and_sync_share(tmp_path):
    steps = [{"time/sync": s, "time/generate": 2.0, "time/score": 0.1, "time/filter": 0.05, "time/learn": 0.3, "time/step": s + 2.45}
             for s in (9.0, 9.0, 9.0, 0.5, 0.6, 0.7)]
    _write(tmp_path, "fs_comp_t0", {0: 0.1, 6: 0.1}, steps)
    t = rl_summary.timing(rl_summary.load_runs(tmp_path, rl_summary._TIMING))["fs_comp"]
    assert t["steps"] == 3 and t["t_sync"] == pytest.approx(0.6) and t["t_step"] == pytest.approx(3.05)
    assert t["sync_share"] == pytest.approx(0.6 / 3.05)
