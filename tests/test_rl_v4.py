"""Study v4's additions to ``foursight rl`` (issue 51), on the tiny model on the CPU: the evals' new
metrics (the learner's sampled accuracy, the quantized engine's own greedy accuracy) and the filter's
τ fitted online at step 1 by the 0.9-quantile rule."""

from __future__ import annotations

import copy
import json
import zlib

import numpy as np
import pytest
import torch

from foursight.rl import RLConfig, RLError, run_rl
from foursight.rl import tasks as rl_tasks
from foursight.rl.evaluation import generate_answers, score_answers
from foursight.rl.loop import eval_and_log, filter_batch, sample, score
from foursight.rl.run_setup import build_run


def _read(path):
    return [json.loads(line) for line in open(path)]


def _crc_correct(text, problem):
    """A stand-in verifier that depends on every token of the answer (the tiny random model never answers
    right, so the real one would score every policy 0 and compare nothing)."""
    return zlib.crc32(text.encode()) % 2 == 0


def test_engine_eval_is_a_direct_evaluation_of_the_same_weights(tiny_llama_dir, monkeypatch):
    """The eval's ``engine_eval_acc`` is the rollout engine's own greedy accuracy at the learner's current
    weights: equal to a direct evaluation of a fresh quantized copy of those weights (same channel sets), answer
    for answer; an engine left at its last sync would have answered otherwise."""
    from foursight.hf import quantize_hf_model

    monkeypatch.setattr(rl_tasks, "is_correct", _crc_correct)
    cfg = RLConfig(model=str(tiny_llama_dir), rollout_precision="foursight", channels="16", max_new_tokens=5, eval_size=16,
                   eval_engine=True, device="cpu")
    cfg.validate()
    run = build_run(cfg, torch.device("cpu"), None)
    recs = []
    run.emit = recs.append
    try:
        kw = dict(style=cfg.prompt_style, prefill=cfg.prefill, amp=False)
        stale = generate_answers(run.engine.model, run.tok, run.evals, cfg.max_new_tokens, **kw)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the learner moves, as after some steps
            for p in run.learner.parameters():
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
        eval_and_log(run, 5, lambda s: None)
        rec = recs[-1]
        direct = copy.deepcopy(run.learner).to(torch.bfloat16).eval()
        quantize_hf_model(direct, run.channels, ignore=("lm_head",), act_quant=True)
        texts = generate_answers(direct, run.tok, run.evals, cfg.max_new_tokens, **kw)
        want = score_answers(texts, run.evals)
        assert rec["type"] == "eval" and rec["step"] == 5
        assert rec["engine_eval_acc"] == want["acc"] and rec["engine_eval_format"] == want["format"]
        assert 0 < want["acc"] < 1  # the stand-in verifier splits the answers
        assert generate_answers(run.engine.model, run.tok, run.evals, cfg.max_new_tokens, **kw) == texts
        assert texts != stale  # a stale engine (no sync before the eval) would not pass the first check
        learner_texts = generate_answers(run.learner, run.tok, run.evals, cfg.max_new_tokens, style=cfg.prompt_style,
                                         prefill=cfg.prefill)
        assert rec["eval_acc"] == score_answers(learner_texts, run.evals)["acc"]
        assert "eval_sampled_acc" not in rec  # off unless asked for
    finally:
        run.engine.close()


