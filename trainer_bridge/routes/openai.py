"""OpenAI-compatible routes of the rollout bridge: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream`` too) and ``GET /v1/models``, for agent loops and trainers
written against vLLM's OpenAI server (docs/openai.md: what matches vLLM 0.32, what differs, and the
test that shows it).

Each request is translated into a :class:`~foursight.trainer_bridge.protocol.RolloutRequest` and
goes through the bridge's one admission and sampling path, the one ``/v1/rollouts`` uses: the
served model's field checks, refusal when no engine serves the current weights (503), the weight
version held for the whole request (a weight update waits for it), the least-loaded engine under
the concurrency limit, the per-sample timeout. Every choice carries, next to the OpenAI fields, the
bridge's one rollout record (``choice["rollout"]``: :class:`~foursight.trainer_bridge.protocol.Rollout`
with token ids, per-token logprobs in the engine's ``logprobs_mode``, engine and weight version);
the response's ``weight_version`` is that version too.

As vLLM's server answers:

* ``stream: true`` sends a chunk as the engine produces tokens (the engines stream through
  ``Engine.generate_stream``), text held back only while it may still become a stop string or an
  incomplete character;
* ``logprobs`` (completions) / ``top_logprobs`` (chat) up to :data:`~foursight.trainer_bridge.protocol.MAX_LOGPROBS`
  alternatives, ``echo``, token strings decoded as vLLM decodes them
  (:mod:`~foursight.trainer_bridge.openai_logprobs`); the request bodies are
  :mod:`~foursight.trainer_bridge.openai_requests`;
* a field the request cannot take is ``400`` in OpenAI's error shape (``{"error": {"message",
  "type", "param", "code"}}``, plus ``fields`` naming every bad field); a ``model`` other than the
  served one is ``404``; ``GET /v1/models`` lists the served model's name;
* a client that leaves (streamed or not) cancels its samples in the engine at once.

Unknown fields are refused (400 naming the field) where vLLM ignores them, so that nothing is
silently dropped.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from foursight.trainer_bridge.backends.base import Delta
from foursight.trainer_bridge.detokenizer import IncrementalDetokenizer
from foursight.trainer_bridge.guards import bad_request, field_name, openai_error
from foursight.trainer_bridge.openai_logprobs import TokenNames, chat_logprobs, completion_logprobs
from foursight.trainer_bridge.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from foursight.trainer_bridge.protocol import MAX_LOGPROBS, Rollout, RolloutRequest
from foursight.trainer_bridge.routes.rollouts import RolloutStreamResponse, admit, events
from foursight.trainer_bridge.routes.state import BridgeState, State


def _openai_field(name: str, kind: str) -> str:
    """A bridge field name (``sampling.seed``, ``prompts[1].token_ids[3]``) as the OpenAI request spells it."""
    if name in ("sampling.logprobs", "sampling.prompt_logprobs"):
        return "top_logprobs" if kind == "chat" else "logprobs"
    if name.startswith("sampling."):
        return name[len("sampling."):]
    if name.startswith("prompts"):
        return "messages" if kind == "chat" else "prompt" + name[len("prompts"):]
    return name


def _invalid(exc: ValidationError | ValueError, field: str = "<body>", kind: str | None = None) -> JSONResponse:
    if isinstance(exc, ValidationError):
        fields = [{"field": field_name(e), "message": e["msg"]} for e in exc.errors()]
    else:
        fields = [{"field": field, "message": str(exc)}]
    if kind is not None:
        fields = [{**f, "field": _openai_field(f["field"], kind)} for f in fields]
    return bad_request(fields)


def _from_bridge_error(resp: JSONResponse, kind: str) -> JSONResponse:
    """An error answer of the bridge's admission (422 naming fields: 400 here, as vLLM answers; 503
    when no engine serves the current weights) in the OpenAI error shape, field names translated."""
    body = json.loads(bytes(resp.body))
    if "fields" in body:
        return bad_request([{**f, "field": _openai_field(f["field"], kind)} for f in body["fields"]])
    extra = {k: v for k, v in body.items() if k != "error"}
    return JSONResponse(status_code=resp.status_code, content={"error": {"message": body["error"], "type": "engine_unavailable", "param": None,
                                                                         "code": resp.status_code}, **extra})


router = APIRouter()


def _tokenizer(state: BridgeState):
    tok = state.engines[0].tokenizer
    if tok is None:
        raise ValueError("the OpenAI routes decode completions with the bridge's tokenizer: start it with --tokenizer (or --model)")
    return tok


def served_model(state: BridgeState) -> str:
    """The model name the bridge serves: its (first) engine's (``Engine.served_model``)."""
    return state.engines[0].served_model()


