"""Teacher-forced logprobs from vLLM (in process or a server) and how the tests compare them.

The HF side is :func:`foursight.trainer_bridge.scoring.sequence_logprobs`; SGLang's is in
:mod:`helpers.sglang_engine`.
"""

from __future__ import annotations

from typing import Sequence

import torch


def fixed_sequences(tokenizer, texts: Sequence[str], max_len: int = 64) -> list[list[int]]:
    """Token ids of ``texts`` truncated to ``max_len`` (sequences shorter than 2 tokens are dropped)."""
    out = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=True)["input_ids"][:max_len]
        if len(ids) >= 2:
            out.append(list(ids))
    return out


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


def server_prompt_logprobs(url: str, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The same from a vLLM server (its ``prompt_logprobs`` extension of ``/v1/completions``)."""
    import httpx

    out = []
    for s in seqs:
        r = httpx.post(url + "/v1/completions", json={"prompt": list(s), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
                       timeout=120)
        r.raise_for_status()
        plp = r.json()["choices"][0]["prompt_logprobs"]
        out.append(torch.tensor([plp[t][str(s[t])]["logprob"] for t in range(1, len(s))], dtype=torch.float64))
    return out
