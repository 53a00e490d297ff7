"""OpenAI-compatible routes of the rollout bridge: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (non-streaming), for agent loops and trainers written against vLLM's
OpenAI server (docs/bridge.md lists the accepted fields).

Each request is translated into a :class:`~foursight.trainer_bridge.protocol.RolloutRequest` and
goes through the bridge's one admission and sampling path, the one ``/v1/rollouts`` uses: the
served model's field checks (a bad field is a 422 naming it in the OpenAI spelling), refusal when
no engine serves the current weights (503), the weight version held for the whole request (a
weight update waits for it), the least-loaded engine under the concurrency limit, the per-sample
timeout. Every choice carries, next to the OpenAI fields, the bridge's one rollout record
(``choice["rollout"]``: :class:`~foursight.trainer_bridge.protocol.Rollout` with token ids,
per-token logprobs in the engine's ``logprobs_mode``, engine and weight version). The response's
``weight_version`` is that version too. Sampling fields are vLLM's: top-level ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop``,
``stop_token_ids``, ``n``, ``seed``, ``min_tokens``, ``ignore_eos``, and vLLM's token-id extensions
``return_token_ids`` / ``return_tokens_as_token_ids``; unknown fields are refused (422 naming the
field), so that nothing is silently ignored. ``GET /v1/models`` lists the served model, and the
bridge answers vLLM's ``GET /health`` too, so TRL's ``VLLMClient`` generates through the bridge.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from foursight.trainer_bridge.protocol import ChatMessage, Prompt, Rollout, RolloutRequest, SamplingParams


class _Sampling(BaseModel):
    """The sampling fields both routes take (vLLM's names and defaults; OpenAI's ``max_tokens`` 16)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stream: Literal[False] = False
    user: str | None = None
    #: vLLM's token-id extensions (what TRL's ``VLLMClient`` sends): every choice also carries
    #: ``prompt_token_ids`` and ``token_ids``, and logprob tokens are spelled ``"token_id:<id>"``
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    def sampling(self, max_tokens: int) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=stops,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists.

    ``logprobs``: null or 0 (the sampled token's logprob in ``choices[i].logprobs.token_logprobs``,
    and, as vLLM does for 0, ``top_logprobs`` holding that token alone; alternatives are not
    returned). ``echo`` is not supported."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0)
    echo: Literal[False] = False

    @model_validator(mode="after")
    def _nonempty(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[Prompt]:
        p = self.prompt
        if isinstance(p, str):
            return [Prompt(text=p)]
        if all(isinstance(x, int) for x in p):
            return [Prompt(token_ids=list(p))]
        return [Prompt(text=x) if isinstance(x, str) else Prompt(token_ids=list(x)) for x in p]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: one conversation (``messages``; the bridge applies the chat template).

    ``logprobs: true`` returns the sampled tokens' logprobs in ``choices[i].logprobs.content``;
    ``top_logprobs`` may only be 0."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    add_generation_prompt: bool = True


def _openai_field(name: str, kind: str) -> str:
    """A bridge field name (``sampling.seed``, ``prompts[1].token_ids[3]``) as the OpenAI request spells it."""
    if name.startswith("sampling."):
        return name[len("sampling."):]
    if name.startswith("prompts"):
        return "messages" if kind == "chat" else "prompt" + name[len("prompts"):]
    return name


def _loc(loc) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + str(p))
    return out or "<body>"


def _error(status: int, fields: list[dict[str, str]], **extra) -> JSONResponse:
    msg = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return JSONResponse(status_code=status, content={"error": {"message": f"invalid request: {msg}", "type": "invalid_request_error",
                                                               "fields": fields}, **extra})


def _invalid(exc: ValidationError | ValueError, field: str = "<body>", kind: str | None = None) -> JSONResponse:
    if isinstance(exc, ValidationError):
        fields = [{"field": _loc(e["loc"]), "message": e["msg"]} for e in exc.errors()]
    else:
        fields = [{"field": field, "message": str(exc)}]
    if kind is not None:
        fields = [{**f, "field": _openai_field(f["field"], kind)} for f in fields]
    return _error(422, fields)


def _from_bridge_error(resp: JSONResponse, kind: str) -> JSONResponse:
    """An error answer of the bridge's admission (422 naming fields, 503 when no engine serves the
    current weights) in the OpenAI error shape, field names translated."""
    body = json.loads(bytes(resp.body))
    if "fields" in body:
        return _error(resp.status_code, [{**f, "field": _openai_field(f["field"], kind)} for f in body["fields"]])
    extra = {k: v for k, v in body.items() if k != "error"}
    return JSONResponse(status_code=resp.status_code, content={"error": {"message": body["error"], "type": "engine_unavailable"}, **extra})


