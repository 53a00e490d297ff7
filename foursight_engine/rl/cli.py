"""``foursight rl``: the command (one option per :class:`~foursight.rl.config.RLConfig` field)."""

from __future__ import annotations

from typing import Optional

import typer

from foursight.cli_util import DEFAULT_CHANNELS, ChannelsOption, ModelOption, guarded
from foursight.rl import tasks as rl_tasks
from foursight.rl.config import RLConfig
from foursight.rl.loop import run_rl


@guarded
def rl_command(
    model: ModelOption = None,
    task: str = typer.Option("add", "--task", help=f"one of {sorted(rl_tasks.TASKS)}"),
    rollout_precision: str = typer.Option("foursight", "--rollout-precision", help="bf16 | fp8 (rowwise W8A8, FlashRL) | nvfp4 (k=0) | foursight (W4A4 + k BF16 channels) | w4a16 (FourSight weights, BF16 activations)"),
    filter: str = typer.Option("none", "--filter", help="none | max_token | tail_count | geo_mean | quantile"),
    engine: str = typer.Option("hf", "--engine", help="hf (in-process; Triton kernels on CUDA) | vllm (CPU smoke)"),
    steps: int = typer.Option(100, "--steps"),
    prompts_per_step: int = typer.Option(8, "--prompts-per-step"),
    group_size: int = typer.Option(8, "--group-size"),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens"),
    lr: float = typer.Option(2e-5, "--lr"),
    clip_eps: float = typer.Option(0.2, "--clip-eps"),
    kl_coef: float = typer.Option(0.0, "--kl-coef"),
    channels: ChannelsOption = DEFAULT_CHANNELS,
    eval_every: int = typer.Option(10, "--eval-every"),
    eval_size: int = typer.Option(128, "--eval-size"),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("auto", "--device"),
    out: str = typer.Option("runs/rl.jsonl", "--out", help="JSONL log path"),
    time_budget_s: float = typer.Option(0.0, "--time-budget", help="stop after this many seconds of training (0: none)"),
    sync: str = typer.Option("inproc", "--sync", help="hf engine weight sync: inproc (set_weight) | file (HFEngine.update_weights)"),
    tis_cap: float = typer.Option(0.0, "--tis-cap", help="token TIS cap (0: off)"),
    old_logprobs: str = typer.Option("rollout", "--old-logprobs", help="π_old of the clipped surrogate: rollout (the engine's log-probs) | learner (the learner's detached log-probs, as verl/TRL; use with --tis-cap)"),
    filter_tau: float = typer.Option(0.0, "--filter-tau", help="τ of max_token/tail_count (0: default ln 3)"),
    filter_quantile: float = typer.Option(0.0, "--filter-quantile", help="q of the quantile filter (0: default)"),
    format_bonus: float = typer.Option(0.1, "--format-bonus", help="reward for a well-formed answer that is wrong"),
    prompt_style: str = typer.Option("plain", "--prompt-style", help="plain | oneshot (a solved example in the prompt)"),
    prefill: str = typer.Option("Answer:", "--prefill", help="start of the assistant reply the completion continues ('' for none)"),
    error_target: float = typer.Option(0.0, "--error-target", help="foursight: per-group k = smallest of 0,16,32,... with relative W4A4 error <= this (0: use --channels)"),
    max_k: int = typer.Option(0, "--max-k", help="cap on k for --error-target (0: none)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoint of --out (skip a completed log)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="resume checkpoint path (default: OUT.ckpt)"),
    stop_at: float = typer.Option(0.0, "--stop-at", help="pause with a checkpoint before a step starting after this Unix time (0: never)"),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="also checkpoint every N steps (0: only when pausing)"),
    bf16_layers: Optional[list[str]] = typer.Option(None, "--bf16-layers", help="whole layers the rollout keeps in BF16 (the practitioners' carve-out): attention, mlp, first:N, last:N, block:I, & to intersect, or a name/re: pattern; repeatable"),
    follow: bool = typer.Option(True, "--follow/--no-follow", help="log follow/* per sync: quantized code flips, cos(dW_rollout, dW_learner)"),
    kernel_autotune: bool = typer.Option(False, "--kernel-autotune", help="let the SpliceGEMM autotuner time kernel configs during the run (default off: fixed configs, reproducible)"),
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic", help="torch deterministic algorithms (warn only) + fixed cuBLAS workspace"),
) -> None:
    """GRPO with BF16 / FP8 / NVFP4 / FourSight (W4A4 or W4A16) rollouts on a verifiable task; logs JSONL (see docs/rl.md)."""

    cfg = RLConfig(model=model, task=task, rollout_precision=rollout_precision, filter=filter, engine=engine, steps=steps,
                   prompts_per_step=prompts_per_step, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
                   clip_eps=clip_eps, kl_coef=kl_coef, channels=channels, eval_every=eval_every, eval_size=eval_size, seed=seed,
                   device=device, out=out, time_budget_s=time_budget_s, sync=sync, tis_cap=tis_cap or None, old_logprobs=old_logprobs,
                   filter_tau=filter_tau or None, filter_quantile=filter_quantile or None, format_bonus=format_bonus,
                   prompt_style=prompt_style, prefill=prefill, error_target=error_target or None, max_k=max_k or None,
                   resume=resume, checkpoint=checkpoint, stop_at=stop_at, checkpoint_every=checkpoint_every,
                   bf16_layers=list(bf16_layers or []), follow=follow, kernel_autotune=kernel_autotune, deterministic=deterministic)
    typer.echo(f"wrote {run_rl(cfg, log=typer.echo)}")
