"""``POST /v1/rollouts``: stream one event per sample as soon as that sample finishes, then an end event.

Also the bridge's one admission and sampling path, which the OpenAI routes (:mod:`.openai`) use too:
:func:`admit` (sample count, the served model's field checks, tokenization, the engines that serve
the current weights) and :func:`events` (the weight version held for the whole request,
backpressure, per-sample timeouts, engine failures as error events, cancellation when the consumer
leaves). Backpressure: at most ``max_concurrency`` engine calls run at once, and each stream has at
most ``max_queue`` samples running or finished-but-unsent, so a slow reader slows its own stream's
engine calls instead of growing memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse

from foursight.trainer_bridge.backends.base import Delta, Engine, rollout_of
from foursight.trainer_bridge.guards import engine_field_errors, unprocessable
from foursight.trainer_bridge.liveness import STALE, EngineStale
from foursight.trainer_bridge.protocol import EndEvent, ErrorEvent, RolloutRequest, SampleEvent, Timing
from foursight.trainer_bridge.routes.state import BridgeState, State

log = logging.getLogger("foursight.bridge")

#: most samples (len(prompts) * n) one request may ask for
MAX_SAMPLES_PER_REQUEST = 100_000

router = APIRouter()


@dataclass
class PieceEvent:
    """A piece of a sample still running (:func:`events` with ``pieces=True``; the OpenAI routes
    stream it): the tokens the engine produced since the last piece. Not a wire event of
    ``/v1/rollouts``, which sends whole samples."""

    prompt_index: int
    sample_index: int
    delta: Delta
    engine: str
    weight_version: int
    type: str = "piece"


class RolloutStreamResponse(StreamingResponse):
    """A rollout stream that notices a client disconnect at once.

    Under ASGI 2.4 Starlette only notices a disconnect when a write fails, so a stream waiting for
    its next sample would keep its engine calls running (and the HF engine busy) and its version
    gate held. This one always listens for ``http.disconnect`` and closes the event generator on
    exit, so its cleanup (cancel the engine calls, release the gate, the gauges) runs right away.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def write() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(write)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


def _encode(ev, fmt: str) -> bytes:
    # top and prompt logprobs appear only when asked for
    data = ev.model_dump_json(exclude={k for k in ("top_logprobs", "prompt_logprobs") if getattr(ev, k, None) is None})
    if fmt == "sse":
        return f"event: {ev.type}\ndata: {data}\n\n".encode()
    return (data + "\n").encode()


def _refuse_field(field: str, error: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=422, content={"error": f"invalid request: {field}: {error}", "fields": [{"field": field, "message": message}]})


async def admit(state: BridgeState, req: RolloutRequest, fit_context: bool = False) -> tuple[list[list[int]], list[Engine]] | JSONResponse:
    """Everything a request must pass before a sample starts, for every route that samples
    (``/v1/rollouts`` and the OpenAI routes): sample count, the served model's field checks
    (``guards.engine_field_errors``), tokenization, and the engines that serve the current
    weights. Returns the prompts' token ids and those engines, or the error response.

    ``fit_context`` (the OpenAI routes, as vLLM's server does): a prompt whose tokens plus its
    ``max_tokens`` do not fit the served model's context gets the rest of the context as its
    ``max_tokens`` (``req.prompts[i].max_tokens`` is set) instead of a refusal; ``/v1/rollouts``
    refuses it (422), so that a trainer never gets shorter samples than it asked for unnoticed."""
    total = len(req.prompts) * req.n
    if total > MAX_SAMPLES_PER_REQUEST:
        return _refuse_field("n", f"len(prompts) * n = {total} exceeds {MAX_SAMPLES_PER_REQUEST}", "too many samples")
    vocab = state.engines[0].vocab_size
    errs = engine_field_errors(req, None, vocab, state.max_tokens_cap, state.max_request_tokens)
    no_top = [e.name for e in state.engines if not e.returns_top_logprobs]
    for field, asked in (("sampling.logprobs", req.sampling.logprobs > 0), ("sampling.prompt_logprobs", req.sampling.prompt_logprobs is not None)):
        if asked and no_top:
            errs.append({"field": field, "message": f"engine {', '.join(no_top)} does not return top logprobs or prompt logprobs"})
    for field in req.sampling.extras():  # refused only where an engine behind cannot honour it
        lacking = [e.name for e in state.engines if field not in e.sampling_extras]
        if lacking:
            errs.append({"field": f"sampling.{field}", "message": f"engine {', '.join(lacking)} cannot honour {field} "
                                                                  f"(the vLLM and SGLang engines take it)"})
    if errs:
        state.metrics.errors.labels(kind="bad_request").inc()
        return unprocessable(errs)
    prompt_ids: list[list[int]] = []
    for i, p in enumerate(req.prompts):
        try:
            prompt_ids.append(await state.engines[0].tokenize(p))
        except Exception as e:  # noqa: BLE001 - reported to the caller, naming the prompt
            return _refuse_field(f"prompts[{i}]", f"cannot tokenize: {e}", str(e))
        if not prompt_ids[-1]:
            return _refuse_field(f"prompts[{i}]", "empty after tokenization", "empty")
    context = await state.engines[0].context_length()
    if fit_context and context:
        for p, ids in zip(req.prompts, prompt_ids):
            if len(ids) < context and len(ids) + (p.max_tokens or req.sampling.max_tokens) > context:
                p.max_tokens = context - len(ids)
    errs = engine_field_errors(req, prompt_ids, vocab, None, context_length=context)
    if errs:
        state.metrics.errors.labels(kind="bad_request").inc()
        return unprocessable(errs)
    # what the engines serve is read under the version gate (a request that arrives during a weight update waits
    # for it, as new streams do, docs/bridge.md), so no update starts while it is read: mid-update an engine
    # already reports the version the bridge has not recorded yet (waiting only for the gate to be idle left that
    # window open: 3 of 429 requests through 3 updates answered 503 on a loaded CI machine)
    async with state.gate.read():
        # an engine that does not answer its health route gets no sample: the request fails at once,
        # not after the engine client's connect retries (Liveness.up: one read shared by a burst)
        ups = await state.liveness.up_all()
        live = [e for e, up in zip(state.engines, ups) if up]
        # samples are tagged with the bridge's version: refuse engines known to serve other weights
        statuses = await state.liveness.check_all(live)
    usable = [e for e, st in zip(live, statuses) if st != STALE]
    if not usable:
        state.metrics.errors.labels(kind="engine").inc()
        reasons = [state.liveness.of(e).reason if up else f"engine {e.name} does not answer its health route (down)"
                   for e, up in zip(state.engines, ups)]
        return JSONResponse(status_code=503, content={"error": "no engine serves the current weights: " + "; ".join(r or "" for r in reasons),
                                                      "weight_version": state.gate.version,
                                                      "engines": [{"name": e.name, **state.liveness.of(e).view()} for e in state.engines]})
    return prompt_ids, usable


