"""``GET /v1/health`` (also ``GET /health``, vLLM's spelling, which clients written for vLLM poll) and
``GET /metrics`` (Prometheus).

Health reports, per engine: up, what it serves (:mod:`foursight.trainer_bridge.liveness`) and
whether a 1-token probe completes now; 503 unless all are fine.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from foursight.trainer_bridge.routes.state import State

router = APIRouter()


async def _const(v):
    return v


@router.get("/v1/health")
@router.get("/health")  # vLLM's liveness route, which clients written for vLLM poll (TRL's VLLMClient)
async def health(state: State, probe: bool = True):
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


@router.get("/metrics")
async def metrics(state: State):
    state.metrics.refresh_rate()
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
