"""``POST /v1/weights`` (a versioned BF16 weight update; the engines re-quantize) and ``GET /v1/weights``.

An update names a safetensors file or folder (``path``, inside a ``--weights-dir``) or a shared-memory
file (``shm_name``). Every tensor is read and checked before any engine sees it, so a rejected
update changes nothing; the update then waits until the streams started under the old version
have finished (:class:`~.state.VersionGate`), so no stream mixes versions. :func:`push_weights` is
also what TRL's ``/update_weights`` (:mod:`.trl`) applies.

``PUT /v1/weights/uploads/{name}?offset=N&upload_id=ID`` takes an update file over HTTP, in chunks (each
within the body limit), into ``.foursight-uploads/`` of the first ``--weights-dir``: the road of a trainer
on another host (docs/scale-out.md). The upload is applied by its name (TRL's ``/update_weights``
``{"upload": name}``, or ``POST /v1/weights`` with the ``path`` its last chunk answered) and removed once
an apply succeeds; :mod:`foursight.trainer_bridge.uploads` keeps the rules (private file renamed when
complete, one writer per name, bounds, expiry, no link followed).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from foursight.trainer_bridge.backends.base import Engine, UpdateRefused
from foursight.trainer_bridge.guards import WeightsRoots, unprocessable
from foursight.trainer_bridge.protocol import WeightUpdateRequest, WeightUpdateResponse, shm_path
from foursight.trainer_bridge.routes.state import BridgeState, DrainTimeout, State, UpdateInProgress
from foursight.trainer_bridge.uploads import UPLOADS, UploadError

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
    store, upload = state.uploads, None
    if store is not None and req.path is not None:
        try:
            upload = store.upload_of(resolved)  # applied only once complete, never a .part file a writer holds
            if upload is not None:
                store.claim(upload)  # no new writer, DELETE or second apply of it meanwhile
        except UploadError as e:
            return _upload_error(UploadError(e.status, field, e.message), state)
    response = None
    try:
        response = await _checked_push(state, req, field, str(resolved))
    finally:
        if upload is not None:
            store.release(upload, applied=isinstance(response, WeightUpdateResponse))
    return response


async def _checked_push(state: BridgeState, req: WeightUpdateRequest, field: str, path: str):
    # every tensor is read and checked before any engine sees the update: a rejected update changes nothing
    from foursight.schema import CheckpointError
    from foursight.tensor_io import check_safetensors

    try:
        await asyncio.to_thread(check_safetensors, path)
    except CheckpointError as ex:
        state.metrics.errors.labels(kind="weight_update").inc()
        return JSONResponse(status_code=422, content={"error": f"invalid request: {field}: {ex}", "version": state.gate.version,
                                                      "fields": [{"field": field, "message": str(ex)}]})
    return await apply_on_engines(state, req.version, field, lambda e: e.update_weights(path, req.version), req.drain_timeout_s)


async def apply_on_engines(state: BridgeState, version: int, field: str, apply: Callable[[Engine], Awaitable[dict[str, Any]]],
                           drain_timeout_s: float) -> WeightUpdateResponse | JSONResponse:
    """The tail every road into the engines shares (a file, or a broadcast group's received update): ``version`` must
    exceed the current one (409), then under the version gate (streams of the old version drained) ``apply(engine)``
    on every engine in turn, each engine's served state recorded, and the version set. 422 when the first engine
    refused the update before applying any of it (naming ``field``), 502 when an engine failed or refused after
    another applied it."""
    prev = state.gate.version
    if version <= prev:
        return JSONResponse(status_code=409, content={"error": f"version: {version} is not greater than the current version {prev}",
                                                      "fields": [{"field": "version", "message": "not increasing"}]})
    t0 = time.monotonic()
    try:
        async with state.gate.write(drain_timeout_s):
            acks = []
            for e in state.engines:
                try:
                    acks.append(await apply(e))
                    await state.liveness.of(e).baseline(version, state.liveness.state_timeout_s)
                except UpdateRefused as ex:
                    state.metrics.errors.labels(kind="weight_update").inc()
                    if not acks:  # nothing applied anywhere: the update is at fault, every engine serves version prev
                        return JSONResponse(status_code=422, content={
                            "error": f"invalid request: engine {e.name} refused the update to version {version}: {ex}",
                            "version": prev, "fields": [{"field": field, "message": str(ex)}]})
                    state.liveness.of(e).update_failed(prev, True)  # this engine is unchanged; the ones before it moved
                    return JSONResponse(status_code=502, content={
                        "error": f"engine {e.name} refused the update to version {version} after "
                                 f"{', '.join(a.get('engine') for a in acks)} applied it: {ex}",
                        "version": prev, "updated_engines": [a.get("engine") for a in acks]})
                except Exception as ex:  # noqa: BLE001
                    state.liveness.of(e).update_failed(prev, e.atomic_updates)
                    state.metrics.errors.labels(kind="weight_update").inc()
                    done = [a.get("engine") for a in acks]
                    return JSONResponse(status_code=502, content={
                        "error": f"engine {e.name} failed the update to version {version}: {type(ex).__name__}: {ex}",
                        "version": prev, "updated_engines": done})
            state.gate.version = version
            state.metrics.version.set(version)
    except (DrainTimeout, UpdateInProgress) as ex:
        return JSONResponse(status_code=409, content={"error": f"weight update refused: {ex}", "version": prev})
    return WeightUpdateResponse(version=version, previous_version=prev, engines=acks, elapsed_s=time.monotonic() - t0)


@router.post("/v1/weights")
async def weights(req: WeightUpdateRequest, state: State):
    return await push_weights(state, req)


@router.get("/v1/weights")
async def weight_version(state: State):
    return {"version": state.gate.version, "update_in_progress": state.gate.writer, "streams_open": state.gate.readers}


def _upload_error(e: UploadError, state: BridgeState) -> JSONResponse:
    state.metrics.errors.labels(kind="bad_request").inc()
    return JSONResponse(status_code=e.status, content={"error": f"invalid request: {e.field}: {e.message}", "version": state.gate.version,
                                                       "fields": [{"field": e.field, "message": e.message}]})


def _no_uploads(state: BridgeState) -> JSONResponse:
    return unprocessable([{"field": "name", "message": "uploads need a --weights-dir (they are written to its "
                                                        f"{UPLOADS}/ folder)"}], version=state.gate.version)


@router.put("/v1/weights/uploads/{name}")
async def upload_chunk(name: str, request: Request, state: State, offset: int = 0, upload_id: str | None = None):
    """Write one chunk (the request body) at ``offset`` of upload ``name`` (the rules: :mod:`foursight.trainer_bridge.uploads`).
    ``offset`` 0 starts a new upload and answers its ``upload_id``, which every later chunk carries; any other offset
    must equal the uploaded size. Answers ``{"name", "upload_id", "size", "expected_size", "complete"}``, and ``"path"``
    once the file holds the size its safetensors header declares (it is then renamed, and takes no more chunks)."""
    store = state.uploads
    if store is None:
        return _no_uploads(state)
    if offset < 0:
        return unprocessable([{"field": "offset", "message": "must be >= 0"}], version=state.gate.version)
    length = request.headers.get("content-length")
    try:
        up = store.begin(name, offset, upload_id, int(length) if length and length.isdigit() else None)
    except UploadError as e:
        if e.final:
            store.discard(name)
        return _upload_error(e, state)
    try:
        data = await request.body()
        return await asyncio.to_thread(store.write, name, up, offset, data)
    except UploadError as e:
        return _upload_error(e, state)
    finally:
        up.busy = False


@router.delete("/v1/weights/uploads/{name}")
async def delete_upload(name: str, state: State):
    """Remove upload ``name`` (partial or complete); 409 while it is being applied."""
    if state.uploads is None:
        return _no_uploads(state)
    try:
        deleted = state.uploads.delete(name)
    except UploadError as e:
        return _upload_error(e, state)
    return {"name": name, "deleted": deleted}