async def _admit(state: BridgeState, req: SamplingFields):
    """The request as a :class:`RolloutRequest` through the bridge's one admission path
    (:func:`.rollouts.admit`): the same field checks and stale-engine refusal as ``/v1/rollouts``.
    Returns ``(rreq, request id, prompt ids, usable engines)`` or the error response."""
    kind = req.kind
    if req.model is not None and req.model != served_model(state):
        return openai_error(404, f"The model `{req.model}` does not exist. The bridge serves `{served_model(state)}`.", "NotFoundError", "model")
    if req.best_of is not None and req.best_of > req.n:
        names = ", ".join(e.name for e in state.engines)
        return bad_request([{"field": "best_of", "message": f"best_of {req.best_of} > n {req.n}: engine {names} cannot honour it "
                                                           "(vLLM 0.32 has no best_of; its server ignores the field)"}])
    context = await state.engines[0].context_length()
    asked = req.budget()
    if asked is not None and context and asked > context:  # vLLM refuses it whatever the prompt
        return bad_request([{"field": req.budget_field(), "message": f"{asked} cannot be greater than the model's context of {context} tokens"}])
    if asked is None:  # chat without max_tokens: the rest of the context (trimmed per prompt by admit), as vLLM
        asked = min(x for x in (context or 16, state.max_tokens_cap) if x is not None)
    try:
        rreq = RolloutRequest(prompts=req.prompts(), n=req.n, sampling=req.sampling(asked))
    except ValidationError as e:
        return _invalid(e, kind=kind)
    got = await admit(state, rreq, fit_context=True)
    if isinstance(got, JSONResponse):
        return _from_bridge_error(got, kind)
    prompt_ids, usable = got
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    return rreq, rid, prompt_ids, usable


# ---- token strings and logprobs, as vLLM writes them ---------------------------------------------


def _cut_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


