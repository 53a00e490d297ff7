"""``foursight rl``: a small GRPO loop with BF16, FP8 rowwise, NVFP4 or FourSight (W4A4 / W4A16) rollouts.

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

Rollouts are :class:`foursight.trainer_bridge.protocol.Rollout` records. The rollout engines are
bridge backends: :class:`~foursight.trainer_bridge.backends.hf_rollout.HFRollout` (HF generation is
:func:`foursight.trainer_bridge.hf_sampling.hf_generate`, the one HF sampler) and
:class:`~foursight.trainer_bridge.backends.vllm_inprocess.VLLMRollout`; the channel sets come from
:func:`foursight.channels.calibrate_channel_sets`.

Modules: ``config`` (RLConfig), ``grpo`` (advantages, loss), ``loop`` (run_rl and its steps),
``run_setup`` (what a run builds before its first step: RLRun, build_run), ``evaluation`` (prompts, the
held-out eval), ``records`` (the log, checkpoints, provenance, memory),
``tasks`` (the verifiable tasks), ``follow``, ``cli`` (the command).

Every ``eval_every`` steps the learner answers the held-out eval set greedily. One JSON line is
written per step (see :func:`run_rl`). The numerics of the quantized layers live in
:mod:`foursight.layer` / :mod:`foursight.hf` (Triton kernels on CUDA); nothing is duplicated here.
"""

import importlib

#: the package's names and the module each comes from, imported when first read (``loop`` and ``grpo``
#: import torch and the engines; the command line imports ``cli``, which imports this index first)
_FROM = {**dict.fromkeys(("CHANNEL_PRECISIONS", "ENGINES", "FILTERS", "PRECISIONS", "RLConfig", "RLError"), "config"),
         "group_advantages": "grpo", "grpo_loss": "grpo", "evaluate": "evaluation", "prompt_ids": "evaluation", "run_rl": "loop",
         "read_log": "records", "state_dict_sha256": "records"}

__all__ = list(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"foursight.rl.{_FROM[name]}"), name)
