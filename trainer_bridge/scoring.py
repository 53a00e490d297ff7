"""Learner-side log-probs of streamed rollouts, padding, and the filter in one call.

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


def _transform(logits: torch.Tensor, r: Rollout, mode: str, i: int) -> torch.Tensor:
    if mode == "raw_logprobs":
        return logits
    if mode == "processed_logprobs":
        if r.top_p < 1.0 or r.top_k > 0:
            raise ScoringError(
                f"rollouts[{i}]: processed_logprobs with top_p={r.top_p}, top_k={r.top_k} cannot be reproduced by the learner; "
                "run the engine with raw logprobs (vLLM --logprobs-mode raw_logprobs)"
            )
        return logits / r.temperature if r.temperature > 0 else logits
    raise ScoringError(f"rollouts[{i}]: unknown logprobs_mode {mode!r}")


@torch.no_grad()
def score(
    model: Any,
    rollouts: Sequence[Rollout],
    batch_size: int = 8,
    device: str | torch.device | None = None,
    logprobs_mode: str | None = None,
) -> list[torch.Tensor]:
    """Learner log-probs of each rollout's sampled tokens.

    Args:
        model: an HF causal LM (``model(input_ids, attention_mask).logits`` [B, L, V]).
        rollouts: :class:`Rollout` objects (prompt_ids, token_ids, temperature, top_p/k, logprobs_mode).
        batch_size: sequences per forward pass (right-padded).
        device: where to run; default the model's device.
        logprobs_mode: override the rollouts' own ``logprobs_mode``.
    Returns:
        One float32 tensor [len(token_ids)] per rollout (on CPU), in the rollout's convention.
    """
    if batch_size < 1:
        raise ScoringError(f"batch_size must be >= 1, got {batch_size}")
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    out: list[torch.Tensor] = [torch.zeros(0)] * len(rollouts)
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].token_ids))
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        seqs = []
        for i in idx:
            r = rollouts[i]
            if not r.prompt_ids:
                raise ScoringError(f"rollouts[{i}]: empty prompt_ids")
            if len(r.logprobs) != len(r.token_ids):
                raise ScoringError(f"rollouts[{i}]: {len(r.token_ids)} token_ids but {len(r.logprobs)} logprobs")
            seqs.append(list(r.prompt_ids) + list(r.token_ids))
        L = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        att = torch.zeros(len(seqs), L, dtype=torch.long)
        for b, x in enumerate(seqs):
            ids[b, : len(x)] = torch.tensor(x)
            att[b, : len(x)] = 1
        logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits
        for b, i in enumerate(idx):
            r = rollouts[i]
            P, T = len(r.prompt_ids), len(r.token_ids)
            if T == 0:
                out[i] = torch.zeros(0, dtype=torch.float32)
                continue
            lg = logits[b, P - 1 : P - 1 + T].float()
            lg = _transform(lg, r, logprobs_mode or r.logprobs_mode, i)
            tok = torch.tensor(r.token_ids, device=lg.device)
            out[i] = torch.log_softmax(lg, -1).gather(-1, tok[:, None])[:, 0].cpu()
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
