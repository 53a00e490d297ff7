"""The rollout bridge: a FastAPI service in front of one or more engine servers.

Endpoints (docs/bridge.md has the full protocol):

* ``POST /v1/rollouts`` — stream one event per sample as soon as that sample finishes, then an
  end event. Each stream holds the weight version it started under; a weight update waits
  until the streams started under the old version have finished (so no stream mixes versions).
* ``POST /v1/weights`` — versioned BF16 weight update (engines re-quantize); ``GET /v1/weights``.
* ``GET /v1/health`` (also ``GET /health``, vLLM's spelling) — per engine: up, what it serves, a 1-token probe (503 unless all are fine); ``GET /metrics`` — Prometheus.

The API key (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``) is required on every route but
``GET /v1/health`` (``/health``), ``GET /metrics`` and ``GET /v1/weights`` when the server has one, checked before the body is read; ``Host``,
``Origin`` and the body size are checked first (:mod:`foursight.trainer_bridge.guards`). The bridge
tracks what each engine serves (:mod:`foursight.trainer_bridge.liveness`). Backpressure: at most ``max_concurrency`` engine
calls run at once, and each stream has at most ``max_queue`` samples running or finished-but-unsent, so a
slow reader slows its own stream's engine calls instead of growing memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foursight.trainer_bridge.engines import Engine, shm_path
from foursight.trainer_bridge.guards import (
    DEFAULT_MAX_BODY_BYTES,
    WeightsRoots,
    add_guards,
    allowed_hosts_for,
    check_bind,
    engine_field_errors,
    unprocessable,
)
from foursight.trainer_bridge.liveness import STALE, EngineStale, Liveness
from foursight.trainer_bridge.protocol import (
    EndEvent,
    ErrorEvent,
    RolloutRequest,
    SampleEvent,
    Timing,
    WeightUpdateRequest,
    WeightUpdateResponse,
)

log = logging.getLogger("foursight.bridge")

#: most samples (len(prompts) * n) one request may ask for
MAX_SAMPLES_PER_REQUEST = 100_000


class DrainTimeout(RuntimeError):
    pass


class UpdateInProgress(RuntimeError):
    pass


class VersionGate:
    """Readers (streams) hold the current weight version; a writer (update) waits for them to drain.

    While an update waits or runs, new streams wait, so every sample of a stream is produced
    under the version the stream reports.
    """

    def __init__(self, version: int = 0):
        self.version = version
        self.readers = 0
        self.writer = False
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer)
            self.readers += 1
            v = self.version
        try:
            yield v
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled (disconnected) stream still releases its read
                async with self._cond:
                    self.readers -= 1
                    self._cond.notify_all()

    @asynccontextmanager
    async def write(self, drain_timeout_s: float) -> AsyncIterator[None]:
        async with self._cond:
            if self.writer:
                raise UpdateInProgress("another weight update is in progress")
            self.writer = True
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.readers == 0), drain_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                self.writer = False
                self._cond.notify_all()
                raise DrainTimeout(f"{self.readers} stream(s) still running after {drain_timeout_s} s") from None
        try:
            yield
        finally:
            async with self._cond:
                self.writer = False
                self._cond.notify_all()


class BridgeMetrics:
    """Prometheus metrics of one bridge app (own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_streams = Gauge("foursight_bridge_active_streams", "Rollout streams open", registry=r)
        self.samples = Counter("foursight_bridge_samples", "Samples emitted", ["status"], registry=r)
        self.tokens = Counter("foursight_bridge_generated_tokens", "Generated tokens streamed", registry=r)
        self.tokens_per_s = Gauge("foursight_bridge_tokens_per_second", "Generated tokens/s over the last 10 s", registry=r)
        self.pending = Gauge("foursight_bridge_pending_samples", "Samples waiting for an engine slot or running", registry=r)
        self.queue_depth = Gauge("foursight_bridge_queue_depth", "Finished samples waiting to be sent", registry=r)
        self.errors = Counter("foursight_bridge_errors", "Errors", ["kind"], registry=r)
        self.latency = Histogram("foursight_bridge_sample_seconds", "Engine time per sample", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.version = Gauge("foursight_bridge_weight_version", "Current weight version", registry=r)
        self.engine_up = Gauge("foursight_bridge_engine_up", "Engine answered the last health check", ["engine"], registry=r)
        self.engine_in_sync = Gauge("foursight_bridge_engine_in_sync", "Engine serves the weights the bridge tags samples with",
                                    ["engine"], registry=r)
        self._window: deque[tuple[float, int]] = deque()

    def add_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        now = time.monotonic()
        self._window.append((now, n))

    def refresh_rate(self, window_s: float = 10.0) -> None:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - window_s:
            self._window.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._window) / window_s)


