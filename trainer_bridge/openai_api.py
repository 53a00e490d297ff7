"""OpenAI-compatible routes of the rollout bridge: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (non-streaming), for agent loops and trainers written against vLLM's
OpenAI server (docs/bridge.md lists the accepted fields).

Each request is one stream of the bridge: it holds the weight version it started under (a weight
update waits for it), its samples go to the least-loaded engine under the bridge's concurrency
limit, and every choice carries, next to the OpenAI fields, the bridge's one rollout record
(``choice["rollout"]``: :class:`~foursight.trainer_bridge.protocol.Rollout` with token ids,
per-token logprobs in the engine's ``logprobs_mode``, engine and weight version). The response's
``weight_version`` is that version too. Sampling fields are vLLM's: top-level ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``stop``,
``stop_token_ids``, ``n``, ``seed``, ``min_tokens``, ``ignore_eos``; unknown fields are refused
(422 naming the field), so that nothing is silently ignored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from foursight.trainer_bridge.protocol import ChatMessage, Prompt, Rollout, SamplingParams


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

    def sampling(self, max_tokens: int) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty, stop=stops,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of token-id lists.

    ``logprobs``: null or 0 (the sampled token's logprob in ``choices[i].logprobs.token_logprobs``;
    alternatives are not returned). ``echo`` is not supported."""

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


def _invalid(exc: ValidationError | ValueError, field: str = "<body>") -> JSONResponse:
    if isinstance(exc, ValidationError):
        fields = [{"field": ".".join(str(p) for p in e["loc"]) or "<body>", "message": e["msg"]} for e in exc.errors()]
    else:
        fields = [{"field": field, "message": str(exc)}]
    msg = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return JSONResponse(status_code=422, content={"error": {"message": f"invalid request: {msg}", "type": "invalid_request_error",
                                                            "fields": fields}})


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
        try:
            sp = req.sampling(max_tokens)
        except ValidationError as e:
            return _invalid(e)
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            try:
                ids.append(await state.engines[0].tokenize(p))
            except Exception as e:  # noqa: BLE001 - named for the caller
                return _invalid(ValueError(f"cannot tokenize: {e}"), f"prompt[{i}]" if kind == "completion" else "messages")
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        m = state.metrics
        async with state.gate.read() as version:
            m.active_streams.inc()

            async def one(pi: int, j: int) -> Rollout:
                idx = pi * req.n + j
                seed = None if sp.seed is None else sp.seed + idx
                async with state.sem:
                    engine = state.pick_engine()
                    state.inflight[id(engine)] += 1
                    t0 = time.monotonic()
                    try:
                        r = await asyncio.wait_for(engine.generate(ids[pi], sp, max_tokens, seed), state.sample_timeout_s)
                    except (asyncio.TimeoutError, TimeoutError):
                        m.errors.labels(kind="timeout").inc()
                        raise RuntimeError(f"engine {engine.name}: no answer within {state.sample_timeout_s} s") from None
                    except Exception as e:
                        m.errors.labels(kind="engine").inc()
                        raise RuntimeError(f"engine {engine.name}: {type(e).__name__}: {e}") from None
                    finally:
                        state.inflight[id(engine)] -= 1
                    m.latency.observe(time.monotonic() - t0)
                    m.samples.labels(status="ok").inc()
                    m.add_tokens(len(r.token_ids))
                    return r.model_copy(update={"engine": engine.name, "weight_version": version, "request_id": rid,
                                                "prompt_index": pi, "sample_index": j, "logprobs_mode": engine.logprobs_mode})

            try:
                tasks = [asyncio.create_task(one(pi, j)) for pi in range(len(ids)) for j in range(req.n)]
                try:
                    flat = await asyncio.gather(*tasks)
                except Exception:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
            except RuntimeError as e:
                m.samples.labels(status="error").inc()
                return JSONResponse(status_code=502, content={"error": {"message": str(e), "type": "engine_error"},
                                                              "weight_version": version})
            finally:
                m.active_streams.dec()
        grouped = [flat[i * req.n:(i + 1) * req.n] for i in range(len(ids))]
        return version, grouped

    def _text(tok, r: Rollout, stops: list[str]) -> tuple[str, list[str]]:
        """The completion text (special tokens skipped, cut before a stop string that ended it) and each token's text."""
        text = tok.tok.decode(r.token_ids, skip_special_tokens=True)
        if r.finish_reason == "stop" and stops:
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        return text, [tok.tok.decode([t]) for t in r.token_ids]

    def _usage(groups: list[list[Rollout]]) -> dict[str, int]:
        p = sum(len(g[0].prompt_ids) for g in groups)
        c = sum(len(r.token_ids) for g in groups for r in g)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _model_name(req: _Sampling) -> str:
        return req.model or state.engines[0].name

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
                text, toks = _text(tok, r, stops)
                offs, at = [], 0
                for s in toks:
                    offs.append(at)
                    at += len(s)
                lp = None if req.logprobs is None else {"tokens": toks, "token_logprobs": r.logprobs, "top_logprobs": None,
                                                         "text_offset": offs}
                choices.append({"index": len(choices), "text": text, "logprobs": lp, "finish_reason": r.finish_reason,
                                "rollout": r.model_dump()})
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
            text, toks = _text(tok, r, stops)
            lp = None
            if req.logprobs:
                lp = {"content": [{"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": []}
                                  for s, v in zip(toks, r.logprobs)]}
            choices.append({"index": len(choices), "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": r.finish_reason, "rollout": r.model_dump()})
        return {"id": groups[0][0].request_id, "object": "chat.completion", "created": int(time.time()), "model": _model_name(req),
                "choices": choices, "usage": _usage(groups), "weight_version": version}

    return router
