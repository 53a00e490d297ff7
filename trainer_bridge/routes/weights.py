"""``POST /v1/weights`` (a versioned BF16 weight update; the engines re-quantize) and ``GET /v1/weights``.

An update names a safetensors file or folder (``path``, inside a ``--weights-dir``) or a shared-memory
file (``shm_name``). Every tensor is read and checked before any engine sees it, so a rejected
update changes nothing; the update then waits until the streams started under the old version
have finished (:class:`~.state.VersionGate`), so no stream mixes versions. :func:`push_weights` is
also what TRL's ``/update_weights`` (:mod:`.trl`) applies.

``PUT /v1/weights/uploads/{name}?offset=N`` takes an update file over HTTP, in chunks (each within
the body limit), into ``.foursight-uploads/`` of the first ``--weights-dir``: the road of a trainer on
another host (docs/scale-out.md). The upload is then applied by its name (TRL's ``/update_weights``
``{"upload": name}``, or ``POST /v1/weights`` with the ``path`` the upload answered) and removed.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from foursight.trainer_bridge.backends.base import UpdateRefused
from foursight.trainer_bridge.guards import WeightsRoots, unprocessable
from foursight.trainer_bridge.protocol import WeightUpdateRequest, WeightUpdateResponse, shm_path
from foursight.trainer_bridge.routes.state import BridgeState, DrainTimeout, State, UpdateInProgress

router = APIRouter()


async def push_weights(state: BridgeState, req: WeightUpdateRequest):
    """Check the update's file, then apply it on every engine under the version gate: the
    :class:`WeightUpdateResponse`, or the error response (422 bad file or an update the first engine
    refused before applying any of it, 409 version or drain, 502 engine failure)."""
    field = "path" if req.path is not None else "shm_name"
    resolved = state.roots.resolve(req.path) if req.path is not None else WeightsRoots([Path(shm_path(""))]).resolve(shm_path(req.shm_name))
    if resolved is None:
        # one answer for "outside the weights folders", "does not exist" and "cannot be read"
        state.metrics.errors.labels(kind="bad_request").inc()
        return unprocessable([{"field": field, "message": WeightsRoots.NOT_ALLOWED}], version=state.gate.version)
    path = str(resolved)
    # every tensor is read and checked before any engine sees the update: a rejected update changes nothing
    from foursight.schema import CheckpointError
    from foursight.tensor_io import check_safetensors

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
                except UpdateRefused as ex:
                    state.metrics.errors.labels(kind="weight_update").inc()
                    if not acks:  # nothing applied anywhere: the update is at fault, every engine serves version prev
                        return JSONResponse(status_code=422, content={
                            "error": f"invalid request: engine {e.name} refused the update to version {req.version}: {ex}",
                            "version": prev, "fields": [{"field": field, "message": str(ex)}]})
                    state.liveness.of(e).update_failed(prev, True)  # this engine is unchanged; the ones before it moved
                    return JSONResponse(status_code=502, content={
                        "error": f"engine {e.name} refused the update to version {req.version} after "
                                 f"{', '.join(a.get('engine') for a in acks)} applied it: {ex}",
                        "version": prev, "updated_engines": [a.get("engine") for a in acks]})
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


@router.post("/v1/weights")
async def weights(req: WeightUpdateRequest, state: State):
    return await push_weights(state, req)


@router.get("/v1/weights")
async def weight_version(state: State):
    return {"version": state.gate.version, "update_in_progress": state.gate.writer, "streams_open": state.gate.readers}


#: the folder, inside the first ``--weights-dir``, that uploads are written to
UPLOADS = ".foursight-uploads"
_UPLOAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors")


def upload_path(state: BridgeState, name: str) -> Path | None:
    """Where upload ``name`` lives (None: no ``--weights-dir``, or a name that is not a plain ``*.safetensors``)."""
    if state.roots.roots is None or not _UPLOAD_NAME.fullmatch(name) or ".." in name:
        return None
    return state.roots.roots[0] / UPLOADS / name


def _write_at(path: Path, offset: int, data: bytes) -> int:
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with open(path, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)
        return f.tell()


@router.put("/v1/weights/uploads/{name}")
async def upload_chunk(name: str, request: Request, state: State, offset: int = 0):
    """Append one chunk (the request body) at ``offset`` of upload ``name``: ``offset`` 0 starts (or restarts)
    the file, any other must equal its current size. Answers ``{"name", "path", "size"}``."""
    path = upload_path(state, name)
    if path is None:
        return unprocessable([{"field": "name", "message": "uploads need a --weights-dir, and a name of letters, digits, '.', '_' "
                                                            "and '-' ending in .safetensors"}], version=state.gate.version)
    size = path.stat().st_size if path.is_file() else 0
    if offset < 0 or (offset and offset != size):
        return unprocessable([{"field": "offset", "message": f"must be 0 (a new upload) or the uploaded size {size}"}],
                             version=state.gate.version)
    data = await request.body()
    size = await asyncio.to_thread(_write_at, path, offset, data)
    return {"name": name, "path": str(path), "size": size}


@router.delete("/v1/weights/uploads/{name}")
async def delete_upload(name: str, state: State):
    path = upload_path(state, name)
    if path is not None:
        path.unlink(missing_ok=True)
    return {"name": name, "deleted": True}


def consume_upload(path: Path) -> None:
    """Remove an upload once applied (or refused): an upload is one update."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
