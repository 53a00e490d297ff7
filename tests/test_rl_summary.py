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


def test_t_quantile_and_interval_against_tables():
    """Student's t quantiles against printed tables (df 5: 2.5706, df 13: 2.1604, df 1: 12.706), and the
    t interval of a mean as mean ± t · sd / sqrt(n) (study v3's six seeds under-cover with the bootstrap)."""
    q = rl_summary.t_quantile
    assert q(0.975, 5) == pytest.approx(2.570582, abs=1e-5)
    assert q(0.975, 13) == pytest.approx(2.160369, abs=1e-5)
    assert q(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert q(0.5, 7) == pytest.approx(0.0, abs=1e-6) and q(0.025, 5) == pytest.approx(-2.570582, abs=1e-5)
    xs = [0.1, 0.3, -0.2, 0.05, 0.4, 0.0]
    m = sum(xs) / 6
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 5)
    lo, hi = rl_summary.t_interval(xs)
    assert lo == pytest.approx(m - 2.570582 * sd / math.sqrt(6), abs=1e-6)
    assert hi == pytest.approx(m + 2.570582 * sd / math.sqrt(6), abs=1e-6)
    assert rl_summary.t_interval([0.3]) == (None, None) and rl_summary.t_interval([]) == (None, None)


def test_holm_adjusted_p_by_hand():
    """Holm's step-down adjustment: the smallest p times m, the next times m-1, kept monotone, capped at 1."""
    h = rl_summary.holm
    assert h({"a": 0.01, "b": 0.04}) == {"a": pytest.approx(0.02), "b": pytest.approx(0.04)}
    assert h({"a": 0.03, "b": 0.02}) == {"a": pytest.approx(0.04), "b": pytest.approx(0.04)}  # monotone: a >= b's 0.04
    assert h({"a": 0.6, "b": 0.7, "c": 0.01}) == {"a": pytest.approx(1.0), "b": pytest.approx(1.0), "c": pytest.approx(0.03)}
    assert h({"a": None, "b": 0.02}) == {"a": None, "b": pytest.approx(0.02)}  # an untestable contrast is not counted


def test_sign_flip_power_six_seeds_in_closed_form_and_detectable_effect():
    """With 6 seeds the exact sign-flip test rejects at 0.05 only when all six agree, so its power to detect
    an effect in its own direction under normal differences is Phi(|d|)^6 (d = effect / sd); the Monte
    Carlo power matches it, and 80 % power needs d of about 1.79."""
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    for d in (0.5, 1.0, 1.8, -1.0):
        exact = phi(abs(d)) ** 6
        assert rl_summary.sign_flip_power_closed6(d) == pytest.approx(exact)
        mc = rl_summary.sign_flip_power(d, 1.0, 6, 0.05, reps=4000)
        assert mc == pytest.approx(exact, abs=0.03)
    d80 = rl_summary.detectable_effect(1.0, 6, 0.05, power=0.8, reps=4000)
    assert d80 == pytest.approx(1.79, abs=0.06)
    # more seeds detect smaller effects; a larger alpha too
    assert rl_summary.detectable_effect(1.0, 14, 0.025, reps=2000) < d80


def test_v3_audit_file_is_what_the_script_computes():
    """benchmarks/results/rl/study-v3/audit.json (the figures docs/rl.md and the README quote for issue 51) is what
    rl_v3_audit.py computes from the committed logs today, but for the commit it names."""
    audit = load_benchmark("rl_v3_audit")
    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "rl" / "study-v3"
    committed = json.loads((folder / "audit.json").read_text())
    fresh = json.loads(json.dumps(audit.audit(folder)))  # tuples -> lists, as in the file
    for r in (committed, fresh):
        r.pop("commit"), r.pop("command")
    assert fresh == committed


