"""RL weight updates through vLLM's native weight-transfer API (vLLM >= 0.32): a FourSight backend.

Start vLLM with ``--weight-transfer-config '{"backend": "foursight_file"}'``. The vLLM plugin
(:func:`foursight.quant_methods.vllm_plugin.register`) registers this backend with
``vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory`` in every vLLM process.
Then:

* online (``VLLM_SERVER_DEV_MODE=1``, which mounts vLLM 0.32's RL routes):
  ``POST /init_weight_transfer_engine {"init_info": {}}`` once, then per update
  ``POST /start_weight_update``, ``POST /update_weights {"update_info": {"path": FILE}}`` (one or
  more files, each a safetensors file of BF16 tensors under HF names), ``POST /finish_weight_update
  {"weight_version": "7"}``, ``POST /reset_prefix_cache``;
* offline: the same methods of ``vllm.LLM`` (``init_weight_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update``).

``update_weights`` loads the tensors through the model's own ``load_weights``
(:func:`foursight.quant_methods.vllm_weight_sync.load_update`: a checkpoint-mode layer's BF16
weight is quantized into its checkpoint tensors with its current channel set);
``finish_weight_update`` runs the idempotent FourSight post-processing
(:func:`foursight.quant_methods.vllm_weight_sync.finish_update`: ``LayerPlan.process`` of every
layer that received a tensor, the CPU embedding re-pack), once per update however many files
came in. It is the same code the ``/collective_rpc`` route (``FourSightWorkerExtension``) runs,
so both routes give bit-identical engines (``tests/test_vllm_weight_transfer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "foursight_file"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """No connection to set up: the trainer writes files the workers can read."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    #: a safetensors file of BF16 tensors (HF names), readable by every worker
    path: str


class FourSightFileEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """``foursight_file``: weights from safetensors files, FourSight re-quantization at finish."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from foursight.quant_methods.vllm_weight_sync import begin_update

        self._session = begin_update(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # no device synchronisation to wait for: the tensors are loaded synchronously (and
        # torch.accelerator.synchronize() has no accelerator to wait on in the CPU build)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from foursight.quant_methods.vllm_weight_sync import load_update, read_update_file

        if self._session is None:
            raise RuntimeError("foursight_file: update_weights before start_weight_update")
        with torch.no_grad():
            load_update(self.model, read_update_file(update_info.path), self._session)

    def finish_weight_update(self) -> None:
        from foursight.quant_methods.vllm_weight_sync import finish_update

        if self._session is None:
            raise RuntimeError("foursight_file: finish_weight_update before start_weight_update")
        with torch.no_grad():
            finish_update(self.model, self._session)
        self._session = None

    def shutdown(self) -> None:
        self._session = None


def register() -> bool:
    """Register the backend with vLLM's weight-transfer factory (idempotent). False when this
    vLLM has no native weight-transfer API (before 0.32): the ``/collective_rpc`` route remains."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FourSightFileEngine")
    return True
