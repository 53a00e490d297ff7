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

import dataclasses
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError

from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.bridge_config import BridgeConfig
from foursight.trainer_bridge.guards import add_guards, allowed_hosts_for, check_bind, field_name, invalid_request
from foursight.trainer_bridge.routes import health, openai, rollouts, trl, weights
from foursight.trainer_bridge.routes.state import BridgeState
from foursight.trainer_bridge.uploads import FALLBACK_MAX_UPLOAD_BYTES, UploadStore


def bridge_config(config: BridgeConfig | None = None, **options: Any) -> BridgeConfig:
    """``config`` (default: :class:`BridgeConfig`'s defaults) with ``options`` (its field names) replaced; an
    unknown option is a ``TypeError`` naming it."""
    return dataclasses.replace(config or BridgeConfig(), **options)


def upload_store(roots: Sequence[Path] | None, config: BridgeConfig) -> UploadStore | None:
    """The bridge's weight uploads, in its first ``--weights-dir`` (None without one: uploads are refused), with the
    configured bounds or their defaults (the model folder's :func:`foursight.tensor_io.update_bytes`)."""
    if not roots:
        return None
    from foursight.tensor_io import update_bytes  # torch: only where uploads are taken

    one = config.max_upload_bytes or update_bytes(config.model or config.tokenizer) or FALLBACK_MAX_UPLOAD_BYTES
    return UploadStore(roots[0], one, config.max_uploads_bytes or 2 * one, config.upload_ttl_s)


def create_app(engines: Sequence[Engine], config: BridgeConfig | None = None, **options: Any) -> FastAPI:
    """Build the bridge app for ``engines`` (all serve the same model; calls go to the least-loaded one).

    The options are the fields of :class:`~foursight.trainer_bridge.bridge_config.BridgeConfig` (each
    documented there, as the flag it is): a ``config``, and/or keyword arguments that replace its fields,
    e.g. ``create_app(engines, api_key=KEY, sample_timeout_s=120)``. The app reads:

    * ``api_key`` — required on every route but health, metrics and ``GET /v1/weights`` when set;
    * ``max_concurrency``, ``max_queue``, ``sample_timeout_s`` (a request may set ``timeout_s``), ``initial_version``;
    * ``weights_dirs`` — folders an update ``path`` must lie in (None: anywhere; shared memory is always confined);
    * ``host`` and ``allowed_hosts`` — ``Host``/``Origin`` may name loopback, ``host`` and ``allowed_hosts``;
    * ``max_body_bytes``, ``max_tokens_cap`` (None: the protocol's bound), ``max_request_tokens`` (``n`` times the
      sum of the prompts' ``max_tokens``; None: no budget beyond the per-sample cap), ``write_timeout_s`` (seconds
      one write may wait for a client that stopped reading before its response is dropped), ``probe_timeout_s``
      (seconds the health probe may take).
    """
    cfg = bridge_config(config, **options)
    state = BridgeState(engines, cfg)
    state.uploads = upload_store(state.roots.roots, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="FourSight rollout bridge", lifespan=lifespan)
    app.state.bridge = state  # what every route receives (routes.state.bridge_state)
    add_guards(app, api_key=cfg.api_key, allowed_hosts=allowed_hosts_for(cfg.host, cfg.allowed_hosts),
               max_body_bytes=cfg.max_body_bytes, on_reject=lambda kind: state.metrics.errors.labels(kind=kind).inc(),
               write_timeout_s=cfg.write_timeout_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        fields = [{"field": field_name(e), "message": e.get("msg", "")} for e in exc.errors()]
        state.metrics.errors.labels(kind="bad_request").inc()
        return invalid_request(request.url.path, fields)

    for module in (rollouts, weights, health, openai, trl):  # the API key, Host/Origin and body limit: the guards' middleware
        app.include_router(module.router)
    return app


def serve(engines: Sequence[Engine], config: BridgeConfig | None = None, **options: Any) -> None:
    """Run the bridge with uvicorn on ``host:port`` (blocking); options as :func:`create_app`. Binds loopback
    only unless ``allow_remote`` and an ``api_key`` are given (:func:`~foursight.trainer_bridge.guards.check_bind`)."""
    import uvicorn

    cfg = bridge_config(config, **options)
    check_bind(cfg.host, cfg.allow_remote, cfg.api_key)
    uvicorn.run(create_app(engines, cfg), host=cfg.host, port=cfg.port, log_level="info")