class BridgeState:
    def __init__(self, engines: Sequence[Engine], api_key: str | None, max_concurrency: int, max_queue: int,
                 sample_timeout_s: float, initial_version: int):
        if not engines:
            raise ValueError("the bridge needs at least one engine")
        self.engines = list(engines)
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.sample_timeout_s = sample_timeout_s
        self.initial_version = initial_version
        self.inflight = {id(e): 0 for e in self.engines}  # keyed by object: a name may change at start()
        self.metrics = BridgeMetrics()
        self.gate: VersionGate | None = None
        self.liveness: Liveness | None = None
        self.sem: asyncio.Semaphore | None = None
        # set by create_app: the one admission and sampling path, shared with the OpenAI routes
        self.admit: Any = None
        self.events: Any = None
        self.push_weights: Any = None

    def pick_engine(self, allowed: Sequence[Engine] | None = None) -> Engine:
        """The engine with the fewest calls in flight (first one on ties), among ``allowed``."""
        return min(allowed or self.engines, key=lambda e: self.inflight[id(e)])


def _field_name(loc: Sequence[Any]) -> str:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + str(p))
    return out or "<body>"


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
    data = ev.model_dump_json()
    if fmt == "sse":
        return f"event: {ev.type}\ndata: {data}\n\n".encode()
    return (data + "\n").encode()


async def _const(v):
    return v