def test_the_printed_summary_commands_regenerate_the_committed_files(tmp_path):
    """Issue 53: every summary command docs/rl.md prints rewrites the committed summary.md, summary.json, curves.png
    and step_time.png byte for byte: study v3's with today's rl_summary.py, the older folders' with the script of
    the commit that wrote them (``git show C:benchmarks/rl_summary.py``). Run on a copy with those files removed,
    so a command that writes nothing fails too."""
    import re
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "rl.md").read_text()
    old = re.findall(r"git show (\w+):benchmarks/rl_summary\.py > (\S+) && \.venv/bin/python \2 (benchmarks/results/rl/[\w.-]+)", doc)
    new = re.findall(r"\.venv/bin/python benchmarks/rl/rl_summary\.py (benchmarks/results/rl/study-v3)\b", doc)
    assert len(old) == 3 and new, (old, new)
    if shutil.which("git") is None or subprocess.run(["git", "cat-file", "-e", old[0][0]], cwd=root, capture_output=True).returncode:
        pytest.skip("needs the git history of the repository")
    jobs = []
    for commit, _, folder in old:
        script = tmp_path / f"rl_summary_{commit}.py"
        script.write_text(subprocess.run(["git", "show", f"{commit}:benchmarks/rl_summary.py"], cwd=root, capture_output=True,
                                         text=True, check=True).stdout)
        jobs.append((script, folder))
    jobs += [(root / "benchmarks" / "rl" / "rl_summary.py", f) for f in set(new)]
    for script, folder in jobs:
        copy = tmp_path / Path(folder).name
        shutil.copytree(root / folder, copy)
        names = ("summary.md", "summary.json", "curves.png", "step_time.png")
        for n in names:
            (copy / n).unlink()
        subprocess.run([sys.executable, str(script), str(copy)], check=True, capture_output=True)
        for n in names:
            assert (copy / n).read_bytes() == (root / folder / n).read_bytes(), f"{folder}/{n} differs"


