"""The bridge's end of TRL's NCCL road: a trainer's broadcast group passed through to the engines.

TRL's ``VLLMClient`` joins the engine's workers as rank 0 of a group and then announces and broadcasts each
update (:mod:`foursight.quant_methods.weight_broadcast` is the engines' side). The bridge holds no tensor of
that road: when every engine can join a group (:meth:`~.backends.base.Engine.broadcast_workers`), TRL's
``/init_weight_transfer_engine`` is passed to every engine at once, each with the ``rank_offset`` of its first
worker (engine ``i`` after ``1 +`` the workers of the engines before it, so ``/get_world_size`` counts
workers, not engines); ``/start_weight_update`` and ``/update_weights`` (``names``, ``dtype_names``,
``shapes``) go to every engine at once too (they all receive the same broadcasts), and every engine checks
what it received before anything is loaded; ``/finish_weight_update`` applies the received update on every
engine under the version gate, as ``POST /v1/weights`` applies a file
(:func:`~.routes.weights.apply_on_engines`: streams of the old version drained, one new version, each engine's
served state recorded). An update an engine refused (a NaN, a wrong shape) is answered 422 naming the engine
and the tensor, at ``/update_weights`` and again at ``/finish_weight_update``; nothing of it is loaded and the
version stays. Where an engine cannot join a group, TRL's NCCL ``init_info`` keeps its 422.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from foursight.trainer_bridge.backends.base import Engine, UpdateRefused


@dataclass
class BridgeGroup:
    """A trainer's group across the bridge's engines: each engine with its first rank, and the update in flight."""

    engines: list[Engine]
    offsets: list[int]
    world_size: int
    #: None outside an update; else the refusal of the update in flight, or "" while nothing was refused
    refused: str | None = None
    received: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def is_group_init(info: Any) -> bool:
    """Whether an ``init_info`` is a broadcast group's (TRL's / vLLM's NCCL handshake names the group's store)."""
    return isinstance(info, dict) and ("master_address" in info or "nccl_unique_id_b64" in info)


def is_group_update(info: Any) -> bool:
    """Whether an ``update_info`` announces broadcast tensors (``names``, ``dtype_names``, ``shapes``)."""
    return isinstance(info, dict) and "names" in info and not any(k in info for k in ("path", "shm_name", "upload"))


def _refuse(field_name: str, message: str, status: int = 422) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": f"invalid request: {field_name}: {message}",
                                                     "fields": [{"field": field_name, "message": message}]})


async def group_workers(engines: list[Engine]) -> list[int | None]:
    """Each engine's ranks in a group (None: it cannot join one, or did not answer)."""
    got = await asyncio.gather(*(e.broadcast_workers() for e in engines), return_exceptions=True)
    return [None if isinstance(w, BaseException) else w for w in got]


async def open_group(state: Any, info: dict[str, Any], refusal: str) -> JSONResponse | dict[str, Any]:
    """Pass TRL's ``init_info`` to every engine (each with its ``rank_offset``), concurrently: they block until the
    trainer joined. 422 with ``refusal`` when some engine cannot join a group; 422 naming the field for an
    ``init_info`` whose ``world_size`` does not count every worker plus the trainer."""
    workers = await group_workers(state.engines)
    cannot = [e.name for e, w in zip(state.engines, workers) if w is None]
    if cannot:
        return _refuse("init_info", f"{refusal} (engine {', '.join(cannot)} cannot join a broadcast group: see docs/scale-out.md)")
    total = sum(workers)
    if info.get("world_size") != total + 1:
        return _refuse("init_info.world_size", f"{info.get('world_size')!r}: the bridge's engines have {total} worker(s), so the "
                                               f"group is {total + 1} ranks with the trainer")
    if int(info.get("rank_offset", 1)) != 1:
        return _refuse("init_info.rank_offset", "the trainer is rank 0 and the engines' workers follow it: send 1")
    offsets = [1 + sum(workers[:i]) for i in range(len(workers))]
    old = state.broadcast_group
    state.broadcast_group = None
    if old is not None:
        await asyncio.gather(*(e.broadcast_close() for e in old.engines), return_exceptions=True)
    try:
        acks = await asyncio.gather(*(e.broadcast_init({**info, "rank_offset": off}) for e, off in zip(state.engines, offsets)))
    except UpdateRefused as ex:
        return _refuse("init_info", str(ex))
    except Exception as ex:  # noqa: BLE001
        return JSONResponse(status_code=502, content={"error": f"joining the broadcast group failed: {type(ex).__name__}: {ex}"})
    state.broadcast_group = BridgeGroup(list(state.engines), offsets, total + 1)
    return {"backend": "nccl-passthrough", "world_size": total + 1, "rank_offsets": offsets, "engines": acks,
            "weight_version": state.gate.version}


async def start(state: Any, group: BridgeGroup) -> dict[str, Any]:
    async with group.lock:
        await asyncio.gather(*(e.broadcast_start() for e in group.engines))
        group.refused, group.received = "", 0
    return {"weight_version": state.gate.version}


async def receive(state: Any, group: BridgeGroup, info: dict[str, Any]) -> JSONResponse | dict[str, Any]:
    """Every engine receives the announced tensors (the trainer broadcasts them meanwhile), checks and holds them."""
    if group.refused is None:
        return _refuse("update_info", "no update in progress on the broadcast group: call /start_weight_update first")
    results = await asyncio.gather(*(e.broadcast_receive(info) for e in group.engines), return_exceptions=True)
    for e, r in zip(group.engines, results):
        if isinstance(r, BaseException):
            why = f"engine {e.name} refused the update: {r}" if isinstance(r, UpdateRefused) else \
                f"engine {e.name} failed to receive the update: {type(r).__name__}: {r}"
            group.refused = group.refused or why
            state.metrics.errors.labels(kind="weight_update").inc()
            return _refuse("update_info", why, 422 if isinstance(r, UpdateRefused) else 502)
    group.received += len(info.get("names") or [])
    return {"received": len(info.get("names") or []), "weight_version": state.gate.version}


def finish_version(state: Any, group: BridgeGroup) -> JSONResponse | int:
    """The version the received update becomes (the route then applies it on every engine:
    :func:`~.routes.weights.apply_on_engines`, streams of the old version drained), or the refusal when no update is
    in progress or a message of it was refused (the engines hold nothing of it then)."""
    refused, group.refused = group.refused, None
    if refused is None:
        return _refuse("finish_weight_update", "no update in progress on the broadcast group")
    if refused:  # the engines hold nothing of it: each starts afresh at the next /start_weight_update
        return _refuse("update_info", f"{refused}; nothing of the update was loaded, the weight version stays {state.gate.version}")
    return state.gate.version + 1


async def close(state: Any) -> None:
    group, state.broadcast_group = state.broadcast_group, None
    if group is not None:
        await asyncio.gather(*(e.broadcast_close() for e in group.engines), return_exceptions=True)