class OpenAIChoice:
    """One sample as a choice of the answer: its text (special tokens skipped, cut before a stop
    string that ended it), logprobs in the route's shape, and, streamed, the part not yet sent."""

    def __init__(self, req: SamplingFields, tok, names: TokenNames, index: int, prompt_ids: list[int], prompt_text: str | None,
                 stop_ids: frozenset[int] = frozenset()):
        self.req, self.tok, self.names, self.index = req, tok, names, index
        self.prompt_ids = prompt_ids
        #: tokens that end a sample by themselves (EOS, ``stop_token_ids``): vLLM leaves such a final token
        #: out of the text (special or not, ``skip_special_tokens`` or not); it stays in the tokens and logprobs
        self.stop_ids = stop_ids
        self.deferred: list[int] = []  # streamed: a trailing token that may be the stop token, not decoded yet
        self.ids: list[int] = []
        self.detok = IncrementalDetokenizer(tok, req.skip_special_tokens)  # streamed: the text of each piece's tokens, decoded incrementally
        self.held = ""  # streamed: decoded text not sent yet, as it may still become a stop string
        self.sent_tokens = 0  # tokens whose logprobs were sent so far
        self.offset = 0  # text_offset of the next logprob token
        self.started = False
        echo = req.echoes() and req.kind == "completion"
        self.echo_text = ("" if req.return_token_ids else prompt_text if prompt_text is not None else tok.decode(prompt_ids)) if echo else None

    def _ended_by_stop_token(self, ids: list[int], finish_reason: str | None) -> bool:
        return finish_reason == "stop" and bool(ids) and ids[-1] in self.stop_ids

    def text(self, ids: list[int], finish_reason: str | None) -> str:
        """The finished completion's text: ``ids`` decoded as a whole (a character split across tokens
        comes out whole, one still incomplete at the end is left out, as vLLM's detokenizer leaves
        it; special tokens as ``skip_special_tokens`` says), without the stop token that ended it or
        cut before the stop string that did."""
        if self._ended_by_stop_token(ids, finish_reason):
            ids = ids[:-1]
        return self._cut(self.tok.decode(ids, skip_special_tokens=self.req.skip_special_tokens).rstrip("\ufffd"), finish_reason)

    def _cut(self, text: str, finish_reason: str | None) -> str:
        stops = self.req.stops()
        return _cut_at_stop(text, stops) if finish_reason == "stop" and stops else text

    def _stream_text(self, token_ids: list[int], finish_reason: str | None, final: bool) -> str:
        """The text a streamed piece adds: its tokens decoded incrementally (:class:`IncrementalDetokenizer`;
        joined, the pieces' texts are :meth:`text` of the whole sample). While streaming, the end
        that may still become a stop string is held back; with the last piece it is cut before the
        stop string that ended the sample (which cannot begin in text already sent, being held)."""
        ids = self.deferred + list(token_ids)
        if final:
            if self._ended_by_stop_token(ids, finish_reason):
                ids = ids[:-1]
            self.deferred = []
        else:  # a last token that may end the sample is decoded only once the sample goes on (or not at all)
            cut = len(ids) - 1 if ids and ids[-1] in self.stop_ids else len(ids)
            ids, self.deferred = ids[:cut], ids[cut:]
        new = self.held + self.detok.push(ids)
        if final:
            self.held = ""
            return self._cut(new + self.detok.finish(), finish_reason)
        hold = max((len(s) for s in self.req.stops()), default=1) - 1
        cut = max(0, len(new) - hold)
        self.held = new[cut:]
        return new[:cut]

    def _logprobs(self, ids, vals, tops, prompt_logprobs, echo: bool, start: int):
        """The route's logprobs of the generated tokens ``ids`` (the sample's from index ``start``),
        with the prompt's before them when ``echo``."""
        req = self.req
        if not req.wants_logprobs():
            return None
        k = req.alternatives()
        gen = self.ids
        contexts: list[list[int] | None] = [gen[max(0, start + i - 4): start + i] for i in range(len(ids))]
        if req.kind == "chat":
            return chat_logprobs(self.names, ids, vals, tops, k, contexts)
        if echo:
            pl = prompt_logprobs or [None] * len(self.prompt_ids)
            p_vals = [None] + [next((lp for a, lp in (e or []) if a == t), None) for t, e in zip(self.prompt_ids[1:], pl[1:])]
            p_ctx = [None] + [self.prompt_ids[max(1, p - 4):p] for p in range(1, len(self.prompt_ids))]
            tops = list(pl) + (list(tops) if tops is not None else [None] * len(ids))
            tops[0] = None
            ids, vals, contexts = list(self.prompt_ids) + list(ids), p_vals + list(vals), p_ctx + contexts
        out = completion_logprobs(self.names, ids, vals, tops, k, self.offset, contexts)
        if out["tokens"]:
            self.offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def _extra(self, r: Rollout | None, first: bool) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.req.return_token_ids:
            if first:
                extra["prompt_token_ids"] = list(self.prompt_ids)
        if r is not None:
            extra["rollout"] = r.model_dump(exclude_none=True)
        return extra

    def whole(self, r: Rollout) -> dict[str, Any]:
        """The choice of a non-streamed answer."""
        text = self.text(r.token_ids, r.finish_reason)
        self.ids = list(r.token_ids)
        lp = self._logprobs(r.token_ids, r.logprobs, r.top_logprobs, r.prompt_logprobs, echo=self.echo_text is not None, start=0)
        out: dict[str, Any] = {"index": self.index, "finish_reason": r.finish_reason, "stop_reason": None}
        if self.req.kind == "chat":
            out.update(message={"role": "assistant", "content": text}, logprobs=lp)
        else:
            out.update(text=(self.echo_text or "") + text, logprobs=lp)
        if self.req.return_token_ids:
            out.update(prompt_token_ids=list(self.prompt_ids), token_ids=list(r.token_ids))
        out["rollout"] = r.model_dump(exclude_none=True)
        return out

    def piece(self, d: Delta, r: Rollout | None) -> dict[str, Any] | None:
        """The stream chunk's choice for a piece ``d`` of this sample (``r``: the whole sample, with
        its last piece), or None when there is nothing to send yet."""
        first = not self.started
        self.started = True
        start = len(self.ids)
        self.ids.extend(d.token_ids)
        final = r is not None
        new_text = self._stream_text(d.token_ids, r.finish_reason if final else None, final)
        echo = first and self.echo_text is not None
        lp = self._logprobs(list(d.token_ids), list(d.logprobs), d.top_logprobs, d.prompt_logprobs, echo=echo, start=start)
        if not (new_text or d.token_ids or final or echo):
            return None
        out: dict[str, Any] = {"index": self.index}
        if self.req.kind == "chat":
            out["delta"] = {"content": new_text} if new_text or not final else {}
        else:
            out["text"] = (self.echo_text if echo else "") + new_text
        out["logprobs"] = lp
        out["finish_reason"] = r.finish_reason if final else None
        out["stop_reason"] = None
        if self.req.return_token_ids:
            out["token_ids"] = list(d.token_ids)
        out.update(self._extra(r, first))
        return out

    def rest(self, r: Rollout) -> Delta:
        """The part of the finished sample ``r`` not yet streamed, as its last piece."""
        n = len(self.ids)
        return Delta(token_ids=r.token_ids[n:], logprobs=r.logprobs[n:], top_logprobs=r.top_logprobs[n:] if r.top_logprobs is not None else None,
                     prompt_logprobs=None if self.started else r.prompt_logprobs, finish_reason=r.finish_reason)


