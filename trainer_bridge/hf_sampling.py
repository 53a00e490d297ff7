"""FourSight's one HF sampler: how a token is chosen from a Hugging Face model's logits.

Every HF generation of FourSight goes through here: the bridge's HF engine (one sample at a time,
interleaved by its scheduler, :mod:`foursight.trainer_bridge.backends.hf`), :func:`hf_generate`
(a batch in one ``model.generate`` call: ``foursight rl``'s HF rollouts and greedy evaluation, the
benchmarks) and so ``foursight compare``'s HF engines. One rule each for:

* **Logits processing** (:func:`process_logits`, :func:`choose_tokens`) — transformers' own processors in ``generate()``'s
  order: repetition penalty over prompt and completion, EOS masked until ``min_tokens``, then
  temperature, top-k, top-p, min-p. The model's ``generation_config`` adds nothing (no hidden
  repetition penalty or top-k from a model folder): only the request's parameters apply. The
  logprob returned with each token is the raw one (log-softmax of the unprocessed logits).
* **Seeding** (:func:`sample_generator`) — every sample draws from its own ``torch.Generator`` on
  the model's device; sample ``i`` of a call with seed ``s`` is seeded ``s + i`` (the bridge's
  :class:`~foursight.trainer_bridge.protocol.SamplingParams` rule, ``seed + i * n + j``, gives each
  sample its own seed the same way); without a seed, a random 63-bit one. So a sample's tokens do
  not depend on the other samples of its batch or on what runs beside it, and the global torch RNG
  is never touched. The draw is ``torch.multinomial`` over the processed probabilities; at
  ``temperature=0`` the argmax. (Until issue 27, :func:`hf_generate` reseeded the global RNG with
  ``torch.manual_seed(seed)`` and let ``generate()`` draw a whole batch from it; one sample alone
  gave the same tokens under both rules, a batch did not.)
* **End of a completion** (:func:`eos_ids`, :func:`finish_reason`) — the EOS ids are the
  tokenizer's EOS and the ``generation_config``'s (what vLLM stops at), plus the request's
  ``stop_token_ids``; a completion ends with its first EOS token ("stop"), with the token that
  completes a stop string (kept, vLLM semantics; "stop") or after ``max_tokens`` ("length").
"""

from __future__ import annotations

import random
import threading
from typing import Any, Callable, Sequence

import torch

from foursight.trainer_bridge.protocol import Rollout, SamplingParams


def eos_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """Token ids that end a completion, sorted: the tokenizer's EOS and the model's ``generation_config.eos_token_id``."""
    ids: set[int] = set()
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(e, int):
        ids.add(e)
    elif e:
        ids.update(int(x) for x in e)
    return sorted(ids)


def sample_generator(seed: int | None, device: Any = "cpu") -> torch.Generator:
    """The generator one sample draws from: seeded ``seed``, or a random 63-bit seed when None."""
    return torch.Generator(device=device).manual_seed(int(seed) if seed is not None else random.getrandbits(63))


def process_logits(raw: torch.Tensor, params: SamplingParams, seen: Sequence[Sequence[int]], n_generated: int,
                   eos: set[int]) -> torch.Tensor:
    """Processed scores [B, V] (float32) of the next token of B samples from their raw logits [B, V]:
    ``seen[b]`` is sample b's prompt and completion so far (read only for the repetition penalty),
    ``n_generated`` the completions' length."""
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    scores = raw.float().clone()
    if params.repetition_penalty != 1.0:  # row by row: the rows' histories differ in length
        rp = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
        for b, ids in enumerate(seen):
            scores[b : b + 1] = rp(torch.tensor([list(ids)], device=scores.device), scores[b : b + 1])
    if n_generated < params.min_tokens and eos:
        scores[:, sorted(eos)] = -float("inf")
    if params.temperature > 0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
        if params.top_k > 0:
            scores = TopKLogitsWarper(params.top_k)(None, scores)
        if params.top_p < 1.0:
            scores = TopPLogitsWarper(params.top_p)(None, scores)
        if params.min_p > 0:
            scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores


def choose_tokens(raw: torch.Tensor, params: SamplingParams, seen: Sequence[Sequence[int]], n_generated: int,
                  eos: set[int], gens: Sequence[torch.Generator]) -> torch.Tensor:
    """The next token of B samples, int64 [B] on the logits' device: the argmax of the processed
    scores at ``temperature=0``, else row b drawn with ``torch.multinomial`` from ``gens[b]``."""
    scores = process_logits(raw, params, seen, n_generated, eos)
    if params.temperature <= 0:
        return scores.argmax(-1)
    probs = torch.softmax(scores, -1)
    return torch.cat([torch.multinomial(probs[b : b + 1].to(g.device), 1, generator=g).to(probs.device)[0]
                      for b, g in enumerate(gens)])