@router.post("/v1/rollouts")
async def rollouts(req: RolloutRequest, state: State):
    got = await admit(state, req)
    if isinstance(got, JSONResponse):
        return got
    prompt_ids, usable = got
    rid = req.request_id or uuid.uuid4().hex
    media = "text/event-stream" if req.stream_format == "sse" else "application/x-ndjson"
    return RolloutStreamResponse(_stream(state, req, rid, prompt_ids, usable), media_type=media, headers={"X-Request-Id": rid})


async def _stream(state: BridgeState, req: RolloutRequest, rid: str, prompt_ids: list[list[int]],
                  usable: list[Engine]) -> AsyncIterator[bytes]:
    gen = events(state, req, rid, prompt_ids, usable)
    try:
        async for ev in gen:
            yield _encode(ev, req.stream_format)
    finally:
        await gen.aclose()


@dataclass
class _Request:
    """What every sample of one admitted request shares while :func:`events` runs it."""

    state: BridgeState
    req: RolloutRequest
    rid: str
    prompt_ids: list[list[int]]
    usable: list[Engine]
    pieces: bool
    version: int
    t_accept: float
    timeout: float
    #: finished samples (and pieces) waiting to be sent
    queue: asyncio.Queue
    #: per-stream window: at most ``max_queue`` samples of this stream are running or finished-but-unsent, so a
    #: slow reader throttles its own stream's engine work (backpressure), never other streams'
    window: asyncio.Semaphore


def error_event(r: _Request, pi: int, j: int, engine: str, error: str, kind: str) -> ErrorEvent:
    """The error event of sample ``j`` of prompt ``pi``, counted in the bridge's errors as ``kind``."""
    r.state.metrics.errors.labels(kind=kind).inc()
    return ErrorEvent(request_id=r.rid, prompt_index=pi, sample_index=j, engine=engine, weight_version=r.version, error=error)


async def _generate(r: _Request, engine: Engine, pi: int, j: int) -> Any:
    """One sample from ``engine``: whole, or streamed when the request wants pieces, top or prompt logprobs
    (the engines return those on their streaming road); pieces go to the queue as they come."""
    sp = r.req.sampling
    seed = None if sp.seed is None else sp.seed + pi * r.req.n + j
    max_tokens = r.req.prompts[pi].max_tokens or sp.max_tokens
    await r.state.liveness.ensure(engine)  # an engine that failed a call is re-checked first
    if not (r.pieces or sp.logprobs or sp.prompt_logprobs is not None):
        return await engine.generate(r.prompt_ids[pi], sp, max_tokens, seed, request=r.rid)
    got: list[Delta] = []
    stream = engine.generate_stream(r.prompt_ids[pi], sp, max_tokens, seed, request=r.rid)
    try:
        async for d in stream:
            got.append(d)
            if r.pieces and d.finish_reason is None:
                r.queue.put_nowait(PieceEvent(pi, j, d, engine.name, r.version))
    finally:
        await stream.aclose()  # a cancelled sample closes its engine stream: the engine aborts it
    if not got:
        raise RuntimeError("the engine's stream ended without a piece")
    return rollout_of(r.prompt_ids[pi], got, sp, engine.logprobs_mode)