def _stop_ids(req: SamplingFields, tok) -> frozenset[int]:
    """The tokens that end a sample of ``req`` by themselves: the model's EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    return frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else tok.eos_ids)


async def _sample(state: BridgeState, req: SamplingFields, tok, got) -> dict[str, Any] | JSONResponse:
    """All samples of an admitted request through the bridge's one sampling path
    (:func:`.rollouts.events`: version hold, timeouts, cancellation), as one answer."""
    rreq, rid, prompt_ids, usable = got
    out: dict[tuple[int, int], Rollout] = {}
    version = None
    gen = events(state, rreq, rid, prompt_ids, usable)
    try:
        async for ev in gen:
            version = ev.weight_version
            if ev.type == "error":  # one failed sample fails the request; the others are cancelled
                return JSONResponse(status_code=502, content={"error": {"message": f"engine {ev.engine}: {ev.error}", "type": "engine_error",
                                                                        "param": None, "code": 502}, "weight_version": version})
            if ev.type == "sample":
                out[(ev.prompt_index, ev.sample_index)] = Rollout.model_validate(ev.model_dump(exclude={"type"}))
    finally:
        await gen.aclose()
    names = TokenNames(tok.tok, req.return_tokens_as_token_ids)
    texts = req.prompt_texts() if isinstance(req, CompletionRequest) else [None]
    choices = []
    for pi, ids in enumerate(prompt_ids):
        for j in range(req.n):
            choices.append(OpenAIChoice(req, tok.tok, names, pi * req.n + j, ids, texts[pi], _stop_ids(req, tok)).whole(out[(pi, j)]))
    p = sum(len(ids) for ids in prompt_ids)
    c = sum(len(r.token_ids) for r in out.values())
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion", "created": int(time.time()),
            "model": served_model(state), "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
            "weight_version": version}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(state: BridgeState, req: SamplingFields, tok, got) -> AsyncIterator[bytes]:
    """OpenAI server-sent events as vLLM sends them: a chunk for each piece an engine streams
    (chat: first a ``role`` chunk per choice), the last one of a sample with its ``finish_reason``
    and the bridge's rollout record, then the usage chunk if asked, then ``data: [DONE]``. An
    engine failure ends the stream with an error chunk, as vLLM's server does."""
    rreq, rid, prompt_ids, usable = got
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    created = int(time.time())
    model = served_model(state)
    names = TokenNames(tok.tok, req.return_tokens_as_token_ids)
    texts = req.prompt_texts() if isinstance(req, CompletionRequest) else [None]
    stop_ids = _stop_ids(req, tok)
    choices = {(pi, j): OpenAIChoice(req, tok.tok, names, pi * req.n + j, ids, texts[pi], stop_ids)
               for pi, ids in enumerate(prompt_ids) for j in range(req.n)}
    n_prompt = sum(len(p) for p in prompt_ids)
    n_done = 0
    version = state.gate.version

    def chunk(choice: dict[str, Any]) -> bytes:
        return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "weight_version": version})

    gen = events(state, rreq, rid, prompt_ids, usable, pieces=True)
    try:
        async for ev in gen:
            version = ev.weight_version
            if ev.type == "error":
                yield _sse({"error": {"message": f"engine {ev.engine}: {ev.error}", "type": "engine_error", "param": None, "code": 502},
                            "weight_version": version})
                break
            if ev.type == "end":
                continue
            ch = choices[(ev.prompt_index, ev.sample_index)]
            if req.kind == "chat" and not ch.started:
                yield chunk({"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            if ev.type == "piece":
                c = ch.piece(ev.delta, None)
            else:  # the sample is finished: what is left of it, with the whole sample's record
                r = Rollout.model_validate(ev.model_dump(exclude={"type"}))
                n_done += len(r.token_ids)
                c = ch.piece(ch.rest(r), r)
            if c is not None:
                yield chunk(c)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n_done, "total_tokens": n_prompt + n_done}
                yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage, "weight_version": version})
            yield b"data: [DONE]\n\n"
    finally:
        await gen.aclose()


