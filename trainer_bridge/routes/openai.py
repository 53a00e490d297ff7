"""OpenAI-compatible routes of the rollout bridge: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream`` too), for agent loops and trainers written against vLLM's
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
from typing import Any, AsyncIterator, ClassVar, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from foursight.trainer_bridge.guards import field_name
from foursight.trainer_bridge.protocol import ChatMessage, Prompt, Rollout, RolloutRequest, SamplingParams
from foursight.trainer_bridge.routes.rollouts import admit, events
from foursight.trainer_bridge.routes.state import BridgeState, State


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the request's token counts."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


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
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    user: str | None = None
    #: vLLM's token-id extensions (what TRL's ``VLLMClient`` sends): every choice also carries
    #: ``prompt_token_ids`` and ``token_ids``, and logprob tokens are spelled ``"token_id:<id>"``
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    #: what the routes' error answers call this request's prompt, and its kind (``_openai_field``)
    prompt_field: ClassVar[str]
    kind: ClassVar[str]

    def prompts(self) -> list[Prompt]:
        raise NotImplementedError

    def budget(self) -> int:
        """``max_tokens`` of each sample (OpenAI's default 16)."""
        return self.max_tokens or 16

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.budget(), min_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=self.stops(),
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists.

    ``logprobs``: null or 0 (the sampled token's logprob in ``choices[i].logprobs.token_logprobs``,
    and, as vLLM does for 0, ``top_logprobs`` holding that token alone; alternatives are not
    returned). ``echo`` is not supported."""

    prompt_field: ClassVar[str] = "prompt"
    kind: ClassVar[str] = "completion"

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

    prompt_field: ClassVar[str] = "messages"
    kind: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    add_generation_prompt: bool = True

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_budget(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v and other and v != other:
            raise ValueError(f"max_tokens ({other}) and max_completion_tokens ({v}) differ")
        return v

    def prompts(self) -> list[Prompt]:
        return [Prompt(messages=self.messages, add_generation_prompt=self.add_generation_prompt)]

    def budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16


def _openai_field(name: str, kind: str) -> str:
    """A bridge field name (``sampling.seed``, ``prompts[1].token_ids[3]``) as the OpenAI request spells it."""
    if name.startswith("sampling."):
        return name[len("sampling."):]
    if name.startswith("prompts"):
        return "messages" if kind == "chat" else "prompt" + name[len("prompts"):]
    return name


def _error(status: int, fields: list[dict[str, str]], **extra) -> JSONResponse:
    msg = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return JSONResponse(status_code=status, content={"error": {"message": f"invalid request: {msg}", "type": "invalid_request_error",
                                                               "fields": fields}, **extra})


def _invalid(exc: ValidationError | ValueError, field: str = "<body>", kind: str | None = None) -> JSONResponse:
    if isinstance(exc, ValidationError):
        fields = [{"field": field_name(e), "message": e["msg"]} for e in exc.errors()]
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


router = APIRouter()


def _tokenizer(state: BridgeState):
    tok = state.engines[0].tokenizer
    if tok is None:
        raise ValueError("the OpenAI routes decode completions with the bridge's tokenizer: start it with --tokenizer (or --model)")
    return tok


async def _admit(state: BridgeState, req: _Sampling):
    """The request as a :class:`RolloutRequest` through the bridge's one admission path
    (:func:`.rollouts.admit`): the same field checks and stale-engine refusal as ``/v1/rollouts``.
    Returns ``(rreq, request id, prompt ids, usable engines)`` or the error response."""
    kind = req.kind
    try:
        rreq = RolloutRequest(prompts=req.prompts(), n=req.n, sampling=req.sampling())
    except ValidationError as e:
        return _invalid(e, kind=kind)
    got = await admit(state, rreq)
    if isinstance(got, JSONResponse):
        return _from_bridge_error(got, kind)
    prompt_ids, usable = got
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    return rreq, rid, prompt_ids, usable


async def _sample(state: BridgeState, req: _Sampling) -> tuple[int, list[list[Rollout]]] | JSONResponse:
    """All samples of an admitted request through the bridge's one sampling path
    (:func:`.rollouts.events`: version hold, timeouts, cancellation), grouped per prompt."""
    got = await _admit(state, req)
    if isinstance(got, JSONResponse):
        return got
    rreq, rid, prompt_ids, usable = got
    out: dict[tuple[int, int], Rollout] = {}
    version = None
    gen = events(state, rreq, rid, prompt_ids, usable)
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


async def _stream(state: BridgeState, req: _Sampling, tok, got) -> AsyncIterator[bytes]:
    """OpenAI server-sent events: one chunk per sample as soon as it finishes (the engines return
    whole samples, so a chunk holds the sample's full text, logprobs and finish reason), then the
    usage chunk if asked, then ``data: [DONE]``. An engine failure ends the stream with an error
    chunk, as vLLM's server does."""
    rreq, rid, prompt_ids, usable = got
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    created = int(time.time())
    model = req.model or state.engines[0].name
    n_prompt = sum(len(p) for p in prompt_ids)
    n_done = 0
    version = None
    gen = events(state, rreq, rid, prompt_ids, usable)
    try:
        async for ev in gen:
            version = ev.weight_version
            if ev.type == "error":
                err = {"error": {"message": f"engine {ev.engine}: {ev.error}", "type": "engine_error"}, "weight_version": version}
                yield f"data: {json.dumps(err)}\n\n".encode()
                break
            if ev.type != "sample":
                continue
            r = Rollout.model_validate(ev.model_dump(exclude={"type"}))
            n_done += len(r.token_ids)
            choice = _choice_entry(tok, req, r, r.prompt_index * req.n + r.sample_index, stream=True)
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "weight_version": version}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_done,
                         "total_tokens": n_prompt + n_done}
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model, 'choices': [], 'usage': usage, 'weight_version': version})}\n\n".encode()
            yield b"data: [DONE]\n\n"
    finally:
        await gen.aclose()