async def _sample_event(r: _Request, engine: Engine, pi: int, j: int) -> SampleEvent | ErrorEvent:
    """Sample ``j`` of prompt ``pi`` on ``engine`` within the request's timeout, as its event: every engine
    failure becomes an error event (a failed call also marks the engine for a re-check)."""
    sp = r.req.sampling
    t0 = time.monotonic()
    try:
        res = await asyncio.wait_for(_generate(r, engine, pi, j), r.timeout)
    except (asyncio.TimeoutError, TimeoutError):
        return error_event(r, pi, j, engine.name, f"timeout: the engine did not finish the sample within {r.timeout} s", "timeout")
    except asyncio.CancelledError:
        raise
    except EngineStale as e:
        return error_event(r, pi, j, engine.name, str(e), "engine")
    except Exception as e:  # noqa: BLE001 - every engine failure becomes an error event
        r.state.liveness.of(engine).mark_unknown()
        return error_event(r, pi, j, engine.name, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, "engine")
    t1 = time.monotonic()
    r.state.metrics.latency.observe(t1 - t0)
    return SampleEvent(
        request_id=r.rid, prompt_index=pi, sample_index=j, prompt_ids=r.prompt_ids[pi],
        token_ids=res.token_ids, logprobs=res.logprobs, finish_reason=res.finish_reason,
        engine=engine.name, weight_version=r.version, logprobs_mode=engine.logprobs_mode,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        timing=Timing(queued_s=t0 - r.t_accept, engine_s=t1 - t0, total_s=t1 - r.t_accept),
        top_logprobs=res.top_logprobs if sp.logprobs else None,
        prompt_logprobs=res.prompt_logprobs if sp.prompt_logprobs is not None else None,
    )


async def _sample(r: _Request, pi: int, j: int) -> None:
    """Run sample ``j`` of prompt ``pi`` (waiting for the stream's window, then for an engine slot) and queue
    its event. A bridge bug still ends in an error event, never a hang."""
    state = r.state
    await r.window.acquire()
    state.metrics.pending.inc()
    engine = None
    try:
        async with state.sem:
            engine = state.pick_engine(r.usable)
            state.inflight[id(engine)] += 1
            try:
                ev: SampleEvent | ErrorEvent = await _sample_event(r, engine, pi, j)
            finally:
                state.inflight[id(engine)] -= 1
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 - a bridge bug must still end in an error event, never a hang
        log.exception("rollout task failed")
        ev = error_event(r, pi, j, getattr(engine, "name", "?"), f"bridge error: {type(e).__name__}: {e}", "bridge")
    finally:
        state.metrics.pending.dec()
    state.metrics.queue_depth.inc()
    r.queue.put_nowait(ev)  # the window bounds the queue


async def events(state: BridgeState, req: RolloutRequest, rid: str, prompt_ids: list[list[int]],
                 usable: list[Engine], pieces: bool = False) -> AsyncIterator[SampleEvent | ErrorEvent | EndEvent | PieceEvent]:
    """The samples of one admitted request as events, each as soon as it finishes, then the end
    event: the one sampling path of the bridge (version held, backpressure, timeouts, engine
    failures as error events, cancellation when the consumer leaves).

    With ``pieces`` the samples are streamed from the engines (``Engine.generate_stream``) and
    every piece but a sample's last comes as a :class:`PieceEvent` while the sample runs; the
    sample event follows as before. Samples that ask for top or prompt logprobs are streamed
    too (the engines return those on their streaming road)."""
    m = state.metrics
    t_accept = time.monotonic()
    total = len(prompt_ids) * req.n
    async with state.gate.read() as version:
        m.active_streams.inc()
        r = _Request(state, req, rid, prompt_ids, usable, pieces, version, t_accept, req.timeout_s or state.sample_timeout_s,
                     asyncio.Queue(), asyncio.Semaphore(state.max_queue))
        queue, window = r.queue, r.window
        tasks = [asyncio.create_task(_sample(r, pi, j)) for pi in range(len(prompt_ids)) for j in range(req.n)]
        n_ok = n_err = 0
        finished = False
        try:
            done = 0
            while done < total:
                ev = await queue.get()
                if ev.type == "piece":
                    yield ev
                    continue
                done += 1
                m.queue_depth.dec()
                window.release()
                if ev.type == "sample":
                    n_ok += 1
                    m.samples.labels(status="ok").inc()
                    m.add_tokens(len(ev.token_ids))
                else:
                    n_err += 1
                    m.samples.labels(status="error").inc()
                yield ev
            yield EndEvent(request_id=rid, status="ok" if n_err == 0 else "error", num_samples=n_ok, num_errors=n_err,
                           weight_version=version, elapsed_s=time.monotonic() - t_accept)
            finished = True
        finally:
            m.active_streams.dec()
            if not finished:  # the stream was left before its end event was sent
                m.errors.labels(kind="client_disconnect").inc()
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                # a disconnect cancels this generator's scope: shield the wait for the cancelled calls
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*pending, return_exceptions=True)
