"""The rollout bridge: a FastAPI service in front of one or more engine servers.

Endpoints (docs/bridge.md has the full protocol), one module of :mod:`foursight.trainer_bridge.routes` each:

* ``POST /v1/rollouts`` (:mod:`~.routes.rollouts`) — stream one event per sample as soon as that
  sample finishes, then an end event. Each stream holds the weight version it started under; a
  weight update waits until the streams started under the old version have finished (so no stream
  mixes versions).
* ``POST /v1/weights`` (:mod:`~.routes.weights`) — versioned BF16 weight update (engines
  re-quantize); ``GET /v1/weights``.
* ``GET /v1/health`` (also ``GET /health``, vLLM's spelling) (:mod:`~.routes.health`) — per engine:
  up, what it serves, a 1-token probe (503 unless all are fine); ``GET /metrics`` — Prometheus.
* the OpenAI routes (:mod:`~.routes.openai`) and TRL's server routes (:mod:`~.routes.trl`).

The API key (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``) is required on every route but
``GET /v1/health`` (``/health``), ``GET /metrics`` and ``GET /v1/weights`` when the server has one, checked before the body is read; ``Host``,
``Origin`` and the body size are checked first, and a response whose client stops reading is
dropped after a write timeout (:mod:`foursight.trainer_bridge.guards`). The bridge tracks what each
engine serves (:mod:`foursight.trainer_bridge.liveness`). The routes share one
:class:`~.routes.state.BridgeState` (``app.state.bridge``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.guards import DEFAULT_MAX_BODY_BYTES, add_guards, allowed_hosts_for, check_bind, field_name, invalid_request
from foursight.trainer_bridge.routes import health, openai, rollouts, trl, weights
from foursight.trainer_bridge.routes.state import BridgeState


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
            dropped (None: ``guards.DEFAULT_WRITE_TIMEOUT_S``, 30 s; ``--write-timeout`` of the CLI).
    """
    state = BridgeState(engines, api_key, max_concurrency, max_queue, sample_timeout_s, initial_version, weights_dirs=weights_dirs,
                        max_tokens_cap=max_tokens_cap, max_request_tokens=max_request_tokens, probe_timeout_s=probe_timeout_s)
    hosts = list(allowed_hosts) if allowed_hosts is not None else allowed_hosts_for("127.0.0.1")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="FourSight rollout bridge", lifespan=lifespan)
    app.state.bridge = state  # what every route receives (routes.state.bridge_state)
    add_guards(app, api_key=api_key, allowed_hosts=hosts, max_body_bytes=max_body_bytes,
               on_reject=lambda kind: state.metrics.errors.labels(kind=kind).inc(), write_timeout_s=write_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        fields = [{"field": field_name(e), "message": e.get("msg", "")} for e in exc.errors()]
        state.metrics.errors.labels(kind="bad_request").inc()
        return invalid_request(request.url.path, fields)

    for module in (rollouts, weights, health, openai, trl):  # the API key, Host/Origin and body limit: the guards' middleware
        app.include_router(module.router)
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
