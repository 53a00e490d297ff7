"""RL study v2 (issue 29) on the CPU: the BF16 carve-out (which layers, the byte share, `foursight
quantize --bf16-layers`), the long-answer tasks and their verifiers, the code-flip / update-alignment
metric on a hand-made update, two same-seed runs writing the same log, and a smoke run of every arm
of benchmarks/rl/rl_study.py through the real `foursight rl` command."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch import nn

from foursight.bf16_layers import CarveOutError, bf16_layer_patterns, bf16_weight_share, model_bf16_share
from foursight.rl import RLConfig, RLError, run_rl
from foursight.rl import tasks as rl_tasks
from foursight.schema import FourSightConfig
from helpers.scripts import load_benchmark

rl_study = load_benchmark("rl_study")

LLAMA_LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"]


def _names(blocks: int) -> list[str]:
    return [f"model.layers.{i}.{s}" for i in range(blocks) for s in LLAMA_LINEARS] + ["lm_head"]


def _carved(entries, blocks=4) -> set[str]:
    cfg = FourSightConfig(ignore=bf16_layer_patterns(entries, blocks))
    return {n for n in _names(blocks) if cfg.is_ignored(n)}


# ------------------------------------------------------------------------------- carve-out
def test_bf16_layer_selectors_pick_the_named_layers():
    att = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in "qkvo"}
    assert _carved(["attention"]) == att
    assert _carved(["mlp"]) == {f"model.layers.{i}.mlp.{p}_proj" for i in range(4) for p in ("gate", "up", "down")}
    assert _carved(["first:1"]) == {f"model.layers.0.{s}" for s in LLAMA_LINEARS}
    assert _carved(["last:2"]) == {f"model.layers.{i}.{s}" for i in (2, 3) for s in LLAMA_LINEARS}
    assert _carved(["block:-1"]) == _carved(["last:1"])
    # & intersects, entries unite: the study's carve-out (attention of the first two and the last block)
    assert _carved(["attention&first:2", "attention&last:1"]) == {n for n in att if ".layers.3." in n or ".layers.0." in n
                                                                   or ".layers.1." in n}
    assert _carved(["model.layers.1.mlp.down_proj"]) == {"model.layers.1.mlp.down_proj"}  # a plain name passes through
    assert _carved(["re:.*up_proj"]) == {f"model.layers.{i}.mlp.up_proj" for i in range(4)}
    assert not _carved(["first:1"]) & {"lm_head", "model.layers.10.self_attn.q_proj"}  # block 1 never matches block 10
    assert FourSightConfig(ignore=bf16_layer_patterns(["first:2"], 12)).is_ignored("model.layers.1.mlp.up_proj")
    assert not FourSightConfig(ignore=bf16_layer_patterns(["first:2"], 12)).is_ignored("model.layers.10.mlp.up_proj")
    for bad, msg in ((["first:5"], "1..4"), (["block:4"], "outside"), (["attention&q_proj"], "not a selector"), ([""], "empty")):
        with pytest.raises(CarveOutError, match=msg):
            bf16_layer_patterns(bad, 4)
    with pytest.raises(CarveOutError, match="number of blocks"):
        bf16_layer_patterns(["first:1"], None)


def test_bf16_weight_share_by_hand_and_the_study_carve_out_on_smollm2():
    # two layers 4x8 and 2x8: carve the first whole (32), k = 2 channels on the second (2*2 = 4) -> 36 / 48
    s = bf16_weight_share([("a", 4, 8, 0), ("b", 2, 8, 2)], ["a"])
    assert s["bf16_weight_share"] == pytest.approx(36 / 48) and s["bf16_layer_share"] == pytest.approx(32 / 48)
    assert s["bf16_channel_share"] == pytest.approx(4 / 48) and s["bf16_layers"] == ["a"]
    # SmolLM2-135M's shapes (meta tensors, no weights): the study's carve-out against FourSight --channels 2%
    from transformers import AutoConfig, AutoModelForCausalLM

    from foursight.models import resolve_model
    from foursight.schema import parse_channel_budget

    cfg = AutoConfig.from_pretrained(resolve_model(None))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    blocks = cfg.num_hidden_layers
    carve = bf16_layer_patterns(rl_study.CARVE[1::2], blocks)
    ch = {n: parse_channel_budget("2%", m.in_features, layer=n) for n, m in model.named_modules()
          if isinstance(m, nn.Linear) and n != "lm_head"}
    fs, cv = model_bf16_share(model, ["lm_head"], [], ch), model_bf16_share(model, ["lm_head"], carve)
    d, i, h = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    block = 2 * d * d + 2 * h * d + 3 * d * i
    assert cv["bf16_weight_share"] == pytest.approx(3 * (2 * d * d + 2 * h * d) / (blocks * block))
    assert len(cv["bf16_layers"]) == 12 and cv["bf16_channel_share"] == 0
    k_small, k_big = parse_channel_budget("2%", d, layer="x"), parse_channel_budget("2%", i, layer="x")
    assert fs["bf16_weight_share"] == pytest.approx((k_small * (2 * d + 2 * h + 2 * i) + k_big * d) / block)
    # equal BF16 bytes within 5 % of each other (2.50 % vs 2.60 %)
    assert abs(cv["bf16_weight_share"] / fs["bf16_weight_share"] - 1) < 0.05, (cv["bf16_weight_share"], fs["bf16_weight_share"])


def test_quantize_bf16_layers_keeps_them_bf16(tmp_path, tiny_llama_dir):
    """`foursight quantize --bf16-layers attention&first:1`: those four layers are written as plain BF16
    weights named in quantization_config.ignore, every other linear is FourSight, and the command
    prints the BF16 weight share."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from foursight.cli import app

    out = tmp_path / "ckpt"
    r = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama_dir), "--out", str(out), "--channels", "16",
                                 "--bf16-layers", "attention&first:1"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    keys = {}
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            keys.update({k: fh.get_slice(k).get_shape() for k in fh.keys()})
    carved = {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"}
    for n in _names(2)[:-1]:
        if n in carved:
            assert f"{n}.weight" in keys and f"{n}.weight_packed" not in keys, n
        else:
            assert f"{n}.weight_packed" in keys and f"{n}.weight" not in keys, n
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = FourSightConfig(ignore=qc["ignore"])
    assert {n for n in _names(2) if cfg.is_ignored(n)} == carved | {"lm_head"}
    # share: the 4 carved layers whole + 16 channels of the other 10 (tiny: hidden 128, intermediate 256)
    rows = [(n, keys[f"{n}.weight"][0], keys[f"{n}.weight"][1], 0) if n in carved else
            (n, keys[f"{n}.weight_packed"][0], 2 * keys[f"{n}.weight_packed"][1], 16) for n in _names(2)[:-1]]
    want = bf16_weight_share(rows, carved)["bf16_weight_share"]
    assert 0.16 < want < 0.5 and f"BF16 weight share {want:.2%}" in " ".join(r.output.split())


# ------------------------------------------------------------------------------- tasks
def _independent_answer(p: rl_tasks.Problem) -> str:
    """Recompute the answer from the question text alone."""
    if p.task.startswith("chain"):
        expr = re.match(r"Compute (.*)\. Work", p.question)[1]
        toks = expr.split()
        total = int(toks[0])
        for op, x in zip(toks[1::2], toks[2::2]):
            total = total + int(x) if op == "+" else total - int(x)
            assert 0 <= total <= 99, p  # every partial result stays in range
        return str(total)
    m = re.match(r"List the (?:(\d+) )?numbers from (\d+) to (\d+)(?: counting by (\d))?, separated by commas\.", p.question)
    a, b, step = int(m[2]), int(m[3]), int(m[4] or 1)
    assert (b - a) % step == 0 and (m[1] is None or int(m[1]) == (b - a) // step + 1)
    return ", ".join(str(x) for x in range(a, b + 1, step))


@pytest.mark.parametrize("task", ["seq", "seq1", "chain3", "chain4", "chain5"])
def test_long_answer_tasks_generate_and_verify(task):
    probs = [rl_tasks.make_problem(task, s) for s in range(300)]
    assert probs[7] == rl_tasks.make_problem(task, 7)  # seeded
    assert len({p.question for p in probs}) > 200  # seq1 has the smallest pool (~400 distinct questions)
    for p in probs:
        assert p.answer == _independent_answer(p), p
    p = probs[0]
    right = f"Answer: {p.answer}"
    if p.solution:
        right = f"{p.solution}\n{right}"
        assert p.solution.splitlines()[-1].endswith(f"= {p.answer}")
        assert len(p.solution.splitlines()) == int(task[-1]) - 1
    wrong_value = str(int(p.answer.split(", ")[-1]) + 1)
    wrong = f"Answer: {', '.join(p.answer.split(', ')[:-1] + [wrong_value])}"
    assert rl_tasks.is_correct(right, p) and rl_tasks.reward(right, p) == 1.0
    assert not rl_tasks.is_correct(wrong, p)
    assert rl_tasks.reward(wrong, p, format_bonus=0.1) == pytest.approx(0.1)  # well-formed, wrong
    assert rl_tasks.reward(wrong, p, format_bonus=0.0) == 0.0  # the ablation: no bonus
    assert rl_tasks.reward(p.answer, p) == 0.0  # no Answer: line
    # the oneshot prompt shows the worked example of the same task
    ex = rl_tasks.EXAMPLES[task]
    assert f"{ex.solution}\nAnswer: {ex.answer}".strip() in p.messages("oneshot")[1]["content"]
    # eval and train streams are disjoint; a seed's stream is the same for every arm
    ev = {e.question for e in rl_tasks.eval_set(task, 256)}
    tr = rl_tasks.train_problems(task, 3, 16, seed=2, exclude=ev)
    assert not ev & {q.question for q in tr} and tr == rl_tasks.train_problems(task, 3, 16, seed=2, exclude=ev)
    assert tr != rl_tasks.train_problems(task, 3, 16, seed=1, exclude=ev)


# ------------------------------------------------------------------------------- follow metric
def _grid_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Weights on the E2M1 grid with a 6 in every block of 16: NVFP4 represents them exactly
    (block scale 1 x global), and any change that keeps |w| < 6 away from a grid midpoint keeps every code."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    w = vals[torch.randint(0, 6, (n, k), generator=g)] * torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    w[:, ::16] = 6.0
    return w


def test_code_flips_and_update_alignment_on_a_hand_made_update():
    from foursight.hf import quantize_hf_model
    from foursight.layer import dequantize_weight
    from foursight.rl.follow import FollowTracker

    learner = nn.Module()
    learner.lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        learner.lin.weight.copy_(_grid_weight(32, 64))
    rollout = quantize_hf_model(copy.deepcopy(learner).to(torch.bfloat16), {"lin": torch.tensor([5, 40], dtype=torch.int32)})
    tr = FollowTracker()
    assert tr.update(rollout, learner) == {}  # the first snapshot

    def push(w):
        with torch.no_grad():
            learner.lin.weight.copy_(w)
        rollout.lin.set_weight(w.to(torch.bfloat16))
        return tr.update(rollout, learner)

    # 1. a small update (1 % of |w|, amax untouched): the learner moves, no NVFP4 code changes; only the
    #    two BF16 channel columns (5 and 40) follow it
    w0 = learner.lin.weight.detach().clone()
    small = w0 + 1e-2 * w0.abs() * (w0.abs() < 6)
    d0 = dequantize_weight(rollout.lin.qweight, torch.float32)
    m = push(small)
    d1 = dequantize_weight(rollout.lin.qweight, torch.float32)
    assert m["follow/code_flip_fraction"] == 0.0 and m["follow/bf16_flip_fraction"] > 0
    moved = (d1 != d0).any(0).nonzero().flatten().tolist()
    assert moved == [5, 40]
    dr, dl = (d1 - d0).double().flatten(), (small - w0).double().flatten()
    assert m["follow/norm_ratio"] == pytest.approx(float(dr.norm() / dl.norm()), rel=1e-9) and m["follow/norm_ratio"] < 0.5
    assert m["follow/learner_rel_update"] == pytest.approx(float(dl.norm() / small.double().norm()), rel=1e-9)
    # 2. one block (row 3, columns 16..31) reversed: same block amax and scale, codes permuted
    q_old = rollout.lin.qweight
    d_old = dequantize_weight(q_old, torch.float32)
    big = small.clone()
    big[3, 16:32] = small[3, 16:32].flip(0)
    m = push(big)
    d_new = dequantize_weight(rollout.lin.qweight, torch.float32)
    blk = d_old[3, 16:32]
    want_flips = int((blk != blk.flip(0)).sum())  # distinct values = distinct codes at one scale (no zeros on the grid)
    assert want_flips > 0
    assert m["follow/code_flip_fraction"] == pytest.approx(want_flips / (32 * (64 - 2)))
    dr, dl = (d_new - d_old).double().flatten(), (big - small).double().flatten()
    assert m["follow/cos"] == pytest.approx(float(dr @ dl / (dr.norm() * dl.norm())), rel=1e-9)
    assert m["follow/norm_ratio"] == pytest.approx(float(dr.norm() / dl.norm()), rel=1e-9)
    assert 0.9 < m["follow/cos"] <= 1.0 + 1e-9  # a large update survives quantization


# ------------------------------------------------------------------------------- runs
def _strip(recs):
    drop = ("time/", "wall_s", "setup_s", "out", "checkpoint", "mem/")  # mem/: peaks of the whole process, which the first run raised
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in recs]


def test_two_runs_of_a_seed_write_the_same_log(tmp_path, tiny_llama_dir):
    """Same seed, two runs: every logged value but times is identical (samples, rewards, TIM, loss,
    follow metrics, evals); another seed differs."""
    def one(tag, seed=0):
        out = tmp_path / f"{tag}.jsonl"
        run_rl(RLConfig(model=str(tiny_llama_dir), task="seq1", rollout_precision="foursight", filter="max_token", filter_tau=2.5,
                        steps=2, prompts_per_step=2, group_size=2, max_new_tokens=4, eval_every=2, eval_size=2, channels="16",
                        seed=seed, out=str(out), device="cpu", format_bonus=0.5), log=lambda s: None)
        return [json.loads(line) for line in out.read_text().splitlines()]

    a, b = one("a"), one("b")
    assert _strip(a) == _strip(b)
    steps = [r for r in a if r["type"] == "step"]
    assert len(steps) == 2 and all("follow/code_flip_fraction" in r for r in steps)
    assert a[0]["kernel_autotune"] is False and a[0]["deterministic"] is True
    assert _strip(one("c", seed=1)) != _strip(a)


def test_rl_config_refuses_bad_carve_outs(tiny_llama_dir):
    with pytest.raises(RLError, match="--bf16-layers"):
        RLConfig(rollout_precision="bf16", bf16_layers=["attention"]).validate()
    with pytest.raises(RLError, match="--bf16-layers"):
        RLConfig(rollout_precision="nvfp4", engine="vllm", bf16_layers=["attention"]).validate()


@pytest.mark.slow
@pytest.mark.parametrize("arm", list(rl_study.ARMS))
def test_every_study_arm_runs_one_step(tmp_path, tiny_llama_dir, arm):
    """Each arm of benchmarks/rl/rl_study.py through the real `foursight rl` command line it builds (the
    dry-run settings: the tiny model, 1 step): the log is complete and its header says what ran."""
    from typer.testing import CliRunner

    from foursight.cli import app

    common = dict(rl_study.DRY, steps=1)
    cmd = rl_study.command(f"{arm}_s0", str(tiny_llama_dir), tmp_path, 0, common, "cpu", dry=True)
    args = cmd[cmd.index("rl"):]
    args[args.index("--stop-at") + 1] = "0"
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in (tmp_path / f"{arm}_s0.jsonl").read_text().splitlines()]
    head = recs[0]
    prec, extra = rl_study.arm_flags(arm)
    assert recs[-1] == {"type": "done", "step": 1} and head["rollout_precision"] == prec and head["task"] == rl_study.DRY["task"]
    assert head["format_bonus"] == (0.1 if arm.endswith("_bonus") else 0.0)
    assert head["micro_batch"] == rl_study.DRY["micro-batch"] and head["follow"] is False
    if arm.endswith("_filter"):  # the length-normalised filter at the τ fitted for this engine
        tau = json.loads(rl_study.FILTER_TAU_FILE.read_text())["engines"][prec]["tau"]
        assert head["filter"] == "mean_abs" and head["filter_tau"] == pytest.approx(tau, rel=1e-5)
    else:
        assert head["filter"] == "none"
    share = {"bf16": 1.0, "fp8": 0.0, "nvfp4": 0.0}.get(prec)
    if arm == "nvfp4_carve":
        assert head["bf16_layers"] == [f"model.layers.0.self_attn.{p}_proj" for p in "koqv"] and head["bf16_layer_share"] > 0
    elif share is not None:
        assert head["bf16_weight_share"] == share
    else:
        assert 0 < head["bf16_weight_share"] == head["bf16_channel_share"]
    step = next(x for x in recs if x["type"] == "step")
    assert {"time/sync", "time/generate", "time/score", "time/filter", "time/learn", "reward_kept"} <= set(step)


def test_launch_order_resumes_paused_runs_first_then_the_slowest_arms_of_each_seed():
    """Study v3 chunk 2 (H100): the call started bf16_s2 before fs_comp_s2 and fs_filter_s2, which then ran
    ~280 s alone at the end; a run paused in an earlier call must finish on this machine before it goes back."""
    names = rl_study.run_names(rl_study.MAIN_ARMS, (1, 2))
    statuses = {n: "not started" for n in names}
    statuses.update({"nvfp4_s2": "paused", "bf16_s1": "done"})
    order = rl_study.launch_order([n for n in names if statuses[n] != "done"], statuses)
    assert order[0] == "nvfp4_s2"  # paused: first, whatever its seed
    seeds = [int(n.rsplit("_s", 1)[1]) for n in order[1:]]
    assert seeds == sorted(seeds)  # then seed by seed: a chunk cut short keeps whole seeds
    s2 = [n for n in order if n.endswith("_s2") and n != "nvfp4_s2"]
    assert s2[:2] == ["fs_comp_s2", "fs_filter_s2"] and s2[-1] == "bf16_s2"  # the slowest arms first, BF16 last
    assert sorted(order) == sorted(n for n in names if n != "bf16_s1")  # nothing lost or doubled