def raw_logprobs(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Raw log-probs (log-softmax of the unprocessed logits [B, V]) of ``tokens`` [B], float32 [B]."""
    return torch.log_softmax(raw.float(), -1).gather(-1, tokens.view(-1, 1).to(raw.device))[:, 0]


def completes_stop(token_ids: Sequence[int], stop: Sequence[str], decode: Callable[[list[int]], str] | None) -> bool:
    """True when the decoded completion holds one of the ``stop`` strings."""
    return bool(stop) and decode is not None and any(x in decode(list(token_ids)) for x in stop)


def finish_reason(token_ids: Sequence[int], eos: set[int], max_tokens: int, stop: Sequence[str] = (),
                  decode: Callable[[list[int]], str] | None = None) -> str | None:
    """Why a completion whose last token is ``token_ids[-1]`` ends there ("stop", "length"), or None."""
    if token_ids and token_ids[-1] in eos:
        return "stop"
    if completes_stop(token_ids, stop, decode):
        return "stop"  # the token that completes a stop string is kept (vLLM semantics)
    if len(token_ids) >= max_tokens:
        return "length"
    return None


def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = -1, min_new_tokens: int = 0, eos_ids: Sequence[int] = (), seed: int | None = None,
                cancel: threading.Event | None = None, min_p: float = 0.0, repetition_penalty: float = 1.0,
                stop: Sequence[str] = (), tokenizer: Any = None) -> list[Rollout]:
    """A left-padded batch of prompts in one ``model.generate`` call, sampled by this module's rule.

    ``generate()`` runs the model (batching, KV cache, padding); the token of each step is chosen
    by a logits processor that applies :func:`choose_tokens` to the batch, every row with that row's own
    generator (row ``i`` seeded ``seed + i``), takes the raw log-prob of the chosen token there (no
    ``output_logits``: the memory of a step's logits is released at once), and hands ``generate()``
    a score that only that token can win (``generate()`` runs greedy). Each :class:`Rollout` holds the raw log-prob of
    every sampled token and ends as :func:`finish_reason` says (``eos_ids``, ``stop`` decoded with
    ``tokenizer``, ``max_new_tokens``). When ``cancel`` is set, generation stops after the current token.
    """
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    if stop and tokenizer is None:
        raise ValueError("hf_generate: stop strings need a tokenizer")
    params = SamplingParams(max_tokens=max_new_tokens, min_tokens=min_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty, stop=list(stop))
    p0 = next(model.parameters(), None)
    dev = p0.device if p0 is not None else next(model.buffers()).device
    eos = [int(t) for t in eos_ids]
    eos_set = set(eos)
    pad = eos[0] if eos else 0
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    att = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(list(p))
        att[b, L - len(p):] = 1
    gens = [sample_generator(None if seed is None else seed + b, dev) for b in range(len(prompts))]
    decode = tokenizer.decode if stop else None

    step_logprobs: list[torch.Tensor] = []  # [B] per step: the raw log-prob of the chosen token

    class _Choose(LogitsProcessor):
        def __call__(self, input_ids, scores):
            # ``scores`` are the raw float32 logits: no processor of generate() runs before this one
            seen = ([list(p) + input_ids[b, L:].tolist() for b, p in enumerate(prompts)]
                    if params.repetition_penalty != 1.0 else [()] * len(prompts))
            tokens = choose_tokens(scores, params, seen, input_ids.shape[1] - L, eos_set, gens)
            step_logprobs.append(raw_logprobs(scores, tokens))
            return torch.full_like(scores, -float("inf")).scatter_(1, tokens.view(-1, 1), 0.0)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            cancelled = cancel is not None and cancel.is_set()
            done = [cancelled or completes_stop(row, stop, decode) for row in input_ids[:, L:].tolist()] if stop \
                else [cancelled] * input_ids.shape[0]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                          eos_token_id=eos or None, pad_token_id=pad)
    stopping = StoppingCriteriaList([_Stop()] if stop or cancel is not None else [])
    with torch.no_grad():
        out = model.generate(ids.to(dev), attention_mask=att.to(dev), generation_config=gc,
                             logits_processor=LogitsProcessorList([_Choose()]), stopping_criteria=stopping)
    new = out.sequences[:, L:].cpu()
    # [B, T]: taken step by step above, so no [B, T, V] logits are kept (64 x [128, 49152] float32
    # is 1.5 GiB, and generate()'s output_logits held it twice); a finished row's later entries are
    # for tokens generate() replaced by padding, and are cut below
    lp = torch.stack(step_logprobs, 1).cpu() if step_logprobs else torch.zeros(len(prompts), 0)
    res = []
    for b, p in enumerate(prompts):
        toks = new[b].tolist()
        n, reason = len(toks), "length"
        for i in range(len(toks)):  # generate() pads a finished row: it ends where the rule says
            r = finish_reason(toks[: i + 1], eos_set, max_new_tokens, stop, decode)
            if r is not None:
                n, reason = i + 1, r
                break
        res.append(Rollout(prompt_ids=[int(t) for t in p], token_ids=[int(t) for t in toks[:n]],
                           logprobs=[float(v) for v in lp[b, :n]], finish_reason=reason))
    return res
