"""TRL's vLLM-server routes on the rollout bridge, so that TRL 1.16's GRPO server mode runs against it.

TRL's ``VLLMClient`` (``trl.generation.vllm_client``) and ``GRPOTrainer`` call, besides the OpenAI
routes (:mod:`.openai`) and ``/health``:

* ``GET /server_info`` — the trainer reads ``model_config.logprobs_mode`` (its importance-sampling
  check) and the client ``weight_transfer_config`` (is there a weight-transfer engine);
* ``GET /get_world_size``;
* ``POST /init_weight_transfer_engine`` (TRL's older server: ``/init_communicator/``);
* ``POST /start_weight_update``, ``POST /update_weights``, ``POST /finish_weight_update``;
* ``POST /reset_prefix_cache`` after each sync;
* ``POST /close_communicator/`` (older TRL).

TRL moves the tensors over an NCCL group (CUDA only). The bridge's weight-transfer backend is
``foursight_bridge`` instead: :class:`foursight.trainer_bridge.trl_client.FourSightVLLMClient`
writes the learner's tensors to one safetensors file (``/dev/shm`` by default) and names it in
``update_info`` (``shm_name`` or ``path``), or, from another host, uploads it to the bridge
(``PUT /v1/weights/uploads/{name}``, :mod:`.weights`) and names the complete upload (``upload``); ``/update_weights`` applies it exactly as
``POST /v1/weights`` does (the same handler: checked before any engine sees it, streams drained,
every engine re-quantizes, the version goes up by one). An ``update_info`` without a file (TRL's
own NCCL client) is refused with a 422 that names the client to use, unless every engine can join TRL's
broadcast group: then TRL's NCCL ``init_info`` and each update's ``start`` / ``update_weights`` (``names``,
``dtype_names``, ``shapes``) / ``finish`` are passed through to the engines, and the finish applies the
received update as a new version (:mod:`foursight.trainer_bridge.broadcast`). The routes sit behind the
bridge's guards like every other route (API key, Host/Origin, body size).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from foursight.trainer_bridge import broadcast
from foursight.trainer_bridge.protocol import WeightUpdateRequest
from foursight.trainer_bridge.routes.state import State
from foursight.trainer_bridge.routes.weights import apply_on_engines, push_weights
from foursight.trainer_bridge.uploads import UploadError

#: the weight-transfer backend the bridge reports in ``/server_info`` and accepts in ``init_info``
BACKEND = "foursight_bridge"
CLIENT = "foursight.trainer_bridge.trl.FourSightVLLMClient"


def _refuse(field: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=422, content={"error": f"invalid request: {field}: {message}",
                                                  "fields": [{"field": field, "message": message}]})


#: TRL's server routes (``server.create_app`` includes them); weight updates go through
#: :func:`.weights.push_weights`, what ``POST /v1/weights`` applies
router = APIRouter()


@router.get("/server_info")
async def server_info(state: State, config_format: str = "json"):
    e = state.engines[0]
    return {"vllm_config": {
        "model_config": {"model": e.name, "logprobs_mode": e.logprobs_mode},
        "parallel_config": {"world_size": len(state.engines)},
        "weight_transfer_config": {"backend": BACKEND, "client": CLIENT},
    }, "weight_version": state.gate.version, "engines": [x.name for x in state.engines]}


@router.get("/get_world_size")
async def world_size(state: State):
    """The ranks a trainer's broadcast group has besides the trainer: every engine's workers where every engine can
    join one (:mod:`foursight.trainer_bridge.broadcast`), else one per engine."""
    workers = await broadcast.group_workers(state.engines)
    return {"world_size": sum(workers) if all(w is not None for w in workers) else len(state.engines)}


@router.post("/init_weight_transfer_engine")
@router.post("/init_communicator/")
async def init_transfer(state: State, body: dict[str, Any] | None = None):
    info = (body or {}).get("init_info", body or {})
    refusal = f"the bridge takes weights as files, not over NCCL: use {CLIENT} (backend {BACKEND!r})"
    if broadcast.is_group_init(info):  # TRL's NCCL handshake: passed to the engines when every one can join the group
        return await broadcast.open_group(state, info, refusal)
    backend = info.get("backend", BACKEND) if isinstance(info, dict) else None
    if backend != BACKEND:
        return _refuse("init_info", refusal)
    return {"backend": BACKEND, "weight_version": state.gate.version}


@router.post("/start_weight_update")
async def start_update(state: State, body: dict[str, Any] | None = None):
    if state.broadcast_group is not None:
        return await broadcast.start(state, state.broadcast_group)
    return {"weight_version": state.gate.version}


@router.post("/finish_weight_update")
async def finish_update(state: State, body: dict[str, Any] | None = None):
    group = state.broadcast_group
    if group is not None and group.refused is not None:
        version = broadcast.finish_version(state, group)
        if isinstance(version, JSONResponse):
            return version
        drain = WeightUpdateRequest.model_fields["drain_timeout_s"].default
        return await apply_on_engines(state, version, "update_info", lambda e: e.broadcast_finish(version), drain)
    return {"weight_version": state.gate.version}


@router.post("/close_communicator/")
async def close_group(state: State, body: dict[str, Any] | None = None):
    await broadcast.close(state)
    return {"weight_version": state.gate.version}


@router.post("/update_weights")
async def update_weights(body: dict[str, Any], state: State):
    info = body.get("update_info")
    if broadcast.is_group_update(info) and state.broadcast_group is not None:
        return await broadcast.receive(state, state.broadcast_group, info)
    if not isinstance(info, dict) or not any(k in info for k in ("path", "shm_name", "upload")):
        return _refuse("update_info", f"no 'path', 'shm_name' or 'upload': the bridge takes weights as a safetensors file, "
                                      f"not over NCCL; use {CLIENT}")
    uploaded = None
    if "upload" in info:
        if "path" in info or "shm_name" in info:
            return _refuse("update_info.upload", "given with 'path'/'shm_name': name one file")
        if state.uploads is None:
            return _refuse("update_info.upload", "this bridge takes no uploads (it has no --weights-dir)")
        try:
            uploaded = state.uploads.complete_path(str(info["upload"]))
        except UploadError as e:
            return _refuse("update_info.upload", e.message)
    try:
        req = WeightUpdateRequest(path=str(uploaded) if uploaded else info.get("path"), shm_name=info.get("shm_name"),
                                  version=state.gate.version + 1)
    except ValidationError as e:
        return _refuse("update_info", "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))
    return await push_weights(state, req)  # an upload is removed once applied, kept when refused (a retry finds it)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache():
    """Nothing to do: every engine's prefix cache is reset by each weight update."""
    return {"success": True}