def _write_v4(folder: Path, name: str, accs: list[float], extra: dict | None = None, step1: dict | None = None) -> None:
    """A finished v4 log: evals at 0, 3, ..., 30 with ``accs`` (and ``extra`` fields per eval), step 1's record."""
    lines = [{"type": "config"}]
    for i, a in enumerate(accs):
        s = 3 * i
        if s:
            lines.append({"type": "step", "step": s - 2, **(step1 or {}), "filtered_fraction": 0.0})
        lines.append({"type": "eval", "step": s, "eval_acc": a, **{k: v[i] for k, v in (extra or {}).items()}})
    lines.append({"type": "done", "step": 30})
    (folder / f"{name}.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_v4_primary_p1_p2_holm_and_readings(tmp_path):
    """Study v4's pre-registered analysis on synthetic logs: P1 (fs_filter - nvfp4, AUC 0-30) positive in all 14
    seeds -> exact p 2/2^14, Holm's adjusted p 2x that, supported; P2 (fs_filter - nvfp4_carve, AUC 0-12) a wash ->
    not resolved, with the 97.5 % t interval's upper end as the bound; AUCs by hand."""
    base = [0.5] * 11
    for sd in range(6, 20):
        fs = [0.5] + [0.8] * 10
        nv = [0.5] + [0.7] * 10
        cv = [0.5] + ([0.9] * 10 if sd % 2 else [0.7] * 10)
        _write_v4(tmp_path, f"fs_filter_s{sd}", fs)
        _write_v4(tmp_path, f"nvfp4_s{sd}", nv)
        _write_v4(tmp_path, f"nvfp4_carve_s{sd}", cv)
    _write_v4(tmp_path, "bf16_s6", base)
    runs = rl_summary.load_runs(tmp_path, finished_only=True)
    p = rl_summary.primary_v4(runs)
    p1, p2 = p["contrasts"]["P1"], p["contrasts"]["P2"]
    # AUC 0-30 of (0, .5), (3, .8), ..., (30, .8): (3 * (.5 + .8) / 2 + 27 * .8) / 30; the difference of two such: .1 * 28.5 / 30
    assert p1["n"] == 14 and p1["per_seed"]["6"] == pytest.approx(0.1 * 28.5 / 30) and p1["positive_seeds"] == 14
    assert p1["p"] == pytest.approx(2 / 2**14) and p1["p_holm"] == pytest.approx(2 * 2 / 2**14)
    assert p1["reading"] == "supported"
    # P2 over 0-12: odd seeds fs - carve = -.1 * 10.5 / 12, even seeds +.1 * 10.5 / 12: mean 0
    assert p2["upto"] == 12 and p2["per_seed"]["7"] == pytest.approx(-0.1 * 10.5 / 12) and p2["mean"] == pytest.approx(0, abs=1e-12)
    assert p2["p_holm"] == pytest.approx(1.0)
    hi = p2["ci"][1]
    assert hi == pytest.approx(rl_summary.t_quantile(0.9875, 13) * p2["sd"] / math.sqrt(14))
    assert p2["reading"] == f"not resolved (the effect is at most {hi:+.3f} AUC)"
    md = rl_summary.v4_markdown(p, rl_summary.secondary_v4(runs))
    assert "| P1: fs_filter - nvfp4, AUC 0-30 | 14 |" in md and "supported" in md


def test_v4_secondaries_by_hand(tmp_path):
    """Late mean over evals 15-30, drops (an eval >= 0.10 below the run's best earlier one), late collapses, step 1's
    mismatch and filter dose, and the engine's and the sampled accuracy's AUC and step-30 value."""
    drop = [0.5, 0.6, 0.98, 0.97, 0.99, 0.85, 0.9, 0.95, 0.97, 0.96, 0.85]  # drop at step 15 (0.99 -> 0.85), collapse at 30
    steady = [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.92]
    eng = {"engine_eval_acc": [0.4] * 11, "eval_sampled_acc": [0.1] * 10 + [0.4]}
    s1 = {"tim/abs_log_ratio_mean": 0.4, "tim/k3_mean": 0.2, "tim/tail_seq_fraction": 0.7, "tim/tail_share_worst_5pct": 0.25,
          "filter/tau": 0.6}
    _write_v4(tmp_path, "fs_filter_s6", drop, eng, s1)
    _write_v4(tmp_path, "fs_filter_s7", steady, dict(eng, **{"mem/peak_reserved_gib": [7.5] * 10 + [9.25]}), s1)
    sec = rl_summary.secondary_v4(rl_summary.load_runs(tmp_path))["fs_filter"]
    assert sec["drop_seeds"] == [6] and sec["late_collapse_seeds"] == [6]
    assert sec["late_mean"] == pytest.approx((sum(drop[5:]) / 6 + sum(steady[5:]) / 6) / 2)
    assert sec["step1_abs_r"] == 0.4 and sec["step1_tau"] == 0.6 and sec["step1_filtered"] == 0.0
    assert sec["engine_auc"] == pytest.approx(0.4) and sec["engine_at_30"] == 0.4
    assert sec["sampled_auc"] == pytest.approx((27 * 0.1 + 3 * 0.25) / 30) and sec["sampled_at_30"] == 0.4
    assert sec["peak_reserved_gib_max"] == 9.25  # an eval's peak counts


def test_v4_power_holm_matches_the_scalar_rule():
    """rl_v4_power's vectorised Holm decision equals rl_summary.holm draw by draw, and with no effect each contrast is
    detected at about its share of alpha (a check that can fail: a Bonferroni-free test would detect ~2.5 % each)."""
    import numpy as np

    pw = load_benchmark("rl_v4_power")
    rng = np.random.default_rng(1)
    z = rng.standard_normal((300, 14, 2))
    p = np.stack([rl_summary.sign_flip_p_batch(z[..., k]) for k in range(2)], 1)
    lo, hi = p.min(1, keepdims=True), p.max(1, keepdims=True)
    vec = np.where(p == lo, 2 * lo, np.maximum(2 * lo, hi))
    for row, v in zip(p, vec):
        h = rl_summary.holm({"a": float(row[0]), "b": float(row[1])})
        assert [h["a"], h["b"]] == pytest.approx(np.minimum(1.0, v).tolist())
    null = pw.holm_power(np.zeros(2), np.ones(2), 0.3, 14, 0.05, 4000)
    assert all(x < 0.03 for x in null["power"])  # one direction of two, Holm at 0.05: about 0.0125-0.025 each
