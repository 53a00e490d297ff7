"""The setup of a ``foursight rl`` run: what :func:`foursight.rl.loop.run_rl` builds before its first step.

:func:`build_run` loads the learner (FP32 master weights), the frozen reference model of the KL term, the
optimizer, the BF16 channel sets (calibrated once on the initial model, or a checkpoint's) and the rollout
engine, into the :class:`RLRun` every step of :mod:`foursight.rl.loop` works on; :func:`run_device` picks
the device the ``--engine`` kind can roll out on, and :func:`set_reproducibility` fixes the kernels'
configurations and turns on torch's deterministic algorithms."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from foursight.channels import calibrate_channel_sets, channel_summary
from foursight.rl import tasks as rl_tasks
from foursight.rl.config import CHANNEL_PRECISIONS, ENGINES, RLConfig, RLError
from foursight.rl.evaluation import prompt_ids
from foursight.trainer_bridge.backends.base import RolloutEngine, RolloutSetup
from foursight.trainer_bridge.backends.registry import ENGINE_KINDS, load


@dataclass
class RLRun:
    """What one run holds between steps: the models, optimizer, rollout engine and log."""

    cfg: RLConfig
    dev: torch.device
    model_dir: Any  # as foursight.models.resolve_model returns it
    tok: Any
    learner: nn.Module
    ref: nn.Module | None  # the frozen initial model of the KL term (kl_coef > 0)
    opt: torch.optim.Optimizer
    engine: RolloutEngine  # the --engine kind's rollout engine (trainer_bridge.backends.registry)
    channels: Any  # the BF16 channel sets, calibrated once on the initial model
    evals: list[rl_tasks.Problem]
    exclude: set[str]  # the eval questions, never trained on
    follow: Any  # FollowTracker | None
    ch_info: dict[str, Any]
    setup_s: float
    fcfg: Any = None  # the filter's FilterConfig
    emit: Callable[[dict[str, Any]], None] = print
    t_start: float = 0.0  # perf_counter of step 0 (a resumed run's earlier wall time subtracted)
    fitted_tau: float | None = None  # τ fitted online at step 1 (cfg.filter_tau_fit), kept in the checkpoint


def set_reproducibility(cfg: RLConfig) -> None:
    """Fixed kernel configurations unless ``kernel_autotune``; torch's deterministic algorithms."""
    if not cfg.kernel_autotune:
        os.environ["FOURSIGHT_KERNELS_AUTOTUNE"] = "0"  # read by foursight.kernels.tuning.pick_config
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def run_device(cfg: RLConfig) -> torch.device:
    """The run's device (``cfg.device``; ``auto``: CUDA where there is one); RLError naming the engines that can
    roll out there when the ``--engine`` kind cannot."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    devices = cfg.engine_kind().rollout_devices
    if devices is not None and dev.type not in devices:
        usable = [k for k in ENGINES if ENGINE_KINDS[k].rollout_devices is None or dev.type in ENGINE_KINDS[k].rollout_devices]
        raise RLError(f"--engine {cfg.engine} is the {'/'.join(d.upper() for d in devices)} smoke path here; use --engine "
                      f"{'|'.join(usable)} on {dev.type.upper()}")
    return dev


def build_run(cfg: RLConfig, dev: torch.device, resume_state: dict[str, Any] | None) -> RLRun:
    """Load the learner (FP32 master weights), the reference model, the optimizer, the channel sets
    (calibrated on the initial model, or the checkpoint's) and the rollout engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.bf16_layers import bf16_layer_patterns, model_bf16_share, num_blocks_of
    from foursight.calibration import builtin_texts
    from foursight.models import resolve_model

    row = cfg.engine_kind()
    model_dir = resolve_model(cfg.model)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    learner.config.use_cache = True
    carve = bf16_layer_patterns(cfg.bf16_layers, num_blocks_of(learner)) if cfg.bf16_layers else []
    ignore = ("lm_head", *carve)
    ref = None
    if cfg.kl_coef > 0:
        ref = copy.deepcopy(learner).to(torch.bfloat16).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(learner.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)

    evals = rl_tasks.eval_set(cfg.task, cfg.eval_size)
    exclude = {p.question for p in evals}
    t_setup = time.perf_counter()
    channels = None
    if resume_state is not None:
        learner.load_state_dict(resume_state["learner"])
        opt.load_state_dict(resume_state["opt"])
        channels = resume_state["channels"]  # calibrated once, on the initial model
        torch.set_rng_state(resume_state["rng"])
    elif cfg.rollout_precision in CHANNEL_PRECISIONS and row.rollout_copies_learner:
        calib_probs = rl_tasks.train_problems(cfg.task, step=-1, n=32, seed=cfg.seed + 7, exclude=exclude)
        texts = builtin_texts() + [tok.decode(ids) for ids in prompt_ids(tok, calib_probs, cfg.prompt_style, cfg.prefill)]
        learner_bf16 = copy.deepcopy(learner).to(torch.bfloat16).eval()
        channels = calibrate_channel_sets(learner_bf16, tok, texts, cfg.channels, ignore=ignore, error_target=cfg.error_target,
                                          max_k=cfg.max_k)
        del learner_bf16
    engine = load(row.rollout).for_rl(RolloutSetup(learner, model_dir, tok, cfg.rollout_precision, channels, cfg.channels,
                                                   ignore=ignore, sync=cfg.sync, seed=cfg.seed))
    setup_s = time.perf_counter() - t_setup
    ch_info = channel_summary(learner, channels)
    if cfg.rollout_precision == "bf16":
        ch_info.update(bf16_weight_share=1.0, bf16_layer_share=1.0, bf16_channel_share=0.0, bf16_layers=[])
    else:
        ch_info.update(model_bf16_share(learner, ["lm_head"], carve, channels))
    follow = None
    if cfg.follow and row.rollout_copies_learner:
        from foursight.rl.follow import FollowTracker

        follow = FollowTracker(ignore=("lm_head",))
        follow.update(engine.model, learner)  # the initial weights
    return RLRun(cfg, dev, model_dir, tok, learner, ref, opt, engine, channels, evals, exclude, follow, ch_info, setup_s)
