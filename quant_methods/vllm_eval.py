"""Teacher-forced logprobs from a vLLM engine and from a PyTorch (HF) model, on the same tokens.

Used by the vLLM tests and ``benchmarks/vllm_mismatch.py`` to compare an engine with the
PyTorch reference model of a checkpoint (``foursight.hf.load_reference_model``) and engine
variants (BF16 / FourSight / plain NVFP4) with each other.
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


@torch.no_grad()
def hf_prompt_logprobs(model: torch.nn.Module, seqs: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Same as :func:`engine_prompt_logprobs` for an HF causal LM (one sequence at a time,
    log-softmax of the float32 logits)."""
    res = []
    dev = next(model.parameters()).device
    for s in seqs:
        ids = torch.tensor([list(s)], device=dev)
        logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        res.append(lp.double().cpu())
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
