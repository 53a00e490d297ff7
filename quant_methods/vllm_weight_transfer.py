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

``update_weights`` first asks :func:`foursight.quant_methods.weight_authority.authorize_update`:
an engine served over HTTP loads only with its ``FOURSIGHT_WEIGHTS_TOKEN`` (``update_info.token``)
and only from its weights folders, and a refusal names no other path. It then reads each file
whole, once, checks the tensors it read once (every tensor finite; names, dtypes and shapes against
the model) and keeps **those tensors**, not the path (issue 38 item 2: a file rewritten before
``finish_weight_update``, or a path reused for the next bucket, changes nothing of what was checked):
:meth:`foursight.quant_methods.vllm_weight_update.UpdateSession.receive`. ``finish_weight_update``
loads every kept bucket, in order, through the model's own ``load_weights`` and runs the idempotent
FourSight post-processing once per update however many files came in
(:meth:`~foursight.quant_methods.vllm_weight_update.UpdateSession.apply`). The tensors are held in host memory from ``update_weights`` to
``finish_weight_update`` (the size of the update). An update with a refused file loads nothing, so nothing of it is ever
served, and vLLM keeps its weight version (issue 28). It is the same code the ``/collective_rpc`` route (``FourSightWorkerExtension``) runs,
so both routes give bit-identical engines (the session :func:`~foursight.quant_methods.vllm_weight_update.run_update` runs there) (``tests/test_vllm_weight_transfer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "foursight_file"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """No connection to set up: the trainer writes files the workers can read."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    #: a safetensors file of BF16 tensors (HF names), readable by every worker
    path: str
    #: the engine's ``FOURSIGHT_WEIGHTS_TOKEN`` (required when the engine serves its routes over HTTP)
    token: str | None = None


class FourSightFileEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """``foursight_file``: weights from safetensors files, FourSight re-quantization at finish."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = None  # the UpdateSession between start_weight_update and finish_weight_update

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from foursight.quant_methods.vllm_weight_update import UpdateSession

        self._session = UpdateSession(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # no device synchronisation to wait for: the tensors are loaded synchronously (and
        # torch.accelerator.synchronize() has no accelerator to wait on in the CPU build)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        """Authorize the file (:func:`~foursight.quant_methods.weight_authority.authorize_update`), read
        it whole once, check the tensors read once (every tensor finite, names, dtypes and shapes) and keep
        them for ``finish_weight_update`` (:meth:`~foursight.quant_methods.vllm_weight_update.UpdateSession.receive`);
        nothing is loaded yet. A refused file refuses the whole update."""
        from foursight.quant_methods.weight_authority import RefusedUpdate, authorize_update
        from foursight.schema import REFUSED_PREFIX
        from foursight.tensor_io import iter_safetensors

        if self._session is None:
            raise RuntimeError("foursight_file: update_weights before start_weight_update")
        try:
            path = authorize_update(update_info.path, update_info.token)
            # read once, checked once (finiteness included): the tensors checked are the tensors loaded
            self._session.receive(iter_safetensors(path, check=False), f" in {path}")
        except Exception as e:
            self._session.refused = str(e)
            if isinstance(e, RefusedUpdate):
                raise
            raise RefusedUpdate(f"{REFUSED_PREFIX}{e}") from e  # nothing of the update is loaded: the update is at fault

    def finish_weight_update(self) -> None:
        """Load every bucket of the update, as checked, and re-quantize (the same three steps as
        ``apply_weight_update``). An update with a refused file loads nothing: the engine keeps its
        weights, and vLLM keeps its weight version (it sets it only after this returns)."""
        if self._session is None:
            raise RuntimeError("foursight_file: finish_weight_update before start_weight_update")
        session, self._session = self._session, None
        try:
            session.apply()  # a refused file, or half a CPU-packed fused layer: refused before anything loads
        except RuntimeError as e:
            if session.refused is not None:
                raise RuntimeError(f"foursight_file: {e}") from None
            raise

    def shutdown(self) -> None:
        self._session = None

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.26 declares this abstract (the trainer-side sender of NCCL/IPC backends), so the class could not be
        built there without it; 0.32 moved senders to ``TrainerWeightTransferEngine``. This backend has no sender: the
        trainer writes a safetensors file (or the bridge's upload route does) and passes its path to ``update_weights``."""
        raise NotImplementedError("foursight_file has no trainer-side sender: write the tensors to a safetensors file in the engine's "
                                  "weights folder and pass its path in update_info (docs/weight-sync.md)")


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
