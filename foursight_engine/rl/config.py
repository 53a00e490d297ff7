"""Options of one ``foursight rl`` run (:class:`RLConfig`, the CLI's flags) and the RL error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from foursight.rl import tasks as rl_tasks

#: rollout precisions: BF16 copy; FP8 rowwise W8A8 (the FlashRL anchor, foursight.fp8); NVFP4 W4A4
#: k=0; FourSight W4A4 with k BF16 channels (--channels or --error-target); FourSight W4A16
#: (4-bit weights with k BF16 channels, BF16 activations)
PRECISIONS = ("bf16", "fp8", "nvfp4", "foursight", "w4a16")
#: precisions whose layers carry a BF16 channel set chosen by calibration
CHANNEL_PRECISIONS = ("foursight", "w4a16")
FILTERS = ("none", "max_token", "tail_count", "geo_mean", "quantile")
ENGINES = ("hf", "vllm")
#: where π_old of the clipped surrogate comes from: the rollout engine's log-probs of the sampled
#: tokens (ρ = π_θ / π_rollout, the study of 2026-12-03), or the learner's own detached log-probs
#: (ρ = 1 on the one update per batch: verl's recomputed old_log_prob, TRL's default); with
#: "learner" the rollout log-probs still feed the TIM metrics, the filter and --tis-cap weights
OLD_LOGPROBS = ("rollout", "learner")


class RLError(ValueError):
    """Bad RL option or state; the message names the option."""


# ---------------------------------------------------------------------------------------------


@dataclass
class RLConfig:
    """Options of one RL run (the CLI flags of ``foursight rl``)."""

    model: str | None = None  # None: the packaged SmolLM2-135M-Instruct
    task: str = "add"
    rollout_precision: str = "foursight"
    filter: str = "none"
    engine: str = "hf"
    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8
    max_new_tokens: int = 12
    lr: float = 2e-5
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    channels: str = "32"
    eval_every: int = 10
    eval_size: int = 128
    seed: int = 0
    device: str = "auto"
    out: str = "runs/rl.jsonl"
    time_budget_s: float = 0.0
    sync: str = "inproc"
    format_bonus: float = 0.1
    prompt_style: str = "plain"
    prefill: str = "Answer:"
    tis_cap: float | None = None
    old_logprobs: str = "rollout"
    filter_tau: float | None = None
    filter_quantile: float | None = None
    #: FourSight only: per input group the smallest k of 0, 16, 32, ... whose relative W4A4 output
    #: error on calibration rows is <= this (foursight.channels.choose_k), instead of --channels
    error_target: float | None = None
    max_k: int | None = None
    #: continue from ``checkpoint`` (default ``out`` + ".ckpt") if it exists; a log that ends with
    #: a ``done`` record is left as it is
    resume: bool = False
    checkpoint: str | None = None
    #: pause (checkpoint + a ``pause`` record) before a step that would start after this Unix time (0: never)
    stop_at: float = 0.0
    #: also checkpoint every this many steps (0: only when pausing)
    checkpoint_every: int = 0
    #: whole layers the rollout engine keeps in BF16 (``--bf16-layers``: attention, mlp, first:N,
    #: last:N, block:I, ``&`` to intersect, or a name / re: pattern; :mod:`foursight.bf16_layers`)
    bf16_layers: list[str] = field(default_factory=list)
    #: log ``follow/*`` per sync: NVFP4/FP8 code flips and cos(ΔW_rollout, ΔW_learner) (:mod:`foursight.rl.follow`)
    follow: bool = True
    #: let the SpliceGEMM autotuner time kernel configurations during the run (off: the first
    #: candidate of each datapath, fixed, so two runs of a seed run the same kernels)
    kernel_autotune: bool = False
    #: torch.use_deterministic_algorithms(True, warn_only=True) and a fixed cuBLAS workspace
    deterministic: bool = True

    def checkpoint_path(self) -> str:
        return self.checkpoint or f"{self.out}.ckpt"

    def validate(self) -> None:
        if self.rollout_precision not in PRECISIONS:
            raise RLError(f"--rollout-precision: expected one of {PRECISIONS}, got {self.rollout_precision!r}")
        if self.filter not in FILTERS:
            raise RLError(f"--filter: expected one of {FILTERS}, got {self.filter!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise RLError(f"--old-logprobs: expected one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        if self.engine not in ENGINES:
            raise RLError(f"--engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.engine == "vllm" and self.rollout_precision not in ("nvfp4", "foursight"):
            raise RLError(f"--engine vllm: --rollout-precision must be nvfp4 or foursight (weights are synced through the "
                          f"FourSight worker extension), got {self.rollout_precision!r}; use --engine hf for bf16, fp8 and w4a16 rollouts")
        if self.error_target is not None:
            if self.rollout_precision != "foursight":
                raise RLError(f"--error-target applies to --rollout-precision foursight only, got {self.rollout_precision!r}")
            if not self.error_target > 0:
                raise RLError(f"--error-target must be > 0, got {self.error_target}")
            if self.engine != "hf":
                raise RLError("--error-target: only with --engine hf")
        if self.max_k is not None and self.max_k < 0:
            raise RLError(f"--max-k must be >= 0, got {self.max_k}")
        if self.checkpoint_every < 0:
            raise RLError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.bf16_layers and self.rollout_precision == "bf16":
            raise RLError("--bf16-layers: the bf16 rollout precision has nothing to carve out; use it with nvfp4, foursight, w4a16 or fp8")
        if self.bf16_layers and self.engine != "hf":
            raise RLError("--bf16-layers: only with --engine hf")
        if self.bf16_layers and self.error_target is not None:
            raise RLError("--bf16-layers with --error-target is not supported (the per-group k of a carved group is undefined)")
        if self.task not in rl_tasks.TASKS:
            raise RLError(f"--task: unknown task {self.task!r}; choose one of {sorted(rl_tasks.TASKS)}")
        for name in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "eval_every", "eval_size"):
            if getattr(self, name) < 1:
                raise RLError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise RLError(f"--group-size must be >= 2 for group-relative advantages, got {self.group_size}")
        if not self.lr > 0:
            raise RLError(f"--lr must be > 0, got {self.lr}")

    def filter_config(self):
        from foursight.trainer_bridge.filters import FilterConfig

        kw: dict[str, Any] = {"policy": self.filter, "tis_cap": self.tis_cap}
        if self.filter_tau is not None:
            kw["tau"] = self.filter_tau
        if self.filter_quantile is not None:
            kw["quantile"] = self.filter_quantile
        return FilterConfig(**kw)
