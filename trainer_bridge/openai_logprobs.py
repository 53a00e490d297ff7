"""Token strings and logprobs in the shapes vLLM's OpenAI server answers: :func:`token_strings` (a
token as vLLM decodes it), :class:`TokenNames` (the names an answer shows, or ``"token_id:<id>"``),
:func:`completion_logprobs` (``/v1/completions``' ``logprobs`` object) and :func:`chat_logprobs`
(``/v1/chat/completions``' ``logprobs.content``), with -inf clamped to :data:`MIN_LOGPROB` as vLLM does."""

from __future__ import annotations

import json
from typing import Any

#: vLLM clamps -inf logprobs to this in its answers (JSON has no infinity)
MIN_LOGPROB = -9999.0


def _space_marker(hf_tok) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (whose ``decode``
    strips a token's leading space), None for byte-level ones; as vLLM's ``get_leading_space_marker``."""
    cached = getattr(hf_tok, "_foursight_space_marker", "?")
    if cached != "?":
        return cached
    marker = None
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except Exception:  # noqa: BLE001 - no marker then
            pre = {}
        subs = [pre] if pre.get("type") == "Metaspace" else pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
        marker = next((x.get("replacement", "\u2581") for x in subs if x.get("type") == "Metaspace"), None)
    try:
        hf_tok._foursight_space_marker = marker
    except AttributeError:
        pass
    return marker


def token_strings(hf_tok, ids: list[int]) -> list[str]:
    """Each token's own text, as vLLM names tokens in logprobs (``convert_ids_list_to_tokens``:
    ``decode([id])``, with the leading spaces a SentencePiece ``decode`` strips put back)."""
    if not ids:
        return []
    marker = _space_marker(hf_tok)
    plain = [hf_tok.decode([t]) or "" for t in ids]
    if marker is None:
        return plain
    out = []
    for raw, text in zip(hf_tok.convert_ids_to_tokens(ids), plain):
        n = len(raw) - len(raw.lstrip(marker)) if raw else 0
        missing = n - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if missing > 0 else text)
    return out


def _completed(hf_tok, tid: int, context: list[int]) -> str:
    """The text of a token whose own decoding ends in U+FFFD (a byte of a character split across
    tokens), from the sampled tokens before it, as vLLM's logprobs processor corrects it
    (``_correct_decoded_token``): "" while the character is incomplete."""
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = hf_tok.decode(ctx + [tid])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if hf_tok.decode([ctx[j]]).endswith("\ufffd"):
                clean = j
            else:
                break
        prefix = hf_tok.decode(ctx[:clean]) if clean > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for x, y in zip(prefix, full):
            if x != y:
                break
            common += 1
        return full[common:]
    return ""


class TokenNames:
    """Token id -> the string an answer names it by: as vLLM names tokens in logprobs
    (:func:`token_strings`, a split character's bytes completed from the ``context`` of sampled
    tokens before the position, :func:`_completed`), or ``"token_id:<id>"`` with
    ``return_tokens_as_token_ids``. Plain names are cached per request."""

    def __init__(self, hf_tok, as_ids: bool):
        self.tok, self.as_ids, self.cache = hf_tok, as_ids, {}

    def __call__(self, ids: list[int], context: list[int] | None = None) -> list[str]:
        if self.as_ids:
            return [f"token_id:{t}" for t in ids]
        todo = [t for t in dict.fromkeys(ids) if t not in self.cache]
        self.cache.update(zip(todo, token_strings(self.tok, todo)))
        out = [self.cache[t] for t in ids]
        if context is not None:
            out = [_completed(self.tok, t, context) if x.endswith("\ufffd") else x for t, x in zip(ids, out)]
        return out


def _clamp(v: float) -> float:
    return max(float(v), MIN_LOGPROB)


def completion_logprobs(names: TokenNames, ids: list[int], vals: list[float | None], tops: list[list[tuple[int, float]] | None] | None,
                        k: int, offset: int, contexts: list[list[int] | None]) -> dict[str, Any]:
    """A completion choice's ``logprobs`` object for ``ids`` (vLLM's ``_create_completion_logprobs``):
    ``top_logprobs[t]`` maps the first k + 1 alternatives (the token itself, then the most likely)
    to their logprobs; ``text_offset`` counts from ``offset``; ``contexts[t]``: the sampled tokens
    before position t (None where the position has no logprob: the token is decoded alone)."""
    toks: list[str] = []
    out_top: list[dict[str, float] | None] = []
    for t, v in enumerate(vals):
        if v is None:
            toks.append(names.tok.decode(ids[t]) if not names.as_ids else names([ids[t]])[0])
            out_top.append(None)
            continue
        toks.append(names([ids[t]], contexts[t])[0])
        alts = (tops[t] if tops is not None and tops[t] is not None else [(ids[t], v)])[: k + 1]
        d: dict[str, float] = {}
        for s_, (_, lp) in zip(names([a for a, _ in alts], contexts[t]), alts):
            d[s_] = _clamp(lp)
        out_top.append(d)
    offs = []
    for x in toks:
        offs.append(offset)
        offset += len(x)
    return {"text_offset": offs, "token_logprobs": [None if v is None else _clamp(v) for v in vals], "tokens": toks, "top_logprobs": out_top}


def chat_logprobs(names: TokenNames, ids: list[int], vals: list[float], tops: list[list[tuple[int, float]]] | None, k: int,
                  contexts: list[list[int] | None]) -> dict[str, Any]:
    """A chat choice's ``logprobs.content`` for ``ids`` (vLLM's ``_create_chat_logprobs``): each
    token with its first k alternatives (the token itself, then the most likely)."""
    content = []
    for t, (tok_id, v) in enumerate(zip(ids, vals)):
        name = names([tok_id], contexts[t])[0]
        alts = (tops[t] if tops is not None else [])[:k]
        content.append({"token": name, "logprob": _clamp(v), "bytes": list(name.encode("utf-8", errors="replace")),
                        "top_logprobs": [{"token": s_, "logprob": _clamp(lp), "bytes": list(s_.encode("utf-8", errors="replace"))}
                                         for s_, (_, lp) in zip(names([a for a, _ in alts], contexts[t]), alts)]})
    return {"content": content}


# ---- one choice, whole or streamed ----------------------------------------------------------------
