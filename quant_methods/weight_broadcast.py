"""The broadcast road: a learner's BF16 tensors over a collective group into FourSight's re-quantization.

TRL's server mode (``VLLMClient.init_communicator`` / ``update_named_params``) and vLLM's own ``nccl``
weight-transfer engine move the learner's tensors GPU to GPU: the trainer joins the engine's workers as
rank 0 of a group (a TCP store at ``master_address:master_port``, vLLM's ``StatelessProcessGroup``),
announces each update as ``{"names", "dtype_names", "shapes"}`` and broadcasts the tensors in that order,
packed into uint8 chunks (vLLM's ``packed_tensor`` wire format; one broadcast per tensor when
``packed`` is false). This module is the receiving side of that road for a FourSight engine:

* :class:`BroadcastReceiver` joins the group
  (:func:`~foursight.quant_methods.broadcast_communicators.open_communicator`), receives one update message's
  tensors (:func:`receive_tensors`: every broadcast of the message is consumed before anything is
  checked, so a refused tensor leaves the group in step with the trainer) and hands them to the file road's
  update session (:class:`foursight.quant_methods.vllm_weight_update.UpdateSession`, the one every road runs):
  each message's tensors checked once as they arrive (names, dtypes, shapes, finiteness; a refusal names the
  tensor and starts with :data:`foursight.schema.REFUSED_PREFIX`) and kept; at the end of the update every part
  loaded and re-quantized at once, with the same "a refused update changes nothing" as the file road. The
  session is given to the receiver by its host, so this module is the transport alone and imports nothing of
  the update code. The update is held until then, on the engine's device (one copy of it:
  docs/scale-out.md, "Memory");
* two entry points feed it, one per vLLM release (docs/scale-out.md, "Weights over a broadcast group"):
  :class:`foursight.quant_methods.vllm_broadcast_backend.FourSightBroadcastEngine`, vLLM 0.32's
  weight-transfer backend ``foursight_nccl`` (``--weight-transfer-config '{"backend": "foursight_nccl"}'``:
  ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
  the messages TRL and vLLM's ``NCCLTrainerWeightTransferEngine`` send to vLLM's ``nccl`` backend), and
  :class:`BroadcastWorkerMixin`, methods of the FourSight worker extension called through
  ``collective_rpc`` (``foursight_broadcast_init`` / ``_start`` / ``_receive`` / ``_finish`` /
  ``_close``; any vLLM release with the worker extension, 0.26 on the device), which tag the
  worker's weight version and weights id as ``foursight_update_weights`` does;
* the communicator is the only part that depends on the transport; it has its own module,
  :mod:`foursight.quant_methods.broadcast_communicators` (``Communicator``: ``broadcast(tensor, src)``,
  ``close()``; NCCL on CUDA, Gloo on the CPU, what the tests run). An engine on CUDA takes ``nccl`` and one
  on the CPU ``gloo`` unless the init info names ``communicator``. The trainer side for the tests and for
  CPU learners is :func:`open_trainer_group` and :func:`broadcast_packed` (the argument list of vLLM's ``packed_nccl_broadcast_producer``,
  without its CUDA streams).

An engine served over HTTP (``VLLM_SERVER_DEV_MODE=1``) joins a group only with its
``FOURSIGHT_WEIGHTS_TOKEN`` (``token`` in the init info or the RPC's kwargs): the init info names an
address the engine then connects to and takes weights from
(:func:`foursight.quant_methods.weight_authority.authorize_token`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from foursight.quant_methods.broadcast_communicators import COMMUNICATORS, Communicator, open_communicator
from foursight.quant_methods.vllm_compat import worker_global_rank

#: the vLLM weight-transfer backend name (``--weight-transfer-config '{"backend": "foursight_nccl"}'``)
BACKEND = "foursight_nccl"
#: vLLM's packed wire defaults (``vllm.distributed.weight_transfer.packed_tensor``): 1 GiB chunks, 2 buffers
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2


# ---- the messages (vLLM's nccl backend's, field for field) ----

@dataclass(kw_only=True)
class BroadcastInitInfo:
    """``init_info`` of ``/init_weight_transfer_engine``: vLLM's ``NCCLWeightTransferInitInfo`` fields as TRL
    and vLLM's trainer engine send them, plus ``communicator`` (``nccl``/``gloo``; default: ``nccl`` on a
    CUDA engine, ``gloo`` on a CPU one) and ``token`` (the engine's weights token, where it is served over
    HTTP). vLLM's unique-id rendezvous (``nccl_unique_id_b64``) is not taken: the group needs the store."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    communicator: str | None = None
    token: str | None = None

    @classmethod
    def parse(cls, info: dict[str, Any] | str) -> "BroadcastInitInfo":
        """From the JSON object (or its text, as ``/collective_rpc`` may pass it); ValueError naming the field."""
        d = _as_dict(info, "init_info")
        if d.get("nccl_unique_id_b64"):
            raise ValueError(f"init_info.nccl_unique_id_b64: {BACKEND} joins the group through its store; "
                             "send master_address and master_port")
        d.pop("nccl_unique_id_b64", None)
        out = _construct(cls, d, "init_info", "init info")
        for name in ("master_port", "rank_offset", "world_size", "packed_buffer_size_bytes", "packed_num_buffers"):
            v = getattr(out, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "rank_offset" else 1):
                raise ValueError(f"init_info.{name}: must be a positive integer, got {v!r}")
        if not isinstance(out.master_address, str) or not out.master_address:
            raise ValueError(f"init_info.master_address: must be a host name, got {out.master_address!r}")
        if out.communicator is not None and out.communicator not in COMMUNICATORS:
            raise ValueError(f"init_info.communicator: must be one of {', '.join(COMMUNICATORS)}, got {out.communicator!r}")
        return out