def create_app(
    engines: Sequence[Engine],
    api_key: str | None = None,
    max_concurrency: int = 64,
    max_queue: int = 256,
    sample_timeout_s: float = 600.0,
    initial_version: int = 0,
    weights_dirs: Sequence[str | Path] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_tokens_cap: int | None = None,
    max_request_tokens: int | None = None,
    probe_timeout_s: float = 10.0,
    write_timeout_s: float | None = None,
) -> FastAPI:
    """Build the bridge app.

    Args:
        engines: backends (all serve the same model; calls go to the least-loaded one).
        api_key: required on /v1/rollouts and /v1/weights when set.
        max_concurrency: engine calls in flight at once, over all streams.
        max_queue: per-stream window: samples of one stream running or finished-but-unsent.
        sample_timeout_s: default per-sample deadline (a request may set ``timeout_s``).
        initial_version: weight version reported before the first update.
        weights_dirs: folders an update ``path`` must lie in (None: anywhere; shared memory is always
            confined to its folder).
        allowed_hosts: ``Host``/``Origin`` names accepted (default: loopback only; ``serve()`` adds the
            bind address).
        max_body_bytes: request body limit (413 beyond it).
        max_tokens_cap: largest ``max_tokens`` a request may ask for (None: the protocol's bound).
        max_request_tokens: per-request token budget, ``n`` times the sum of the prompts' ``max_tokens``
            (None: no budget beyond the per-sample cap).
        probe_timeout_s: seconds the health probe (a 1-token request per engine) may take.
        write_timeout_s: seconds one write may wait for a client that stopped reading before its response is
            dropped (None: ``guards.DEFAULT_WRITE_TIMEOUT_S``, 30 s).
    """
    state = BridgeState(engines, api_key, max_concurrency, max_queue, sample_timeout_s, initial_version)
    state.liveness = Liveness(state.engines, probe_timeout_s=probe_timeout_s)
    roots = WeightsRoots(weights_dirs)
    hosts = list(allowed_hosts) if allowed_hosts is not None else allowed_hosts_for("127.0.0.1")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.gate = VersionGate(initial_version)
        state.sem = asyncio.Semaphore(max_concurrency)
        state.metrics.version.set(initial_version)
        for e in state.engines:
            await e.start()
        await state.liveness.baseline_all(initial_version)
        try:
            yield
        finally:
            for e in state.engines:
                await e.aclose()

    app = FastAPI(title="FourSight rollout bridge", lifespan=lifespan)
    app.state.bridge = state
    add_guards(app, api_key=api_key, allowed_hosts=hosts, max_body_bytes=max_body_bytes,
               on_reject=lambda kind: state.metrics.errors.labels(kind=kind).inc(), write_timeout_s=write_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        fields = [{"field": _field_name(e.get("loc", ())), "message": e.get("msg", "")} for e in exc.errors()]
        state.metrics.errors.labels(kind="bad_request").inc()
        msg = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
        return JSONResponse(status_code=422, content={"error": f"invalid request: {msg}", "fields": fields})

    async def admit(req: RolloutRequest) -> tuple[list[list[int]], list[Engine]] | JSONResponse:
        """Everything a request must pass before a sample starts, for every route that samples
        (``/v1/rollouts`` and the OpenAI routes): sample count, the served model's field checks
        (``guards.engine_field_errors``), tokenization, and the engines that serve the current
        weights. Returns the prompts' token ids and those engines, or the error response."""
        total = len(req.prompts) * req.n
        if total > MAX_SAMPLES_PER_REQUEST:
            return JSONResponse(status_code=422, content={"error": f"invalid request: n: len(prompts) * n = {total} exceeds {MAX_SAMPLES_PER_REQUEST}",
                                                          "fields": [{"field": "n", "message": "too many samples"}]})
        vocab = state.engines[0].vocab_size
        errs = engine_field_errors(req, None, vocab, max_tokens_cap, max_request_tokens)
        if errs:
            state.metrics.errors.labels(kind="bad_request").inc()
            return unprocessable(errs)
        prompt_ids: list[list[int]] = []
        for i, p in enumerate(req.prompts):
            try:
                prompt_ids.append(await state.engines[0].tokenize(p))
            except Exception as e:  # noqa: BLE001 - reported to the caller, naming the prompt
                return JSONResponse(status_code=422, content={"error": f"invalid request: prompts[{i}]: cannot tokenize: {e}",
                                                              "fields": [{"field": f"prompts[{i}]", "message": str(e)}]})
            if not prompt_ids[-1]:
                return JSONResponse(status_code=422, content={"error": f"invalid request: prompts[{i}]: empty after tokenization",
                                                              "fields": [{"field": f"prompts[{i}]", "message": "empty"}]})
        errs = engine_field_errors(req, prompt_ids, vocab, None, context_length=await state.engines[0].context_length())
        if errs:
            state.metrics.errors.labels(kind="bad_request").inc()
            return unprocessable(errs)
        # samples are tagged with the bridge's version: refuse engines known to serve other weights
        statuses = await state.liveness.check_all()
        usable = [e for e, st in zip(state.engines, statuses) if st != STALE]
        if not usable:
            state.metrics.errors.labels(kind="engine").inc()
            reasons = [state.liveness.of(e).reason for e in state.engines]
            return JSONResponse(status_code=503, content={"error": "no engine serves the current weights: " + "; ".join(r or "" for r in reasons),
                                                          "weight_version": state.gate.version,
                                                          "engines": [{"name": e.name, **state.liveness.of(e).view()} for e in state.engines]})
        return prompt_ids, usable

    @app.post("/v1/rollouts")
    async def rollouts(req: RolloutRequest):
        got = await admit(req)
        if isinstance(got, JSONResponse):
            return got
        prompt_ids, usable = got
        rid = req.request_id or uuid.uuid4().hex
        media = "text/event-stream" if req.stream_format == "sse" else "application/x-ndjson"
        return RolloutStreamResponse(_stream(req, rid, prompt_ids, usable), media_type=media, headers={"X-Request-Id": rid})

    async def _stream(req: RolloutRequest, rid: str, prompt_ids: list[list[int]], usable: list[Engine]) -> AsyncIterator[bytes]:
        gen = events(req, rid, prompt_ids, usable)
        try:
            async for ev in gen:
                yield _encode(ev, req.stream_format)
        finally:
            await gen.aclose()

    async def events(req: RolloutRequest, rid: str, prompt_ids: list[list[int]],
                     usable: list[Engine]) -> AsyncIterator[SampleEvent | ErrorEvent | EndEvent]:
        """The samples of one admitted request as events, each as soon as it finishes, then the end
        event: the one sampling path of the bridge (version held, backpressure, timeouts, engine
        failures as error events, cancellation when the consumer leaves)."""
        m = state.metrics
        t_accept = time.monotonic()
        sp = req.sampling
        timeout = req.timeout_s or state.sample_timeout_s
        total = len(prompt_ids) * req.n
        async with state.gate.read() as version:
            m.active_streams.inc()
            queue: asyncio.Queue = asyncio.Queue()
            # per-stream window: at most max_queue samples of this stream are running or finished-but-unsent,
            # so a slow reader throttles its own stream's engine work (backpressure), never other streams'
            window = asyncio.Semaphore(state.max_queue)

            async def one(pi: int, j: int) -> None:
                idx = pi * req.n + j
                seed = None if sp.seed is None else sp.seed + idx
                max_tokens = req.prompts[pi].max_tokens or sp.max_tokens
                await window.acquire()
                m.pending.inc()
                engine = None
                try:
                    async with state.sem:
                        engine = state.pick_engine(usable)
                        state.inflight[id(engine)] += 1
                        t0 = time.monotonic()

                        async def call(engine=engine):
                            await state.liveness.ensure(engine)  # an engine that failed a call is re-checked first
                            return await engine.generate(prompt_ids[pi], sp, max_tokens, seed, request=rid)

                        try:
                            res = await asyncio.wait_for(call(), timeout)
                            t1 = time.monotonic()
                            m.latency.observe(t1 - t0)
                            ev: Any = SampleEvent(
                                request_id=rid, prompt_index=pi, sample_index=j, prompt_ids=prompt_ids[pi],
                                token_ids=res.token_ids, logprobs=res.logprobs, finish_reason=res.finish_reason,
                                engine=engine.name, weight_version=version, logprobs_mode=engine.logprobs_mode,
                                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                timing=Timing(queued_s=t0 - t_accept, engine_s=t1 - t0, total_s=t1 - t_accept),
                            )
                        except (asyncio.TimeoutError, TimeoutError):
                            ev = ErrorEvent(request_id=rid, prompt_index=pi, sample_index=j, engine=engine.name, weight_version=version,
                                            error=f"timeout: the engine did not finish the sample within {timeout} s")
                            m.errors.labels(kind="timeout").inc()
                        except asyncio.CancelledError:
                            raise
                        except EngineStale as e:
                            ev = ErrorEvent(request_id=rid, prompt_index=pi, sample_index=j, engine=engine.name, weight_version=version,
                                            error=str(e))
                            m.errors.labels(kind="engine").inc()
                        except Exception as e:  # noqa: BLE001 - every engine failure becomes an error event
                            state.liveness.of(engine).mark_unknown()
                            ev = ErrorEvent(request_id=rid, prompt_index=pi, sample_index=j, engine=engine.name, weight_version=version,
                                            error=f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
                            m.errors.labels(kind="engine").inc()
                        finally:
                            state.inflight[id(engine)] -= 1
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 - a bridge bug must still end in an error event, never a hang
                    log.exception("rollout task failed")
                    ev = ErrorEvent(request_id=rid, prompt_index=pi, sample_index=j, engine=getattr(engine, "name", "?"),
                                    weight_version=version, error=f"bridge error: {type(e).__name__}: {e}")
                    m.errors.labels(kind="bridge").inc()
                finally:
                    m.pending.dec()
                m.queue_depth.inc()
                queue.put_nowait(ev)  # the window bounds the queue

            tasks = [asyncio.create_task(one(pi, j)) for pi in range(len(prompt_ids)) for j in range(req.n)]
            n_ok = n_err = 0
            finished = False
            try:
                for _ in range(total):
                    ev = await queue.get()
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

    @app.post("/v1/weights")
    async def weights(req: WeightUpdateRequest):
        field = "path" if req.path is not None else "shm_name"
        resolved = roots.resolve(req.path) if req.path is not None else WeightsRoots([Path(shm_path(""))]).resolve(shm_path(req.shm_name))
        if resolved is None:
            # one answer for "outside the weights folders", "does not exist" and "cannot be read"
            state.metrics.errors.labels(kind="bad_request").inc()
            return unprocessable([{"field": field, "message": WeightsRoots.NOT_ALLOWED}], version=state.gate.version)
        path = str(resolved)
        # every tensor is read and checked before any engine sees the update: a rejected update changes nothing
        from foursight.schema import CheckpointError, check_safetensors

        try:
            await asyncio.to_thread(check_safetensors, path)
        except CheckpointError as ex:
            state.metrics.errors.labels(kind="weight_update").inc()
            return JSONResponse(status_code=422, content={"error": f"invalid request: {field}: {ex}", "version": state.gate.version,
                                                          "fields": [{"field": field, "message": str(ex)}]})
        prev = state.gate.version
        if req.version <= prev:
            return JSONResponse(status_code=409, content={"error": f"version: {req.version} is not greater than the current version {prev}",
                                                          "fields": [{"field": "version", "message": "not increasing"}]})
        t0 = time.monotonic()
        try:
            async with state.gate.write(req.drain_timeout_s):
                acks = []
                for e in state.engines:
                    try:
                        acks.append(await e.update_weights(path, req.version))
                        await state.liveness.of(e).baseline(req.version, state.liveness.state_timeout_s)
                    except Exception as ex:  # noqa: BLE001
                        state.liveness.of(e).update_failed(prev, e.atomic_updates)
                        state.metrics.errors.labels(kind="weight_update").inc()
                        done = [a.get("engine") for a in acks]
                        return JSONResponse(status_code=502, content={
                            "error": f"engine {e.name} failed the update to version {req.version}: {type(ex).__name__}: {ex}",
                            "version": prev, "updated_engines": done})
                state.gate.version = req.version
                state.metrics.version.set(req.version)
        except (DrainTimeout, UpdateInProgress) as ex:
            return JSONResponse(status_code=409, content={"error": f"weight update refused: {ex}", "version": prev})
        return WeightUpdateResponse(version=req.version, previous_version=prev, engines=acks, elapsed_s=time.monotonic() - t0)

    @app.get("/v1/weights")
    async def weight_version():
        return {"version": state.gate.version, "update_in_progress": state.gate.writer, "streams_open": state.gate.readers}

    @app.get("/v1/health")
    @app.get("/health")  # vLLM's liveness route, which clients written for vLLM poll (TRL's VLLMClient)
    async def health(probe: bool = True):
        """Per engine: up, what it serves (``sync``, ``weight_version``, ``engine_version``, ``boot_id``)
        and, unless ``probe=false``, whether a 1-token request completes now (``probe``). 503 unless
        every engine is up, serves the current weights and completes the probe."""
        ups = await asyncio.gather(*(e.health() for e in state.engines))
        # an engine that does not answer its health route is reported at once: its state and the
        # probe would only wait for the clients' connect retries
        live = [e for e, up in zip(state.engines, ups) if up]
        await asyncio.gather(*(state.liveness.of(e).check(state.liveness.state_timeout_s) for e in live))
        down = {"ok": False, "seconds": 0.0, "error": "the engine does not answer its health route"}
        probes = (await asyncio.gather(*(state.liveness.probe(e) if up else _const(down) for e, up in zip(state.engines, ups)))
                  if probe else [None] * len(state.engines))
        entries, healthy = [], True
        for e, up, pr in zip(state.engines, ups, probes):
            view = state.liveness.of(e).view()
            ok = bool(up) and view["sync"] in ("in_sync", "untracked") and (pr is None or pr["ok"])
            healthy &= ok
            state.metrics.engine_up.labels(engine=e.name).set(1 if up else 0)
            state.metrics.engine_in_sync.labels(engine=e.name).set(1 if view["sync"] in ("in_sync", "untracked") else 0)
            entries.append({"name": e.name, "kind": e.kind, "up": bool(up), "ok": ok, "logprobs_mode": e.logprobs_mode, **view, "probe": pr})
        body = {
            "status": "ok" if healthy else "degraded",
            "weight_version": state.gate.version,
            "engines": entries,
            "active_streams": state.gate.readers,
        }
        return JSONResponse(status_code=200 if healthy else 503, content=body)

    @app.get("/metrics")
    async def metrics():
        state.metrics.refresh_rate()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    from foursight.trainer_bridge.openai_api import make_router  # /v1/completions, /v1/chat/completions

    state.admit, state.events = admit, events  # the OpenAI routes sample through the same path
    app.include_router(make_router(state))  # the API key, Host/Origin and body limit: the guards' middleware
    from foursight.trainer_bridge import trl_routes  # TRL's server routes (/server_info, /update_weights, ...)

    state.push_weights = weights  # TRL's /update_weights applies its file as POST /v1/weights does
    app.include_router(trl_routes.make_router(state))
    return app


def serve(engines: Sequence[Engine], host: str = "127.0.0.1", port: int = 8100, allow_remote: bool = False,
          allowed_hosts: Sequence[str] = (), **kwargs) -> None:
    """Run the bridge with uvicorn (blocking). Binds loopback only unless ``allow_remote`` and an
    ``api_key`` are given (:func:`~foursight.trainer_bridge.guards.check_bind`); ``Host``/``Origin``
    may name loopback, ``host`` and ``allowed_hosts``."""
    import uvicorn

    check_bind(host, allow_remote, kwargs.get("api_key"))
    app = create_app(engines, allowed_hosts=allowed_hosts_for(host, allowed_hosts), **kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info")
