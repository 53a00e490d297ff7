"""``foursight_nccl``: vLLM 0.32's weight-transfer backend for the broadcast road (docs/scale-out.md,
"Weights over a broadcast group"): the messages of vLLM's own ``nccl`` backend, received by
:class:`foursight.quant_methods.weight_broadcast.BroadcastReceiver` (the transport), checked and applied
in the file road's update session (:class:`foursight.quant_methods.vllm_weight_update.UpdateSession`). Registered
with vLLM's weight-transfer factory by the plugin (:func:`register`)."""

from __future__ import annotations

from typing import Any

from foursight.quant_methods.vllm_compat import worker_global_rank
from foursight.quant_methods.vllm_weight_update import UpdateSession
from foursight.quant_methods.weight_broadcast import BACKEND, BroadcastReceiver


def _engine_base():
    try:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
    except ImportError:  # a vLLM without the native API: the worker-extension route remains
        return object
    return WeightTransferEngine


class FourSightBroadcastEngine(_engine_base()):  # type: ignore[misc]
    """``foursight_nccl``: vLLM's weight-transfer API over a broadcast group, FourSight re-quantization at
    finish (:class:`BroadcastReceiver`). Takes the messages of vLLM's ``nccl`` backend; the communicator
    follows the engine's device (or ``init_info.communicator``)."""

    init_info_cls = dict
    update_info_cls = dict
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receiver = BroadcastReceiver(self.device, UpdateSession)

    def parse_init_info(self, init_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(init_dict)  # parsed by the receiver, which names the field it refuses

    def parse_update_info(self, update_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(update_dict)

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.receiver.init(init_info, worker_global_rank(self.vllm_config.parallel_config))

    def start_weight_update(self) -> None:
        self.receiver.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the receiver's broadcasts are synchronous on the CPU; on CUDA the NCCL stream is waited for before the check
        self.receive_weights(update_info)

    def receive_weights(self, update_info: dict[str, Any]) -> None:
        self.receiver.receive(self.model, update_info)

    def finish_weight_update(self) -> None:
        self.receiver.finish(self.model)

    def shutdown(self) -> None:
        self.receiver.close()

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.26 declares this abstract (see :mod:`.vllm_compat`); the trainer side is :func:`broadcast_packed`."""
        raise NotImplementedError(f"{BACKEND}: the trainer sends with foursight.quant_methods.weight_broadcast.broadcast_packed "
                                  "or vLLM's packed_nccl_broadcast_producer")


def register() -> bool:
    """Register ``foursight_nccl`` with vLLM's weight-transfer factory (idempotent); False without the API."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FourSightBroadcastEngine")
    return True