@dataclass
class BroadcastUpdateInfo:
    """``update_info`` of ``/update_weights``: what the trainer broadcasts next, in order (vLLM's
    ``NCCLWeightTransferUpdateInfo``; ``packed`` is TRL's per-update field for vLLM < 0.28, which
    overrides the init info's)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = None

    @classmethod
    def parse(cls, info: dict[str, Any] | str) -> "BroadcastUpdateInfo":
        out = _construct(cls, _as_dict(info, "update_info"), "update_info", "update info")
        if not (isinstance(out.names, list) and isinstance(out.dtype_names, list) and isinstance(out.shapes, list)):
            raise ValueError("update_info: names, dtype_names and shapes must be lists")
        if not len(out.names) == len(out.dtype_names) == len(out.shapes):
            raise ValueError(f"update_info: {len(out.names)} names, {len(out.dtype_names)} dtype_names and {len(out.shapes)} shapes")
        for n, s in zip(out.names, out.shapes):
            if not isinstance(n, str) or not isinstance(s, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in s):
                raise ValueError(f"update_info.shapes: tensor {n}: not a list of sizes ({s!r})")
        return out

    def metadata(self) -> list[tuple[str, list[int], torch.dtype]]:
        """``(name, shape, dtype)`` per tensor; ValueError naming the tensor for a dtype torch lacks."""
        out = []
        for n, dn, s in zip(self.names, self.dtype_names, self.shapes):
            dt = getattr(torch, str(dn).removeprefix("torch."), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"update_info.dtype_names: tensor {n}: {dn!r} is not a torch dtype")
            out.append((n, list(s), dt))
        return out


def _as_dict(info: dict[str, Any] | str, what: str) -> dict[str, Any]:
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError as e:
            raise ValueError(f"{what}: not JSON ({e})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{what}: must be a JSON object, got {type(info).__name__}")
    return dict(info)


def _construct(cls: Any, d: dict[str, Any], what: str, title: str) -> Any:
    """``cls(**d)``, refusing a key that is not a field of ``cls`` and a missing or wrong argument with a
    ValueError naming ``what`` (the field's path) and the fields there are."""
    known = {f.name for f in fields(cls)}
    extra = sorted(set(d) - known)
    if extra:
        raise ValueError(f"{what}.{extra[0]}: not a field of {BACKEND}'s {title} ({', '.join(sorted(known))})")
    try:
        return cls(**d)
    except TypeError as e:
        raise ValueError(f"{what}: {e}") from None


# ---- the wire: vLLM's packed chunks ----

def packed_chunks(metadata: Iterable[tuple[str, list[int], torch.dtype]], buffer_size_bytes: int) -> list[list[tuple[str, list[int], torch.dtype, int]]]:
    """The chunks the trainer broadcasts for ``metadata``, as vLLM's packed producer cuts them
    (``pack_tensors``: tensors are added until the chunk's bytes exceed ``buffer_size_bytes``, the
    tensor that crosses the bound included); each entry ``(name, shape, dtype, bytes)``."""
    chunks: list[list[tuple[str, list[int], torch.dtype, int]]] = [[]]
    size = 0
    for name, shape, dtype in metadata:
        nbytes = math.prod(shape) * dtype.itemsize
        chunks[-1].append((name, shape, dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]


def receive_tensors(comm: Communicator, update: BroadcastUpdateInfo, packed: bool, buffer_size_bytes: int,
                    device: torch.device | str = "cpu", src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Receive every tensor ``update`` announces, broadcast from ``src``: packed chunks
    (:func:`packed_chunks`, unpacked with vLLM's ``unpack_tensor``) or one broadcast per tensor.
    Nothing is checked here: every broadcast of the message is consumed, so the caller can refuse a
    tensor and the group stays in step with the trainer."""
    meta = update.metadata()
    out: list[tuple[str, torch.Tensor]] = []
    if not packed:
        for name, shape, dtype in meta:
            t = torch.empty(shape, dtype=dtype, device=device)
            comm.broadcast(t, src)
            out.append((name, t))
        return out
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    for chunk in packed_chunks(meta, buffer_size_bytes):
        buf = torch.empty(sum(c[3] for c in chunk), dtype=torch.uint8, device=device)
        comm.broadcast(buf, src)
        out.extend(unpack_tensor(buf, [c[0] for c in chunk], [c[1] for c in chunk], [c[2] for c in chunk], [c[3] for c in chunk]))
    return out


def open_trainer_group(init_info: dict[str, Any], communicator: str = "gloo", timeout_s: float = 300.0) -> Communicator:
    """The trainer's end of the group (rank 0, which hosts the store): the ``init_info`` sent to the engine
    (``master_address``, ``master_port``, ``world_size``). What TRL's client does with vLLM's
    ``trainer_init`` for NCCL; ``communicator="gloo"`` for a CPU learner."""
    device = torch.cuda.current_device() if communicator == "nccl" else None
    return open_communicator(communicator, init_info["master_address"], init_info["master_port"], 0, int(init_info["world_size"]),
                             device=device, timeout_s=timeout_s)


def broadcast_packed(iterator: Iterator[tuple[str, torch.Tensor]], group: Communicator, src: int = 0,
                     post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] = lambda item: item[1],
                     buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> None:
    """The trainer's send: vLLM's ``packed_nccl_broadcast_producer`` (same arguments, same chunks: its own
    ``pack_tensors``) without the CUDA streams, for any :class:`Communicator`. ``num_buffers`` is accepted
    for the same signature; the broadcasts here are synchronous."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    while (chunk := pack_tensors(iterator, post_iter_func, buffer_size_bytes)) is not None:
        group.broadcast(chunk.packed_tensor, src)


def update_info_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The ``update_info`` announcing ``named`` (as TRL's ``update_named_params`` builds it)."""
    named = list(named)
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


# ---- the receiving engine side: one update session over the group ----

class BroadcastReceiver:
    """One engine worker's end of the group and its update session (init, then per update: start,
    one or more receives, finish). Refusals raise :class:`~foursight.quant_methods.weight_authority.RefusedUpdate`
    whose message starts with :data:`foursight.schema.REFUSED_PREFIX`; a refused update loads nothing."""

    def __init__(self, device: torch.device | str | int, new_session: Callable[[torch.nn.Module], UpdateSessionLike]):
        """``new_session(model)``: the file road's update session for one update
        (:class:`foursight.quant_methods.vllm_weight_update.UpdateSession`: each message's tensors checked once as they
        arrive, then every part loaded and re-quantized at once). Passed in, so that this module stays the
        transport and imports nothing of the engine's update code."""
        self.device = torch.device(device) if not isinstance(device, torch.device) else device
        self._new_session = new_session
        self.comm: Communicator | None = None
        self.info: BroadcastInitInfo | None = None
        self._session: UpdateSessionLike | None = None
        self._started = False

    def init(self, init_info: dict[str, Any] | str | BroadcastInitInfo, worker_rank: int) -> dict:
        """Join the trainer's group as rank ``worker_rank + rank_offset`` (blocks until every rank joined)."""
        from foursight.quant_methods.weight_authority import RefusedUpdate, authorize_token
        from foursight.schema import REFUSED_PREFIX

        try:
            info = init_info if isinstance(init_info, BroadcastInitInfo) else BroadcastInitInfo.parse(init_info)
        except ValueError as e:
            raise RefusedUpdate(f"{REFUSED_PREFIX}{e}") from None
        authorize_token(info.token)
        kind = info.communicator or ("nccl" if self.device.type == "cuda" else "gloo")
        if kind == "nccl" and self.device.type != "cuda":
            raise RefusedUpdate(f"{REFUSED_PREFIX}init_info.communicator: nccl needs a CUDA engine; this one runs on "
                                f"{self.device.type} (use gloo)")
        self.close()
        rank = worker_rank + info.rank_offset
        if rank >= info.world_size:
            raise RefusedUpdate(f"{REFUSED_PREFIX}init_info.world_size: {info.world_size} leaves no rank for this worker "
                                f"(rank {rank} = worker {worker_rank} + rank_offset {info.rank_offset})")
        self.comm = open_communicator(kind, info.master_address, info.master_port, rank, info.world_size,
                                      device=self.device if kind == "nccl" else None)
        self.info = info
        return {"rank": rank, "world_size": info.world_size, "communicator": kind}

    def start(self) -> None:
        self._session, self._refused, self._started = None, None, True

    def receive(self, model: torch.nn.Module, update_info: dict[str, Any] | str | BroadcastUpdateInfo) -> int:
        """Receive one message's tensors and hand them to the update's session, which checks them once (names,
        dtypes, shapes, finiteness) and keeps them for :meth:`finish`. A refused tensor refuses the whole update
        (it is received first: the group stays in step)."""
        from foursight.quant_methods.weight_authority import RefusedUpdate
        from foursight.schema import REFUSED_PREFIX

        if self.comm is None or self.info is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        if not self._started:
            raise RuntimeError(f"{BACKEND}: update_weights before start_weight_update")
        try:
            update = update_info if isinstance(update_info, BroadcastUpdateInfo) else BroadcastUpdateInfo.parse(update_info)
            update.metadata()
        except ValueError as e:
            self._refused = str(e)
            raise RefusedUpdate(f"{REFUSED_PREFIX}{e}") from None
        packed = self.info.packed if update.packed is None else bool(update.packed)
        tensors = receive_tensors(self.comm, update, packed, self.info.packed_buffer_size_bytes, self.device)
        if self._session is None:
            self._session = self._new_session(model)
        try:
            return self._session.receive(tensors)
        except Exception as e:
            raise RefusedUpdate(f"{REFUSED_PREFIX}{e}") from e

    def finish(self, model: torch.nn.Module) -> dict:
        """Apply the update received since :meth:`start` (its session's ``apply``: loaded and re-quantized once);
        an update with a refused message loads nothing."""
        started, session, refused = self._started, self._session, self._refused
        self._started, self._session, self._refused = False, None, None
        if not started:
            raise RuntimeError(f"{BACKEND}: finish_weight_update before start_weight_update")
        refused = refused or (session.refused if session is not None else None)
        if refused is not None:
            raise RuntimeError(f"{BACKEND}: the update was refused, nothing of it is loaded ({refused})")
        return (session if session is not None else self._new_session(model)).apply()

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self.comm, self.info, self._session, self._started = None, None, None, False


class UpdateSessionLike(Protocol):
    """What the receiver needs of an update session (:class:`foursight.quant_methods.vllm_weight_update.UpdateSession`)."""

    refused: str | None

    def receive(self, weights: Iterable[tuple[str, torch.Tensor]], where: str = "") -> int: ...

    def apply(self) -> dict: ...


# ---- any vLLM with the worker extension (0.26 on the device): collective_rpc methods ----

class BroadcastWorkerMixin:
    """The broadcast road's methods of the FourSight worker extension
    (:class:`~foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension`), for ``collective_rpc``:
    ``foursight_broadcast_init(init_info, token=None)``, ``foursight_broadcast_start()``,
    ``foursight_broadcast_receive(update_info)``, ``foursight_broadcast_finish(version, weights_id=None)``
    (applies, then sets the version and weights id that ``foursight_engine_state`` reports),
    ``foursight_broadcast_close()``. ``init_info``/``update_info`` may come as JSON text."""

    #: the host class's update session (:class:`BroadcastReceiver`'s ``new_session``), as a ``staticmethod``: the
    #: worker extension gives the file road's :class:`~foursight.quant_methods.vllm_weight_update.UpdateSession`
    _broadcast_session: Callable[[torch.nn.Module], UpdateSessionLike] | None = None

    def _foursight_receiver(self) -> BroadcastReceiver:
        r = getattr(self, "_foursight_broadcast", None)
        if r is None:
            cls = type(self)
            if cls._broadcast_session is None:
                raise TypeError(f"{cls.__name__}: a BroadcastWorkerMixin host sets _broadcast_session")
            r = self._foursight_broadcast = BroadcastReceiver(getattr(self, "device", "cpu"), cls._broadcast_session)
        return r

    def foursight_broadcast_init(self, init_info: dict[str, Any] | str, token: str | None = None) -> dict:
        info = _as_dict(init_info, "init_info")
        if token is not None:
            info["token"] = token
        return self._foursight_receiver().init(info, worker_global_rank(self.vllm_config.parallel_config))  # type: ignore[attr-defined]

    def foursight_broadcast_start(self) -> None:
        self._foursight_receiver().start()

    def foursight_broadcast_receive(self, update_info: dict[str, Any] | str) -> dict:
        return {"received": self._foursight_receiver().receive(self._foursight_model(), update_info)}  # type: ignore[attr-defined]

    def foursight_broadcast_finish(self, version: int | str, weights_id: str | None = None) -> dict:
        t0 = time.perf_counter()
        v = int(version)
        info = self._foursight_receiver().finish(self._foursight_model())  # type: ignore[attr-defined]
        self._foursight_version = v
        self._foursight_weights_id = weights_id
        info.update(version=v, seconds=round(time.perf_counter() - t0, 3))
        return info

    def foursight_broadcast_close(self) -> None:
        self._foursight_receiver().close()
