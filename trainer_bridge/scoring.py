"""Learner-side log-probs of rollouts, padding, and the filter in one call.

:func:`teacher_forced_logprobs` is FourSight's one teacher-forcing function for HF models.
:func:`score` teacher-forces ``prompt_ids + token_ids`` through an HF model (BF16 by default)
and returns the log-prob of each sampled token **in the engine's convention**:

* ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)``, no temperature, no top-p/top-k.
  This is the only convention a learner can reproduce exactly when sampling used top-p/top-k
  (processed logprobs are renormalised over the truncated support: the vllm#42259 / trl#6789
  pitfall), so the bridge asks for it by default.
* ``processed_logprobs``: ``log_softmax(logits / T)``; refused with top-p < 1 or top-k > 0,
  because the truncated support is not known to the learner.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from foursight.trainer_bridge.filters import FilterConfig, FilterResult, apply_filter
from foursight.trainer_bridge.metrics import TIMError
from foursight.trainer_bridge.protocol import Rollout


class ScoringError(ValueError):
    """A rollout cannot be scored in its engine's logprob convention (message names the rollout)."""


def teacher_forced_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperatures: Sequence[float] | None = None,
    device: str | torch.device | None = None,
    pad_id: int = 0,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log-probs of ``completions`` given ``prompts`` from an HF causal LM: the one
    place FourSight computes them (learner scoring, ``foursight rl``'s loss, ``foursight compare``'s
    HF engines, the engine tests' reference).

    One forward over the right-padded batch ``prompt + completion`` (with its attention mask);
    ``log_softmax`` of the float32 logits, divided by ``temperatures[b]`` first where given.
    ``fp32_head``: the LM head runs in float32 on the final hidden states (as SGLang's
    ``--enable-fp32-lm-head``) instead of in the model's dtype.
    Gradients flow when enabled (autocast is the caller's choice).

    Returns:
        ``(logp, mask)``: float32 [B, T] and bool [B, T], T = the longest completion (at least 1),
        zeros / False at padding.
    """
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    L = max(len(x) for x in seqs)
    T = max([len(c) for c in completions] + [1])
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, x in enumerate(seqs):
        ids[b, : len(x)] = torch.tensor(x)
        att[b, : len(x)] = 1
    ids = ids.to(dev)
    att = None if bool((att == 1).all()) else att.to(dev)  # no padding: no mask (the plain causal forward)
    if fp32_head:
        h = model.get_decoder()(input_ids=ids, attention_mask=att).last_hidden_state
        head = model.get_output_embeddings()
        logits = h.float() @ head.weight.float().t()
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias.float()
    else:
        logits = model(input_ids=ids, attention_mask=att).logits
    out = torch.zeros(len(seqs), T, device=dev)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool, device=dev)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        P, n = len(p), len(c)
        if n == 0:
            continue
        lg = logits[b, P - 1 : P - 1 + n].float()
        if temperatures is not None and temperatures[b] not in (None, 1.0):
            lg = lg / temperatures[b]
        out[b, :n] = torch.log_softmax(lg, -1).gather(-1, ids[b, P : P + n, None])[:, 0]
        mask[b, :n] = True
    return out, mask


def sequence_logprobs(model: Any, seqs: Sequence[Sequence[int]], fp32_head: bool = False) -> list[torch.Tensor]:
    """``log p(seq[t] | seq[:t])`` for t ≥ 1 of each sequence, one at a time, float64 [len - 1]
    (:func:`teacher_forced_logprobs` with the first token as the prompt)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            lp, _ = teacher_forced_logprobs(model, [list(s[:1])], [list(s[1:])], fp32_head=fp32_head)
            out.append(lp[0, : len(s) - 1].double().cpu())
    return out


def _temperature(r: Rollout, mode: str, i: int) -> float:
    """The temperature that turns raw logits into ``r``'s logprob convention."""
    if mode == "raw_logprobs":
        return 1.0
    if mode == "processed_logprobs":
        if r.top_p < 1.0 or r.top_k > 0:
            raise ScoringError(
                f"rollouts[{i}]: processed_logprobs with top_p={r.top_p}, top_k={r.top_k} cannot be reproduced by the learner; "
                "run the engine with raw logprobs (vLLM --logprobs-mode raw_logprobs)"
            )
        return r.temperature if r.temperature > 0 else 1.0
    raise ScoringError(f"rollouts[{i}]: unknown logprobs_mode {mode!r}")


@torch.no_grad()
def score(
    model: Any,
    rollouts: Sequence[Rollout],
    batch_size: int = 8,
    device: str | torch.device | None = None,
    logprobs_mode: str | None = None,
) -> list[torch.Tensor]:
    """Learner log-probs of each rollout's sampled tokens (:func:`teacher_forced_logprobs`).

    Args:
        model: an HF causal LM (``model(input_ids, attention_mask).logits`` [B, L, V]).
        rollouts: :class:`Rollout` objects (prompt_ids, token_ids, temperature, top_p/k, logprobs_mode).
        batch_size: sequences per forward pass (right-padded, sorted by length).
        device: where to run; default the model's device.
        logprobs_mode: override the rollouts' own ``logprobs_mode``.
    Returns:
        One float32 tensor [len(token_ids)] per rollout (on CPU), in the rollout's convention.
    """
    if batch_size < 1:
        raise ScoringError(f"batch_size must be >= 1, got {batch_size}")
    temps = []
    for i, r in enumerate(rollouts):
        if not r.prompt_ids:
            raise ScoringError(f"rollouts[{i}]: empty prompt_ids")
        if len(r.logprobs) != len(r.token_ids):
            raise ScoringError(f"rollouts[{i}]: {len(r.token_ids)} token_ids but {len(r.logprobs)} logprobs")
        temps.append(_temperature(r, logprobs_mode or r.logprobs_mode, i))
    out: list[torch.Tensor] = [torch.zeros(0)] * len(rollouts)
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].token_ids))
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        lp, _ = teacher_forced_logprobs(model, [rollouts[i].prompt_ids for i in idx], [rollouts[i].token_ids for i in idx],
                                        [temps[i] for i in idx], device)
        for b, i in enumerate(idx):
            out[i] = lp[b, : len(rollouts[i].token_ids)].float().cpu()
    return out


def pad_rollouts(rollouts: Sequence[Rollout], learner_logprobs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to [B, T]: (logp_train float32, logp_rollout float32, mask bool), zeros at padding."""
    if len(rollouts) != len(learner_logprobs):
        raise TIMError(f"{len(rollouts)} rollouts but {len(learner_logprobs)} learner logprob tensors")
    T = max([len(r.token_ids) for r in rollouts] + [0])
    B = len(rollouts)
    lt = torch.zeros(B, T)
    lr = torch.zeros(B, T)
    m = torch.zeros(B, T, dtype=torch.bool)
    for b, (r, x) in enumerate(zip(rollouts, learner_logprobs)):
        n = len(r.token_ids)
        if x.numel() != n:
            raise TIMError(f"learner_logprobs[{b}] has {x.numel()} values, rollout has {n} tokens")
        lt[b, :n] = x.float()
        lr[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        m[b, :n] = True
    return lt, lr, m


def filter_rollouts(model: Any, rollouts: Sequence[Rollout], config: FilterConfig | dict | None = None,
                    batch_size: int = 8) -> FilterResult:
    """Score the rollouts with ``model`` and apply a TIM-aware filter: the loss masks of the batch."""
    lt, lr, m = pad_rollouts(rollouts, score(model, rollouts, batch_size=batch_size))
    return apply_filter(lt, lr, m, config)
