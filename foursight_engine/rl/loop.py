"""The GRPO loop of ``foursight rl`` (:func:`run_rl`) and its evaluation.

:func:`run_rl` reads as the algorithm: :func:`~foursight.rl.run_setup.build_run` (learner, reference,
optimizer, channel sets, rollout engine: :mod:`foursight.rl.run_setup`), then per step :func:`train_step` =
:func:`sync_weights` (re-quantization) → :func:`sample` → :func:`score` (rewards, the learner's
teacher-forced logprobs) → :func:`filter_batch` (TIM metrics, the filter's mask, advantages) →
:func:`update` (loss, one optimizer step) → :func:`step_record` (the log line), with :func:`eval_and_log`
every ``eval_every`` steps."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from foursight.rl import tasks as rl_tasks
from foursight.rl.config import RLConfig
from foursight.rl.evaluation import evaluate, evaluate_engine, evaluate_sampled, prompt_ids
from foursight.rl.grpo import combine_loss_stats, group_advantages, grpo_loss
from foursight.rl.records import check_log_path, code_commit, load_checkpoint, memory_record, open_log, read_log, save_checkpoint
from foursight.rl.run_setup import RLRun, build_run, run_device, set_reproducibility


def _sync_device(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Batch:
    """One step's problems, rollouts and their scores."""

    probs: list[rl_tasks.Problem]
    samples: list[Any]  # Rollout records
    rewards: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    logp_learner: torch.Tensor | None = None  # float32 [B, T] the learner's logprobs of the sampled tokens (no grad)


def micro_batches(n: int, size: int) -> list[range]:
    """The index ranges of the learner's micro-batches over ``n`` sequences (in order)."""
    return [range(s, min(s + size, n)) for s in range(0, n, size)]


