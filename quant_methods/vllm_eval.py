"""Teacher-forced logprobs from an in-process ``vllm.LLM``, and the helpers the vLLM tests and
``benchmarks/engine_mismatch.py`` compare them with (the HF side is
:func:`foursight.trainer_bridge.scoring.sequence_logprobs`).
"""

from __future__ import annotations

from typing import Sequence

import torch


def engine_prompt_logprobs(llm, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Logprob of every token after the first, teacher-forced, from a ``vllm.LLM``.

    Args:
        llm: a ``vllm.LLM``.
        seqs: token-id sequences (length ≥ 2).
    Returns:
        One float64 tensor [len(seq) - 1] per sequence: ``log p(seq[t] | seq[:t])`` for t ≥ 1.
    """
    from vllm import SamplingParams, TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in seqs], sp, use_tqdm=False)
    res = []
    for s, o in zip(seqs, outs):
        plp = o.prompt_logprobs
        vals = [plp[t][s[t]].logprob for t in range(1, len(s))]
        res.append(torch.tensor(vals, dtype=torch.float64))
    return res


def abs_diff_stats(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> dict[str, float]:
    """Mean and max |a - b| over all tokens of paired per-sequence logprob tensors."""
    d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
    return {"mean": float(d.mean()), "max": float(d.max()), "tokens": int(d.numel())}


def fixed_sequences(tokenizer, texts: Sequence[str], max_len: int = 64) -> list[list[int]]:
    """Token ids of ``texts`` truncated to ``max_len`` (sequences shorter than 2 tokens are dropped)."""
    out = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=True)["input_ids"][:max_len]
        if len(ids) >= 2:
            out.append(list(ids))
    return out
