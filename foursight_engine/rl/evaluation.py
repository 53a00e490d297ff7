"""The rollout prompts and the held-out evaluation of ``foursight rl``: :func:`prompt_ids` (the
chat-templated prompt of a problem, used by sampling and evaluation alike), :func:`generate_answers` /
:func:`score_answers` (a model's answers to the held-out questions and their accuracy), and the three
evaluations an ``eval`` record holds: :func:`evaluate` (the learner, greedy: ``eval_acc``),
:func:`evaluate_sampled` (the learner at temperature 1, what GRPO optimises and less saturated than greedy:
``eval_sampled_acc``) and :func:`evaluate_engine` (the quantized rollout engine's own model, greedy: the
policy a user deploys, ``engine_eval_acc``)."""

from __future__ import annotations

from typing import Any, Sequence

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
def generate_answers(model: nn.Module, tok, problems: Sequence[rl_tasks.Problem], max_new_tokens: int, *, samples: int = 1,
                     temperature: float = 0.0, seed: int | None = None, batch_size: int = 64, style: str = "plain",
                     prefill: str = "", amp: bool = True) -> list[str]:
    """``samples`` answers per problem (problem 0's first), each ``prefill`` + the decoded completion, drawn by the one
    HF sampler in batches of ``batch_size`` rows: greedy at ``temperature`` 0, else over the full vocabulary with row i
    seeded ``seed + i``. ``amp``: BF16 autocast, as the learner runs (the FP32 master weights); off for a model that
    is already the engine's BF16 / quantized copy, which samples without it (``HFRollout.generate``)."""
    from foursight.trainer_bridge.hf_sampling import hf_generate

    was_training = model.training
    model.eval()
    ids = [p for p in prompt_ids(tok, problems, style, prefill) for _ in range(samples)]
    dev = next(model.parameters()).device
    eos = eos_ids(model, tok)
    texts: list[str] = []
    try:
        for s in range(0, len(ids), batch_size):
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
                out = hf_generate(model, ids[s : s + batch_size], max_new_tokens, temperature=temperature, eos_ids=eos,
                                  seed=None if seed is None else seed + s)
            texts += [prefill + tok.decode(smp.token_ids, skip_special_tokens=True) for smp in out]
    finally:
        if was_training:
            model.train()
    return texts


def score_answers(texts: Sequence[str], problems: Sequence[rl_tasks.Problem], samples: int = 1) -> dict[str, float]:
    """The share of ``texts`` (``samples`` per problem, in :func:`generate_answers`' order) with the exact answer
    (``acc``) and with a well-formed one (``format``)."""
    group = [p for p in problems for _ in range(samples)]
    if len(texts) != len(group):
        raise ValueError(f"score_answers: {len(texts)} answers for {len(problems)} problems x {samples} samples")
    correct = sum(bool(rl_tasks.is_correct(t, p)) for t, p in zip(texts, group))
    formatted = sum(rl_tasks.extract_answer(t) is not None for t in texts)
    return {"acc": correct / len(group), "format": formatted / len(group)}


def evaluate(model: nn.Module, tok, problems: Sequence[rl_tasks.Problem], max_new_tokens: int, batch_size: int = 64,
             style: str = "plain", prefill: str = "") -> dict[str, float]:
    """Greedy accuracy (exact answer) and answer-format rate of ``model`` (BF16 compute) on ``problems``."""
    sc = score_answers(generate_answers(model, tok, problems, max_new_tokens, batch_size=batch_size, style=style, prefill=prefill),
                       problems)
    return {"eval_acc": sc["acc"], "eval_format": sc["format"]}


def evaluate_sampled(model: nn.Module, tok, problems: Sequence[rl_tasks.Problem], max_new_tokens: int, samples: int, seed: int,
                     batch_size: int = 128, style: str = "plain", prefill: str = "") -> dict[str, float]:
    """The learner's held-out accuracy under sampling: ``samples`` answers per problem at temperature 1 over the full
    vocabulary (as the rollouts draw; BF16 autocast, as the learner runs), seeded from ``seed``. Less saturated
    than the greedy accuracy, and what GRPO optimises."""
    sc = score_answers(generate_answers(model, tok, problems, max_new_tokens, samples=samples, temperature=1.0, seed=seed,
                                        batch_size=batch_size, style=style, prefill=prefill), problems, samples)
    return {"eval_sampled_acc": sc["acc"], "eval_sampled_format": sc["format"]}


def evaluate_engine(engine: Any, tok, problems: Sequence[rl_tasks.Problem], max_new_tokens: int, batch_size: int = 64,
                    style: str = "plain", prefill: str = "") -> dict[str, float]:
    """The rollout engine's own greedy held-out accuracy: its quantized model (``engine.model``, already BF16, so no
    autocast, as it samples) answering the questions greedily. The caller syncs the engine to the weights it means
    first. Engines without a model in this process (vLLM) cannot be evaluated here."""
    if getattr(engine, "model", None) is None:
        raise ValueError(f"evaluate_engine: the {type(engine).__name__} engine holds no model in this process")
    sc = score_answers(generate_answers(engine.model, tok, problems, max_new_tokens, batch_size=batch_size, style=style,
                                        prefill=prefill, amp=False), problems)
    return {"engine_eval_acc": sc["acc"], "engine_eval_format": sc["format"]}