def _completion_logprobs(req: _Sampling, toks: list[str], r: Rollout):
    if req.logprobs is None:
        return None
    offs = [sum(len(x) for x in toks[:i]) for i in range(len(toks))]
    return {"tokens": toks, "token_logprobs": r.logprobs, "top_logprobs": [{x: v} for x, v in zip(toks, r.logprobs)], "text_offset": offs}


def _chat_logprobs(req: _Sampling, toks: list[str], r: Rollout):
    if not req.logprobs:
        return None
    return {"content": [{"token": x, "logprob": v, "bytes": list(x.encode()), "top_logprobs": []} for x, v in zip(toks, r.logprobs)]}


def _choice(tok, req: _Sampling, r: Rollout) -> tuple[str, list[str], dict[str, Any]]:
    """One sample's completion text (special tokens skipped, cut before a stop string that
    ended it), each token's text (``"token_id:<id>"`` with vLLM's ``return_tokens_as_token_ids``)
    and the choice fields both routes share (``finish_reason``, vLLM's ``return_token_ids``
    fields, the FourSight ``rollout``)."""
    text = tok.tok.decode(r.token_ids, skip_special_tokens=True)
    stops = req.stops()
    if r.finish_reason == "stop" and stops:
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
    toks = [f"token_id:{t}" if req.return_tokens_as_token_ids else tok.tok.decode([t]) for t in r.token_ids]
    extra: dict[str, Any] = {"finish_reason": r.finish_reason}
    if req.return_token_ids:
        extra.update(prompt_token_ids=list(r.prompt_ids), token_ids=list(r.token_ids))
    extra["rollout"] = r.model_dump()
    return text, toks, extra


def _choice_entry(tok, req: _Sampling, r: Rollout, index: int, stream: bool = False) -> dict[str, Any]:
    """One entry of ``choices``: ``text`` (completions) or the assistant ``message`` (chat; ``delta``
    in a stream chunk), with its logprobs in the route's shape and the shared fields of :func:`_choice`."""
    text, toks, extra = _choice(tok, req, r)
    if req.kind == "chat":
        return {"index": index, "delta" if stream else "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(req, toks, r), **extra}
    return {"index": index, "text": text, "logprobs": _completion_logprobs(req, toks, r), **extra}


async def _answer(state: BridgeState, body: dict[str, Any], model: type[_Sampling]):
    """Both routes: validate ``body`` as ``model``; a streaming request is admitted now (errors as
    JSON, before the stream starts), then streamed; otherwise every sample, then one response."""
    try:
        req = model.model_validate(body)
        tok = _tokenizer(state)
    except ValidationError as e:
        return _invalid(e)
    except ValueError as e:
        return _invalid(e, model.prompt_field)
    if req.stream:
        got = await _admit(state, req)
        if isinstance(got, JSONResponse):
            return got
        return StreamingResponse(_stream(state, req, tok, got), media_type="text/event-stream", headers={"X-Request-Id": got[1]})
    got = await _sample(state, req)
    if isinstance(got, JSONResponse):
        return got
    version, groups = got
    choices = [_choice_entry(tok, req, r, i) for i, r in enumerate(r for g in groups for r in g)]
    p = sum(len(g[0].prompt_ids) for g in groups)
    c = sum(len(r.token_ids) for g in groups for r in g)
    return {"id": groups[0][0].request_id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": req.model or state.engines[0].name,
            "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
            "weight_version": version}


@router.get("/v1/models")
async def models(state: State):
    """The served model, as vLLM's OpenAI server lists it (clients such as TRL's ``VLLMClient``
    read the id here and send it back as ``model``)."""
    name = state.engines[0].name
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "foursight",
                                        "root": name, "parent": None}]}


@router.post("/v1/completions")
async def completions(body: dict[str, Any], state: State):
    return await _answer(state, body, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(body: dict[str, Any], state: State):
    return await _answer(state, body, ChatCompletionRequest)