def make_router(state: Any) -> APIRouter:
    """The OpenAI routes over a bridge's state (:class:`foursight.trainer_bridge.server.BridgeState`)
    (the API key, Host/Origin and body limit are the bridge middleware's); ``server.create_app`` includes it."""
    router = APIRouter()

    def _tokenizer():
        tok = state.engines[0].tokenizer
        if tok is None:
            raise ValueError("the OpenAI routes decode completions with the bridge's tokenizer: start it with --tokenizer (or --model)")
        return tok

    async def _sample(prompts: list[Prompt], req: _Sampling, max_tokens: int, kind: str) -> tuple[int, list[list[Rollout]]] | JSONResponse:
        """The request as a :class:`RolloutRequest` through the bridge's one admission and sampling
        path (``server.create_app``'s ``admit`` and ``events``): the same field checks, stale-engine
        refusal, version hold, timeouts and cancellation as ``/v1/rollouts``."""
        try:
            rreq = RolloutRequest(prompts=prompts, n=req.n, sampling=req.sampling(max_tokens))
        except ValidationError as e:
            return _invalid(e, kind=kind)
        got = await state.admit(rreq)
        if isinstance(got, JSONResponse):
            return _from_bridge_error(got, kind)
        prompt_ids, usable = got
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        out: dict[tuple[int, int], Rollout] = {}
        version = None
        gen = state.events(rreq, rid, prompt_ids, usable)
        try:
            async for ev in gen:
                version = ev.weight_version
                if ev.type == "error":  # one failed sample fails the request; the others are cancelled
                    return JSONResponse(status_code=502, content={"error": {"message": f"engine {ev.engine}: {ev.error}", "type": "engine_error"},
                                                                  "weight_version": version})
                if ev.type == "sample":
                    out[(ev.prompt_index, ev.sample_index)] = Rollout.model_validate(ev.model_dump(exclude={"type"}))
        finally:
            await gen.aclose()
        grouped = [[out[(pi, j)] for j in range(req.n)] for pi in range(len(prompt_ids))]
        return version, grouped

    def _text(tok, r: Rollout, stops: list[str], as_ids: bool = False) -> tuple[str, list[str]]:
        """The completion text (special tokens skipped, cut before a stop string that ended it) and each
        token's text (``"token_id:<id>"`` with ``as_ids``, vLLM's ``return_tokens_as_token_ids``)."""
        text = tok.tok.decode(r.token_ids, skip_special_tokens=True)
        if r.finish_reason == "stop" and stops:
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text, [f"token_id:{t}" if as_ids else tok.tok.decode([t]) for t in r.token_ids]

    def _ids(req: _Sampling, r: Rollout) -> dict[str, list[int]]:
        """vLLM's ``return_token_ids`` fields of a choice."""
        return {"prompt_token_ids": list(r.prompt_ids), "token_ids": list(r.token_ids)} if req.return_token_ids else {}

    def _usage(groups: list[list[Rollout]]) -> dict[str, int]:
        p = sum(len(g[0].prompt_ids) for g in groups)
        c = sum(len(r.token_ids) for g in groups for r in g)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _model_name(req: _Sampling) -> str:
        return req.model or state.engines[0].name

    @router.get("/v1/models")
    async def models():
        """The served model, as vLLM's OpenAI server lists it (clients such as TRL's ``VLLMClient``
        read the id here and send it back as ``model``)."""
        name = state.engines[0].name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "foursight",
                                            "root": name, "parent": None}]}

    @router.post("/v1/completions")
    async def completions(body: dict[str, Any]):
        try:
            req = CompletionRequest.model_validate(body)
            tok = _tokenizer()
        except ValidationError as e:
            return _invalid(e)
        except ValueError as e:
            return _invalid(e, "prompt")
        got = await _sample(req.prompts(), req, req.max_tokens or 16, "completion")
        if isinstance(got, JSONResponse):
            return got
        version, groups = got
        stops = req.sampling(1).stop
        choices = []
        for g in groups:
            for r in g:
                text, toks = _text(tok, r, stops, req.return_tokens_as_token_ids)
                offs, at = [], 0
                for s in toks:
                    offs.append(at)
                    at += len(s)
                lp = None if req.logprobs is None else {"tokens": toks, "token_logprobs": r.logprobs,
                                                         "top_logprobs": [{s: v} for s, v in zip(toks, r.logprobs)],
                                                         "text_offset": offs}
                choices.append({"index": len(choices), "text": text, "logprobs": lp, "finish_reason": r.finish_reason,
                                **_ids(req, r), "rollout": r.model_dump()})
        return {"id": groups[0][0].request_id, "object": "text_completion", "created": int(time.time()), "model": _model_name(req),
                "choices": choices, "usage": _usage(groups), "weight_version": version}

    @router.post("/v1/chat/completions")
    async def chat_completions(body: dict[str, Any]):
        try:
            req = ChatCompletionRequest.model_validate(body)
            tok = _tokenizer()
        except ValidationError as e:
            return _invalid(e)
        except ValueError as e:
            return _invalid(e, "messages")
        if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
            return _invalid(ValueError("max_tokens and max_completion_tokens differ"), "max_completion_tokens")
        prompt = Prompt(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        got = await _sample([prompt], req, req.max_completion_tokens or req.max_tokens or 16, "chat")
        if isinstance(got, JSONResponse):
            return got
        version, groups = got
        stops = req.sampling(1).stop
        choices = []
        for r in groups[0]:
            text, toks = _text(tok, r, stops, req.return_tokens_as_token_ids)
            lp = None
            if req.logprobs:
                lp = {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []}
                                  for s, v in zip(toks, r.logprobs)]}
            choices.append({"index": len(choices), "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": r.finish_reason, **_ids(req, r), "rollout": r.model_dump()})
        return {"id": groups[0][0].request_id, "object": "chat.completion", "created": int(time.time()), "model": _model_name(req),
                "choices": choices, "usage": _usage(groups), "weight_version": version}

    return router