async def _unless_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a non-streamed answer) while listening for the client's disconnect: when it
    leaves first, ``work`` is cancelled, and with it the request's samples in the engine (the
    engine clients close their connections; the HF engine drops them), so nothing keeps running
    for an answer nobody reads, and a weight update is not held up by it."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            request.app.state.bridge.metrics.errors.labels(kind="client_disconnect").inc()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


async def _answer(request: Request, state: BridgeState, body: dict[str, Any], model: type[SamplingFields]):
    """Both routes: validate ``body`` as ``model``; a streaming request is admitted now (errors as
    JSON, before the stream starts), then streamed; otherwise every sample, then one response."""
    try:
        req = model.model_validate(body)
        tok = _tokenizer(state)
    except ValidationError as e:
        return _invalid(e)
    except ValueError as e:
        return _invalid(e, model.prompt_field)
    got = await _admit(state, req)
    if isinstance(got, JSONResponse):
        return got
    if req.stream:
        return RolloutStreamResponse(_stream(state, req, tok, got), media_type="text/event-stream", headers={"X-Request-Id": got[1]})
    return await _unless_disconnected(request, _sample(state, req, tok, got))


@router.get("/v1/models")
async def models(state: State):
    """The served model, as vLLM's OpenAI server lists it (clients such as TRL's ``VLLMClient``
    read the id here and send it back as ``model``), with its context length."""
    ctx = await state.engines[0].context_length()  # first: an engine server's probe also reads the name it serves
    name = served_model(state)
    entry = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "foursight", "root": name, "parent": None}
    if ctx:
        entry["max_model_len"] = ctx
    return {"object": "list", "data": [entry]}


@router.post("/v1/completions")
async def completions(request: Request, body: dict[str, Any], state: State):
    return await _answer(request, state, body, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: dict[str, Any], state: State):
    return await _answer(request, state, body, ChatCompletionRequest)