def test_sampled_eval_draws_n_per_question_at_temperature_one(tiny_llama_dir, monkeypatch):
    """``eval_sampled_acc``: n answers per question at T = 1 from a seed of its own: reproducible, different
    from the greedy answers, n x questions of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.rl.evaluation import evaluate_sampled

    calls = []
    monkeypatch.setattr(rl_tasks, "is_correct", lambda t, p: calls.append(t) or _crc_correct(t, p))
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    probs = rl_tasks.eval_set("add", 6)
    a = evaluate_sampled(model, tok, probs, 5, samples=3, seed=11, prefill="Answer:")
    assert len(calls) == 18 and a["eval_sampled_acc"] == sum(map(lambda t: _crc_correct(t, None), calls)) / 18
    assert evaluate_sampled(model, tok, probs, 5, samples=3, seed=11, prefill="Answer:") == a
    sampled = generate_answers(model, tok, probs, 5, samples=3, temperature=1.0, seed=11, prefill="Answer:")
    greedy = generate_answers(model, tok, probs, 5, prefill="Answer:")
    assert len(sampled) == 18 and sampled[:3] != [greedy[0]] * 3


def test_eval_extras_are_logged_and_leave_the_training_steps_unchanged(tmp_path, tiny_llama_dir):
    """With --eval-sampled 2 --eval-engine every eval record carries the learner's sampled accuracy and the
    engine's own greedy accuracy (multiples of 1/(2 x questions) and 1/questions); the extra sync and draws
    change no step of the run (the same rewards, tokens, mismatch and losses as without them)."""
    base = dict(model=str(tiny_llama_dir), rollout_precision="nvfp4", steps=2, prompts_per_step=2, group_size=2,
                max_new_tokens=3, eval_every=1, eval_size=3, device="cpu")
    plain, extra = tmp_path / "plain.jsonl", tmp_path / "extra.jsonl"
    run_rl(RLConfig(**base, out=str(plain)), log=lambda s: None)
    run_rl(RLConfig(**base, out=str(extra), eval_sampled=2, eval_engine=True), log=lambda s: None)
    ev = [r for r in _read(extra) if r["type"] == "eval"]
    assert [r["step"] for r in ev] == [0, 1, 2]
    for r in ev:
        assert round(r["eval_sampled_acc"] * 6, 9) == round(r["eval_sampled_acc"] * 6) and 0 <= r["eval_sampled_acc"] <= 1
        assert round(r["engine_eval_acc"] * 3, 9) == round(r["engine_eval_acc"] * 3) and 0 <= r["engine_eval_acc"] <= 1
        assert r["time/eval_sampled"] > 0 and r["time/eval_engine"] > 0
        assert r["mem/peak_reserved_gib"] is None and r["mem/max_rss_gib"] > 0  # the eval's memory (GPU peak: None on the CPU)
    assert all("engine_eval_acc" not in r for r in _read(plain) if r["type"] == "eval")
    skip = lambda k: k.startswith(("time/", "mem/")) or k == "wall_s"  # noqa: E731
    a = [{k: v for k, v in r.items() if not skip(k)} for r in _read(plain) if r["type"] == "step"]
    b = [{k: v for k, v in r.items() if not skip(k)} for r in _read(extra) if r["type"] == "step"]
    assert a == b


def test_eval_and_tau_fit_options_are_checked():
    for kw, name in [({"eval_sampled": -1}, "--eval-sampled"), ({"filter_tau_fit": 0.9}, "--filter-tau-fit"),
                     ({"filter": "mean_abs", "filter_tau_fit": 1.5}, "--filter-tau-fit"),
                     ({"filter": "mean_abs", "filter_tau_fit": 0.9, "filter_tau": 1.0}, "--filter-tau-fit"),
                     ({"filter": "tail_count", "filter_tau_fit": 0.9}, "--filter-tau-fit"),
                     ({"engine": "vllm", "rollout_precision": "nvfp4", "eval_engine": True}, "--eval-engine")]:
        with pytest.raises(RLError, match=name):
            RLConfig(**kw).validate()
    RLConfig(filter="mean_abs", filter_tau_fit=0.9).validate()
    RLConfig(filter="max_token", filter_tau_fit=0.9).validate()


def test_tau_is_the_quantile_of_the_first_steps_mean_abs_r(tiny_llama_dir):
    """--filter-tau-fit 0.9: τ is the 0.9 quantile (linear interpolation) of step 1's per-sequence mean |r|,
    recomputed here by hand from the rollout and learner log-probs, and the filter drops exactly the sequences
    above it (2 of 20 distinct values: the designed 10 %)."""
    cfg = RLConfig(model=str(tiny_llama_dir), rollout_precision="nvfp4", filter="mean_abs", filter_tau_fit=0.9, prompts_per_step=5,
                   group_size=4, max_new_tokens=4, device="cpu", old_logprobs="learner", tis_cap=2.0)
    cfg.validate()
    run = build_run(cfg, torch.device("cpu"), None)
    run.fcfg = cfg.filter_config()
    try:
        run.engine.sync(run.learner, 1)
        batch = sample(run, 1)
        score(run, batch)
        fres, _, _ = filter_batch(run, batch, 1)
    finally:
        run.engine.close()
    stats = []
    for b, s in enumerate(batch.samples):
        n = len(s.token_ids)
        stats.append(float(np.mean(np.abs(batch.logp_learner[b, :n].double().numpy() - np.asarray(s.logprobs, dtype=np.float64)))))
    assert all(len(s.token_ids) for s in batch.samples) and len(set(stats)) == 20
    tau = float(np.quantile(stats, 0.9))
    assert run.fcfg.tau == pytest.approx(tau, rel=1e-9) and fres.metrics["filter/tau"] == pytest.approx(tau, rel=1e-9)
    assert fres.keep.tolist() == [x <= run.fcfg.tau for x in stats]
    assert int((~fres.keep).sum()) == 2 and fres.metrics["filter/kept_seq_fraction"] == pytest.approx(0.9)


def test_fitted_tau_stays_fixed_and_survives_a_resume(tmp_path, tiny_llama_dir):
    """τ is fitted at step 1 only: later steps log the same ``filter/tau``; a run killed after step 2 and
    resumed from step 1's checkpoint keeps that τ (it is in the checkpoint), so its steps equal the straight run's."""
    base = dict(model=str(tiny_llama_dir), rollout_precision="nvfp4", filter="mean_abs", filter_tau_fit=0.9, steps=3,
                prompts_per_step=5, group_size=2, max_new_tokens=3, eval_every=1, eval_size=2, device="cpu")
    straight = tmp_path / "straight.jsonl"
    run_rl(RLConfig(**base, out=str(straight)), log=lambda s: None)
    st = [r for r in _read(straight) if r["type"] == "step"]
    assert st[0]["filter/tau_fitted"] == 1.0 and st[1]["filter/tau_fitted"] == 0.0
    assert st[0]["filter/tau"] == st[1]["filter/tau"] == st[2]["filter/tau"] > 0
    assert st[0]["filtered_fraction"] == pytest.approx(0.1)  # 1 of 10 sequences above the 0.9 quantile

    class Killed(Exception):
        pass

    def killer(msg):
        if "step    2 eval_acc" in msg:
            raise Killed

    out = tmp_path / "killed.jsonl"
    with pytest.raises(Killed):
        run_rl(RLConfig(**base, out=str(out), checkpoint_every=1), log=killer)
    run_rl(RLConfig(**base, out=str(out), resume=True), log=lambda s: None)
    rs = [r for r in _read(out) if r["type"] == "step"]
    assert [r["step"] for r in rs] == [1, 2, 3]
    for a, b in zip(st, rs):
        assert a["filter/tau"] == b["filter/tau"] and a["filtered_fraction"] == b["filtered_fraction"]
        assert a["reward"] == b["reward"] and a["tim/num_tokens"] == b["tim/num_tokens"]


# ------------------------------------------------------------------------------- the v4 design (benchmarks/rl/rl_study.py)
def test_v4_design_is_the_preregistered_one():
    """`--study v4`: nvfp4, nvfp4_carve, fs_filter x seeds 6-19 and bf16 x 6-7 (44 runs, no v3 seed); every run has v3's
    settings and objective, plus the two eval metrics; fs_filter fits τ online (0.9) instead of the committed τ; v3's
    commands are unchanged; a seed or arm outside the design is refused."""
    from pathlib import Path

    from helpers.scripts import load_benchmark

    st = load_benchmark("rl_study")
    runs = st.STUDIES["v4"]["runs"]
    assert len(runs) == len(set(runs)) == 44
    by_arm = {}
    for n in runs:
        arm, seed = n.rsplit("_s", 1)
        by_arm.setdefault(arm, []).append(int(seed))
    assert by_arm == {"nvfp4": list(range(6, 20)), "nvfp4_carve": list(range(6, 20)), "fs_filter": list(range(6, 20)), "bf16": [6, 7]}
    assert not {int(n.rsplit("_s", 1)[1]) for n in runs} & set(st.SEEDS)  # never pooled with v3's seeds
    common = dict(st.COMMON, **st.STUDIES["v4"]["common"])
    for n in runs:
        cmd = st.command(n, "M", Path("/s"), 0, common, "cuda", study="v4")
        args = cmd[cmd.index("rl"):]
        for k, v in st.COMMON.items():  # v3's regime unchanged
            assert args[args.index(f"--{k}") + 1] == str(v), (n, k)
        assert args[args.index("--eval-sampled") + 1] == "4" and "--eval-engine" in args and "--no-follow" in args
        assert "--engine" not in args  # the HF rollout engine, as in v3 (the default)
        if n.startswith("fs_filter"):
            assert args[-4:] == ["--filter", "mean_abs", "--filter-tau-fit", "0.9"] and "--filter-tau" not in args
        if n.startswith("nvfp4_carve"):
            assert args[-4:] == st.CARVE
    v3 = st.command("fs_filter_s0", "M", Path("/s"), 0, st.COMMON, "cuda")
    assert v3[-4:-2] == ["--filter", "mean_abs"] and "--eval-engine" not in v3 and "--filter-tau-fit" not in v3
    assert st.study_names("v4", ["fs_filter"], (6, 7)) == ["fs_filter_s6", "fs_filter_s7"]
    assert st.study_names("v4", None, (6,)) == ["bf16_s6", "nvfp4_s6", "nvfp4_carve_s6", "fs_filter_s6"]
    for arms, seeds in ((None, (0,)), (["fs_comp"], None)):
        with pytest.raises(SystemExit, match="not in its design"):
            st.study_names("v4", arms, seeds)
    assert st.study_names("v3", None, None) == st.run_names(st.MAIN_ARMS, st.SEEDS)


@pytest.mark.slow
def test_v4_cpu_dry_run_and_its_summary(tmp_path):
    """The v4 design end to end on the CPU (RL_DRY=1: the tiny model, 2 steps): seed 6's four runs through the real
    command lines, then rl_summary.py reads the folder as v4 (its manifest) and writes the pre-registered tables. A
    second call on the same state skips the finished runs; a v3 call on it is refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    state, out = tmp_path / "state", tmp_path / "out"
    env = dict(os.environ, RL_DRY="1")
    cmd = [sys.executable, str(root / "benchmarks/rl/rl_study.py"), "--study", "v4", "--seeds", "6", "--state", str(state),
           "--out", str(out), "--deadline-s", "900", "--slots", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4/4 runs done" in r.stdout
    man = json.loads((out / "manifest.json").read_text())
    assert man["study"] == "v4" and "--eval-engine" in man["switches"]
    logs = {n: _read(out / f"{n}_s6.jsonl") for n in ("bf16", "nvfp4", "nvfp4_carve", "fs_filter")}
    for n, recs in logs.items():
        assert recs[-1] == {"type": "done", "step": 2}, n
        assert recs[0]["seed"] == 6 and recs[0]["eval_sampled"] == 4 and recs[0]["eval_engine"] is True
        for e in (x for x in recs if x["type"] == "eval"):
            assert {"eval_acc", "eval_sampled_acc", "engine_eval_acc"} <= set(e), n
    fs = logs["fs_filter"]
    assert fs[0]["filter"] == "mean_abs" and fs[0]["filter_tau_fit"] == 0.9 and fs[0]["filter_tau"] is None
    steps = [x for x in fs if x["type"] == "step"]
    assert steps[0]["filter/tau_fitted"] == 1.0 and steps[0]["filter/tau"] == steps[1]["filter/tau"] > 0
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "4/4 runs done" in again.stdout and "(0 not started" in again.stdout
    v3 = subprocess.run([c if c != "v4" else "v3" for c in cmd if c not in ("--seeds", "6")], env=env, capture_output=True, text=True,
                        timeout=300)
    assert v3.returncode != 0 and "holds study v4" in v3.stdout + v3.stderr
    s = subprocess.run([sys.executable, str(root / "benchmarks/rl/rl_summary.py"), str(out), "--no-plot", "--upto", "2"],
                       capture_output=True, text=True, timeout=300)
    assert s.returncode == 0, s.stdout + s.stderr
    md = (out / "summary.md").read_text()
    assert "Primary (pre-registered, docs/rl.md \"Study v4\")" in md and "| P1: fs_filter - nvfp4, AUC 0-30 |" in md
    assert json.loads((out / "summary.json").read_text())["study"] == "v4"


def test_tau_fit_on_a_study_sized_batch_drops_13_of_128():
    """At the study's batch (128 non-empty sequences, distinct mean |r|), the 0.9 quantile leaves 13 above it: the
    fitted filter drops 10.2 % at step 1 (the figure docs/rl.md's pre-registration states)."""
    from foursight.rl.loop import fit_tau
    from foursight.trainer_bridge.filters import FilterConfig, apply_filter

    g = torch.Generator().manual_seed(3)
    lens = torch.randint(5, 40, (128,), generator=g)
    m = torch.arange(40)[None, :] < lens[:, None]
    lr_ = -torch.rand(128, 40, generator=g) * 3 * m
    lt = lr_ + torch.randn(128, 40, generator=g) * 0.5 * m
    cfg = FilterConfig(policy="mean_abs")
    tau = fit_tau(lt, lr_, m, cfg, 0.9)
    res = apply_filter(lt, lr_, m, cfg.model_copy(update={"tau": tau}))
    assert len(set(res.seq_stat.tolist())) == 128 and int((~res.keep).sum()) == 13
