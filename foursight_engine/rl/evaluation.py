"""The rollout prompts and the held-out evaluation of ``foursight rl``: :func:`prompt_ids` (the
chat-templated prompt of a problem, used by sampling and evaluation alike) and :func:`evaluate`
(greedy accuracy and answer-format rate)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from foursight.rl import tasks as rl_tasks
from foursight.trainer_bridge.hf_sampling import eos_ids


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
    from foursight.trainer_bridge.hf_sampling import hf_generate

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