def sync_weights(run: RLRun, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """Push the learner's weights into the rollout engine (re-quantization), then the ``follow/*``
    metrics. Returns the engine's sync info, the follow metrics and the times (``t0`` the step's
    start, ``sync``, ``follow``, ``t1`` the end)."""
    _sync_device(run.dev)
    t0 = time.perf_counter()
    info = run.engine.sync(run.learner, step)
    _sync_device(run.dev)
    t1 = time.perf_counter()
    fol = run.follow.update(run.engine.model, run.learner) if run.follow is not None else {}
    _sync_device(run.dev)
    t1n = time.perf_counter()
    return info, fol, {"t0": t0, "sync": t1 - t0, "follow": t1n - t1, "t1": t1n}


def sample(run: RLRun, step: int) -> Batch:
    """The step's problems (a function of seed and step) and ``group_size`` rollouts of each."""
    cfg = run.cfg
    probs = rl_tasks.train_problems(cfg.task, step, cfg.prompts_per_step, seed=cfg.seed, exclude=run.exclude)
    pids = prompt_ids(run.tok, probs, cfg.prompt_style, cfg.prefill)
    samples = run.engine.generate(pids, cfg.group_size, cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + step)
    return Batch(probs, samples)


def learner_logprobs(model: nn.Module, samples: Sequence[Any], dev: torch.device,
                     amp_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """Teacher-forced logprobs [len(samples), T] of a micro-batch's sampled tokens (autocast to
    ``amp_dtype``, BF16 as the learner runs; None: the model's own dtype); with grad when grad is enabled."""
    from foursight.trainer_bridge.scoring import teacher_forced_logprobs

    with torch.autocast(device_type=dev.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
        lp, _ = teacher_forced_logprobs(model, [s.prompt_ids for s in samples], [s.token_ids for s in samples], device=dev)
    return lp


def score(run: RLRun, batch: Batch) -> None:
    """Rewards and the learner's logprobs of the sampled tokens: a teacher-forced forward without
    grad, micro-batch by micro-batch (``cfg.micro_batch`` sequences), so only one micro-batch's
    activations are alive; :func:`update` runs the forward with grad the same way."""
    cfg, samples = run.cfg, batch.samples
    texts = [cfg.prefill + run.tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    group_probs = [p for p in batch.probs for _ in range(cfg.group_size)]
    batch.rewards = torch.tensor([rl_tasks.reward(t, p, cfg.format_bonus) for t, p in zip(texts, group_probs)])
    batch.correct = torch.tensor([float(rl_tasks.is_correct(t, p)) for t, p in zip(texts, group_probs)])
    run.learner.train()
    T = max([len(s.token_ids) for s in samples] + [1])
    out = torch.zeros(len(samples), T)
    with torch.no_grad():
        for idx in micro_batches(len(samples), cfg.micro_batch):
            lp = learner_logprobs(run.learner, [samples[i] for i in idx], run.dev)
            out[idx.start : idx.stop, : lp.shape[1]] = lp.float().cpu()
    batch.logp_learner = out


#: τ must be > 0 (FilterConfig); a fit on a batch with no mismatch at all (every statistic 0) keeps everything at this τ
_MIN_TAU = 1e-12


def fit_tau(lt: torch.Tensor, lr_: torch.Tensor, m: torch.Tensor, fcfg, quantile: float) -> float:
    """τ by the study's rule, online: the ``quantile`` of the per-sequence statistic that ``fcfg``'s policy thresholds
    (mean |r| for ``mean_abs``, max |r| for ``max_token``) over the batch's non-empty sequences, linear interpolation
    (``torch.quantile``, as ``benchmarks/rl/rl_filter_tau.py``). The statistic is the filter's own (``apply_filter`` at
    a τ that keeps everything), so the fitted filter drops exactly the sequences above the quantile."""
    from foursight.trainer_bridge.filters import apply_filter

    probe = apply_filter(lt, lr_, m, fcfg.model_copy(update={"tau": 1e300}))
    valid = m.bool().any(dim=1)
    return max(float(torch.quantile(probe.seq_stat[valid].to(torch.float64), quantile)), _MIN_TAU)


def filter_batch(run: RLRun, batch: Batch, step: int = 0):
    """TIM metrics and the filter's loss mask (``apply_filter`` on the rollout and learner
    logprobs), and the group-relative advantages. With ``cfg.filter_tau_fit`` the first step of a run fits
    τ (:func:`fit_tau`) on its own batch, so each engine's filter drops the designed share of it (study v3's τ,
    fitted on another engine, dropped 5.3 % where 10 % was designed: issue 51); τ then stays fixed, and
    ``filter/tau`` logs it every step. Returns the filter result, the padded rollout logprobs and the advantages."""
    from foursight.trainer_bridge.filters import apply_filter
    from foursight.trainer_bridge.scoring import pad_rollouts

    lens = [len(s.token_ids) for s in batch.samples]
    lt, lr_, m = pad_rollouts(batch.samples, [batch.logp_learner[b, :n] for b, n in enumerate(lens)])
    fitted = False
    if run.cfg.filter_tau_fit is not None and run.fitted_tau is None:
        run.fitted_tau = fit_tau(lt, lr_, m, run.fcfg, run.cfg.filter_tau_fit)
        run.fcfg = run.fcfg.model_copy(update={"tau": run.fitted_tau})
        fitted = True
    fres = apply_filter(lt, lr_, m, run.fcfg)
    if run.cfg.filter != "none":
        fres.metrics["filter/tau"] = float(run.fcfg.tau)
    if run.cfg.filter_tau_fit is not None:
        fres.metrics["filter/tau_fitted"] = 1.0 if fitted else 0.0
    adv = group_advantages(batch.rewards, run.cfg.group_size)
    return fres, lr_, adv


def policy_gradient(learner: nn.Module, ref: nn.Module | None, samples: Sequence[Any], weights: torch.Tensor,
                    logp_rollout: torch.Tensor, adv: torch.Tensor, cfg: RLConfig, dev: torch.device,
                    amp_dtype: torch.dtype | None = torch.bfloat16) -> dict[str, float]:
    """Accumulate the gradient of the clipped policy loss over the kept tokens into ``learner``'s
    ``.grad``, micro-batch by micro-batch: each micro-batch's forward (with grad), loss and backward,
    its loss divided by the live tokens of the *whole* batch, so the sum equals the whole batch's
    loss and gradient (``tests/test_rl.py::test_micro_batches_give_the_whole_batch_loss_and_gradient``).

    ``weights`` [B, T] are the filter's per-token loss weights, ``logp_rollout`` [B, T] the engine's
    logprobs (π_old with ``old_logprobs="rollout"``), ``adv`` [B]; ``amp_dtype`` as in
    :func:`learner_logprobs`. Returns the loss stats."""
    normalizer = float((weights > 0).sum())
    parts = []
    for idx in micro_batches(len(samples), cfg.micro_batch):
        mb = [samples[i] for i in idx]
        logp_new = learner_logprobs(learner, mb, dev, amp_dtype)
        T = logp_new.shape[1]
        w = weights[idx.start : idx.stop, :T].to(dev)
        if cfg.old_logprobs == "learner":
            old = logp_new.detach()  # ρ = 1; the rollout log-probs act only through the filter / TIS weights in w
        else:
            old = logp_rollout[idx.start : idx.stop, :T].to(dev)
        logp_ref = None
        if ref is not None:
            with torch.no_grad():
                logp_ref = learner_logprobs(ref, mb, dev, amp_dtype)
        loss, st = grpo_loss(logp_new, old, adv[idx.start : idx.stop].to(dev), w, cfg.clip_eps, logp_ref, cfg.kl_coef,
                             normalizer=normalizer)
        loss.backward()
        parts.append(st)
    return combine_loss_stats(parts)


def update(run: RLRun, batch: Batch, fres, logp_rollout: torch.Tensor, adv: torch.Tensor) -> tuple[dict[str, float], float]:
    """The clipped policy loss over the kept tokens (π_old: the rollout's or the learner's detached
    logprobs; + the KL term), backward in micro-batches (:func:`policy_gradient`), gradient
    clipping, one AdamW step. Returns the loss stats and the gradient norm."""
    run.opt.zero_grad(set_to_none=True)
    lstats = policy_gradient(run.learner, run.ref, batch.samples, fres.loss_weights(), logp_rollout, adv, run.cfg, run.dev)
    gnorm = float(torch.nn.utils.clip_grad_norm_(run.learner.parameters(), 1.0))
    run.opt.step()
    return lstats, gnorm


def step_record(run: RLRun, step: int, batch: Batch, fres, lstats: dict[str, float], gnorm: float, info: dict[str, Any],
                fol: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    """The step's log record: rewards (of the kept and the dropped sequences too), TIM and filter
    metrics, loss stats, the time of each phase, ``follow/*``."""
    samples, rewards, correct = batch.samples, batch.rewards, batch.correct
    lens = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
    keep = fres.keep.bool()
    return {
        "type": "step", "step": step,
        "reward_kept": float(rewards[keep].mean()) if keep.any() else None,
        "reward_dropped": float(rewards[~keep].mean()) if (~keep).any() else None,
        "accuracy_dropped": float(correct[~keep].mean()) if (~keep).any() else None,
        "response_len_kept": float(lens[keep].mean()) if keep.any() else None,
        "response_len_dropped": float(lens[~keep].mean()) if (~keep).any() else None,
        "reward": float(rewards.mean()), "accuracy": float(correct.mean()),
        "response_len": float(lens.mean()), "truncated_fraction": float(sum(s.finish_reason == "length" for s in samples)) / len(samples),
        "adv_zero_groups": float((rewards.view(-1, run.cfg.group_size).std(1) == 0).float().mean()),
        "filtered_fraction": 1.0 - fres.metrics["filter/kept_seq_fraction"],
        **{k: v for k, v in fres.metrics.items()}, **lstats, "grad_norm": gnorm,
        "requantized_layers": info.get("requantized_layers", 0),
        "time/sync": times["sync"], "time/generate": times["generate"] - times["t1"], "time/score": times["score"] - times["generate"],
        "time/filter": times["filter"] - times["score"], "time/learn": times["learn"] - times["filter"],
        "time/step": times["learn"] - times["t0"] - times["follow"], "time/follow": times["follow"], **fol,
        **memory_record(run.dev), "wall_s": time.perf_counter() - run.t_start,
    }


def train_step(run: RLRun, step: int) -> dict[str, Any]:
    """One GRPO step: sync weights, sample, score, filter, update; returns its log record."""
    if run.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.dev)
    info, fol, times = sync_weights(run, step)
    batch = sample(run, step)
    times["generate"] = _now(run.dev)
    score(run, batch)
    times["score"] = _now(run.dev)
    fres, logp_rollout, adv = filter_batch(run, batch, step)
    times["filter"] = _now(run.dev)
    lstats, gnorm = update(run, batch, fres, logp_rollout, adv)
    times["learn"] = _now(run.dev)
    return step_record(run, step, batch, fres, lstats, gnorm, info, fol, times)


def _now(dev: torch.device) -> float:
    """perf_counter once the device's queued work is done (each phase's time is its own)."""
    _sync_device(dev)
    return time.perf_counter()


def eval_seed(cfg: RLConfig, step: int) -> int:
    """The sampled eval's seed at ``step``: rows ``eval_seed + i``, none of which a rollout uses (a step's rollouts
    take ``seed * 1_000_003 + step + i``, i < prompts x group)."""
    return cfg.seed * 1_000_003 + 500_000 + 1_000 * step


def eval_and_log(run: RLRun, step: int, log: Callable[[str], None]) -> float:
    """The held-out evaluation; an ``eval`` record: the learner's greedy accuracy (``eval_acc``), and when asked for,
    the learner's accuracy under sampling (``cfg.eval_sampled`` answers per question at T = 1, ``eval_sampled_acc``)
    and the rollout engine's own greedy accuracy (``cfg.eval_engine``: the engine is synced to the learner first, so it
    holds the weights the learner was just evaluated at; ``engine_eval_acc``). None of them touches the training RNG
    or the weights, so the run's steps are the same with or without them (``tests/test_rl_v4.py``)."""
    if run.dev.type == "cuda":  # the eval's own peak (a step's peak is reset when the step starts)
        torch.cuda.reset_peak_memory_stats(run.dev)
    t0 = time.perf_counter()
    cfg = run.cfg
    kw = dict(style=cfg.prompt_style, prefill=cfg.prefill)
    ev = evaluate(run.learner, run.tok, run.evals, cfg.max_new_tokens, **kw)
    _sync_device(run.dev)
    rec: dict[str, Any] = {"type": "eval", "step": step, **ev, "time/eval": time.perf_counter() - t0}
    extra = ""
    if cfg.eval_sampled:
        t1 = time.perf_counter()
        rec.update(evaluate_sampled(run.learner, run.tok, run.evals, cfg.max_new_tokens, cfg.eval_sampled, eval_seed(cfg, step), **kw))
        rec["time/eval_sampled"] = _now(run.dev) - t1
        extra += f" sampled={rec['eval_sampled_acc']:.3f}"
    if cfg.eval_engine:
        t1 = time.perf_counter()
        run.engine.sync(run.learner, step)
        rec.update(evaluate_engine(run.engine, run.tok, run.evals, cfg.max_new_tokens, **kw))
        rec["time/eval_engine"] = _now(run.dev) - t1
        extra += f" engine={rec['engine_eval_acc']:.3f}"
    if cfg.eval_sampled or cfg.eval_engine:  # the extra generations' memory, for the study's per-run memory bound
        rec.update(memory_record(run.dev))
    run.emit(rec)
    log(f"  step {step:4d} eval_acc={ev['eval_acc']:.3f} format={ev['eval_format']:.2f}{extra}")
    return ev["eval_acc"]


def run_rl(cfg: RLConfig, log: Callable[[str], None] = print) -> Path:
    """Run GRPO as configured; write one JSON object per line to ``cfg.out`` and return its path.

    Lines: a ``{"type": "config", ...}`` header, ``{"type": "eval", "step": s, "eval_acc", ...}``
    at step 0 and every ``eval_every`` steps (and after the last), and ``{"type": "step", ...}``
    with reward, TIM metrics (``tim/*``, ``rollout_corr/*``), ``filter/*``, the loss stats and the
    step time split by phase ``time/sync`` (re-quantization), ``time/generate``, ``time/score``
    (rewards, the learner's teacher-forced forward), ``time/filter`` (TIM metrics, the filter's
    mask, advantages), ``time/learn`` (loss, backward, optimizer step) and ``time/step`` (their
    sum; ``time/follow``, the ``follow/*`` metrics, is outside it); the reward of the kept and of
    the dropped sequences; ``follow/*`` (:mod:`foursight.rl.follow`); a ``done`` record after the
    last step.

    Reproducible: the problems of a step depend on (seed, step) only, sampling is seeded by (seed,
    step), the SpliceGEMM kernels run fixed configurations (no autotuning, unless
    ``cfg.kernel_autotune``) and torch runs its deterministic algorithms (``cfg.deterministic``);
    two CPU runs of one seed write the same log but for times
    (``tests/test_rl.py::test_two_runs_of_a_seed_write_the_same_log``).

    Resumable: with ``cfg.resume`` a log ending in ``done`` is left alone (the run is complete),
    and a checkpoint (``cfg.checkpoint_path()``: learner, optimizer, channel sets, step) written
    when pausing at ``cfg.stop_at`` or every ``cfg.checkpoint_every`` steps is continued: the log
    keeps its records up to the checkpoint's step and gets a ``resume`` record. Without a
    checkpoint the run starts over.
    """
    cfg.validate()
    set_reproducibility(cfg)
    fcfg = cfg.filter_config()
    out = Path(cfg.out)
    check_log_path(out)
    ckpt_path = Path(cfg.checkpoint_path())
    if cfg.resume and out.exists():
        prev = read_log(out)
        if prev and prev[-1].get("type") == "done":
            log(f"rl: {out} is complete (done at step {prev[-1].get('step')}); nothing to do")
            return out
    resume_state = load_checkpoint(ckpt_path) if cfg.resume and ckpt_path.exists() else None
    dev = run_device(cfg)
    run = build_run(cfg, dev, resume_state)
    fh = None
    try:  # the engine (and its temporary folder) is released however the run ends
        run.fcfg = fcfg
        if resume_state is not None and resume_state.get("filter_tau") is not None:  # τ fitted before the pause
            run.fitted_tau = float(resume_state["filter_tau"])
            run.fcfg = fcfg.model_copy(update={"tau": run.fitted_tau})

        start_step, wall_offset = (int(resume_state["step"]), float(resume_state["wall_s"])) if resume_state is not None else (0, 0.0)
        fh = open_log(out, start_step, resume_state is not None)

        def emit(rec: dict[str, Any]) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

        run.emit = emit
        device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        if resume_state is None:
            emit({"type": "config", **asdict(cfg), "device": str(dev), "device_name": device_name, "model_dir": str(run.model_dir),
                  **run.ch_info, "setup_s": run.setup_s, "torch": torch.__version__, "commit": code_commit()})
        else:
            emit({"type": "resume", "step": start_step, "setup_s": run.setup_s, "device_name": device_name})
            log(f"rl: resuming {out} after step {start_step}")
        log(f"rl: {cfg.rollout_precision} rollouts, filter={cfg.filter}, task={cfg.task}, engine={cfg.engine}, device={dev}, "
            f"k={run.ch_info['channels_k']}, BF16 weight share {run.ch_info['bf16_weight_share']:.2%}")

        if resume_state is None:
            eval_and_log(run, 0, log)
        run.t_start = time.perf_counter() - wall_offset
        step = start_step
        paused = False
        for step in range(start_step + 1, cfg.steps + 1):
            if cfg.stop_at and time.time() > cfg.stop_at:
                step -= 1
                save_checkpoint(ckpt_path, step, run.learner, run.opt, run.channels, time.perf_counter() - run.t_start,
                                filter_tau=run.fitted_tau)
                emit({"type": "pause", "step": step, "checkpoint": str(ckpt_path)})
                log(f"  paused after step {step} (stop_at reached); checkpoint {ckpt_path}")
                paused = True
                break
            if cfg.time_budget_s and time.perf_counter() - run.t_start > cfg.time_budget_s:
                log(f"  time budget {cfg.time_budget_s}s reached after {step - 1} steps")
                emit({"type": "stop", "step": step - 1, "reason": "time_budget"})
                step -= 1
                break
            rec = train_step(run, step)
            emit(rec)
            if step % 5 == 0 or step == 1:
                log(f"  step {step:4d} reward={rec['reward']:.3f} acc={rec['accuracy']:.3f} |r|={rec['tim/abs_log_ratio_mean']:.4f} "
                    f"filtered={rec['filtered_fraction']:.2f} t={rec['time/step']:.2f}s")
            if step % cfg.eval_every == 0:
                eval_and_log(run, step, log)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
                save_checkpoint(ckpt_path, step, run.learner, run.opt, run.channels, time.perf_counter() - run.t_start,
                                filter_tau=run.fitted_tau)
        if not paused:
            if step and step % cfg.eval_every:
                eval_and_log(run, step, log)
            emit({"type": "done", "step": step})
            ckpt_path.unlink(missing_ok=True)
    finally:
        if fh is not None:
            fh.close()
        run.engine.close()
    return out
