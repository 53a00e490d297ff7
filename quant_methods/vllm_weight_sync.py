"""RL weight updates into a running vLLM engine serving FourSight (no restart).

:class:`FourSightWorkerExtension` is mixed into vLLM's worker class with
``--worker-extension-cls foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension``
(``LLM(..., worker_extension_cls=...)`` offline); its methods are then callable on every worker
through ``collective_rpc``:

* offline: ``llm.collective_rpc("foursight_update_weights", args=(path, version))``;
* online: ``POST /collective_rpc`` with ``{"method": "foursight_update_weights", "args": [path, "7"]}``
  (vLLM mounts it only with ``VLLM_SERVER_DEV_MODE=1``; it passes string arguments only).

After an update, reset the prefix cache (``llm.reset_prefix_cache()`` / ``POST /reset_prefix_cache``)
so that no KV block computed with the old weights is reused.

What an update does (check it whole, load it, re-quantize) is :mod:`foursight.quant_methods.vllm_weight_update`
(:func:`~foursight.quant_methods.vllm_weight_update.run_update`, which every road runs); this module is how a
worker exposes it (:class:`FourSightWorkerExtension`), and the guards of vLLM's own weight RPCs on a FourSight
engine (:func:`install_worker_guards`: ``reload_weights`` checked whole first, ``reset_weights`` keeping the
layers' calibration, every weight-changing method giving the worker a new weights id).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from foursight.quant_methods.update_check import unchecked_load_weights
from foursight.quant_methods.vllm_weight_update import UpdateSession, run_update
from foursight.quant_methods.weight_broadcast import BroadcastWorkerMixin


#: one id per engine process: a restarted engine has a new one (see ``foursight_engine_state``)
BOOT_ID = uuid.uuid4().hex


class FourSightWorkerExtension(BroadcastWorkerMixin):
    """vLLM worker extension (``--worker-extension-cls``) with the FourSight weight-update RPCs (the broadcast
    road's ``foursight_broadcast_*`` come from :class:`~foursight.quant_methods.weight_broadcast.BroadcastWorkerMixin`)."""

    _broadcast_session = staticmethod(UpdateSession)

    def _foursight_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def foursight_update_weights(self, path: str, version: int | str, token: str | None = None, weights_id: str | None = None) -> dict:
        """Re-quantize the engine in place from BF16 tensors (HF names) in the safetensors file
        ``path`` (every tensor checked first, once:
        :func:`~foursight.quant_methods.vllm_weight_update.run_update`) and set the weight version to ``version`` (an int or its string, as the HTTP
        endpoint sends strings) and the weights id to ``weights_id`` (the bridge's nonce, reported by
        :meth:`foursight_engine_state`). An engine served over HTTP loads only with its
        ``FOURSIGHT_WEIGHTS_TOKEN`` (``token``) and only from its weights folders
        (:func:`foursight.quant_methods.weight_authority.authorize_update`). A refusal before anything
        loads starts with :data:`foursight.schema.REFUSED_PREFIX` (the bridge answers 422). Returns ``{"version",
        "updated_tensors", "requantized_layers", "seconds"}``."""
        from foursight.quant_methods.weight_authority import RefusedUpdate, authorize_update
        from foursight.schema import REFUSED_PREFIX
        from foursight.tensor_io import iter_safetensors

        t0 = time.perf_counter()
        v = int(version)
        path = authorize_update(path, token)  # before any file is opened: no token, or outside the folders, is refused
        # every tensor is read once and checked once (names, dtypes, shapes, finiteness) before any is loaded (what is
        # checked is what is loaded): a refused update leaves the previous weights serving and the version unchanged;
        # the bridge answers 422 to the refusal's prefix (nothing was loaded)
        info = run_update(self._foursight_model(), [iter_safetensors(path, check=False)],
                          refusal=lambda e: RefusedUpdate(f"{REFUSED_PREFIX}{e}"), where=f" in {path}")
        self._foursight_version = v
        self._foursight_weights_id = weights_id
        info.update(version=v, seconds=round(time.perf_counter() - t0, 3))
        return info

    def foursight_weight_version(self) -> int:
        """The version set by the last update (0 before any update)."""
        return int(getattr(self, "_foursight_version", 0))

    def foursight_engine_state(self) -> dict:
        """``{"boot_id", "version", "weights_id"}``: the id of this worker process (new after a restart),
        the version and weights id of its last update; the bridge compares them with what it pushed (docs/bridge.md)."""
        return {"boot_id": BOOT_ID, "version": self.foursight_weight_version(), "weights_id": getattr(self, "_foursight_weights_id", None)}


# ---- vLLM's own weight RPCs on a FourSight engine (issue 53 item 3)

#: vLLM worker methods that change the served weights outside a FourSight update (``sleep`` only at level >= 2,
#: which discards them; ``load_model`` after the engine's start). After one of them (done or failed half-way) the worker's weights id is new, so a bridge
#: sees weights it did not push and stops serving the engine until its next update; the engine core's weight
#: version changes too (what a bridge on the native route reads back from ``/weight_info``).
WEIGHT_CHANGING_RPCS = ("reset_weights", "reload_weights", "load_model", "update_weights", "finish_weight_update", "discard",
                        "checkpoint_restore", "sleep")
#: of those, the ones vLLM's native weight-transfer routes do not call through the engine core's ``collective_rpc``
CORE_WEIGHT_CHANGING_RPCS = ("reset_weights", "reload_weights", "discard", "checkpoint_restore", "sleep")


def changes_weights(method, args: tuple, kwargs: dict | None, methods: tuple[str, ...] = WEIGHT_CHANGING_RPCS) -> bool:
    """Whether worker method ``method`` called with ``args``/``kwargs`` changes the served weights."""
    if not isinstance(method, str) or method not in methods:
        return False
    if method == "sleep":
        level = (kwargs or {}).get("level", args[0] if args else 1)
        try:
            return int(level) >= 2
        except (TypeError, ValueError):
            return True
    return True


def check_reload(model: torch.nn.Module, model_config, weights_iterator=None, weights_path: str | None = None,
                 is_checkpoint_format: bool = True) -> list[tuple[str, torch.Tensor]] | None:
    """Check vLLM's ``reload_weights`` of a FourSight model whole, before vLLM puts any layer on the meta device:
    a refusal (:class:`~foursight.quant_methods.weight_authority.RefusedUpdate` naming the tensor or the path)
    leaves the engine serving as it was. vLLM's in-place reload re-creates every layer and loads the whole
    checkpoint again, so what it loads must be what the engine loaded at start: the same tensors (names,
    dtypes, shapes: ``model.foursight_checkpoint_tensors``, recorded by the load check), every one finite, from
    a complete folder with the same ``quantization_config``; a path outside the engine's weights folders is
    refused on a served engine, as an update is. Kernel-format reloads (``is_checkpoint_format=False``) copy
    into parameters a FourSight layer derives its state from and are refused. Returns the iterator's tensors
    as a list (read once, checked, then loaded), or None for a reload from a folder."""
    from foursight.quant_methods.weight_authority import RefusedUpdate, served_over_http, weights_dirs
    from foursight.schema import REFUSED_PREFIX, CheckpointError, check_finite, read_config
    from foursight.tensor_io import iter_safetensors

    def refuse(why: str) -> RefusedUpdate:
        return RefusedUpdate(f"{REFUSED_PREFIX}reload_weights: {why}")

    want = getattr(model, "foursight_checkpoint_tensors", None)
    if not is_checkpoint_format or str(is_checkpoint_format).lower() == "false":
        raise refuse("a FourSight model reloads checkpoint-format weights only (is_checkpoint_format=True)")
    if want is None:
        raise refuse("this engine recorded no checkpoint to compare a reload with")
    seen: set[str] = set()

    def compare(name: str, t: torch.Tensor, where: str) -> None:
        if name not in want:
            raise refuse(f"tensor {name}{where} is not one the engine loaded")
        if (t.dtype, tuple(t.shape)) != want[name]:
            raise refuse(f"tensor {name}{where} is {t.dtype} {list(t.shape)}; the engine loaded {want[name][0]} {list(want[name][1])}")
        check_finite(name, t, where)
        seen.add(name)

    kept = None
    try:
        if weights_iterator is not None:
            kept = list(weights_iterator)
            for name, t in kept:
                compare(name, t, "")
        else:
            folder = Path(weights_path or model_config.model)
            if weights_path is not None and served_over_http():
                p, roots = folder.resolve(), weights_dirs()
                if not any(p == r or p.is_relative_to(r) for r in roots):
                    raise refuse("weights_path is not inside this engine's weights folders")
            if not folder.is_dir():
                raise refuse("weights_path is not a checkpoint folder")
            served = getattr(model_config.hf_config, "quantization_config", None)
            if read_config(folder).get("quantization_config") != (served.to_dict() if hasattr(served, "to_dict") else served):
                raise refuse(f"{folder} has another quantization_config than the served checkpoint")
            for name, t in iter_safetensors(folder, check=False):  # refuses a folder a writer left incomplete
                compare(name, t, f" in {folder}")
    except CheckpointError as e:
        raise refuse(str(e)) from None
    missing = sorted(set(want) - seen)
    if missing:
        raise refuse(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                     + ": a reload re-creates every layer, so it needs every tensor the engine loaded")
    return kept


def kept_calibration(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The FourSight layers' calibration (each layer's BF16 channel set and static input scale: what a BF16 update
    re-quantizes with, and cannot give back), as ``{name: (parameter, copy)}``: vLLM's ``reset_weights`` zeroes
    every parameter, and the copies are put back after it, so that the next full update repairs the engine."""
    from foursight import schema

    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()
            if n.endswith((schema.BF16_CHANNELS, schema.INPUT_GLOBAL_SCALE))}


def install_worker_guards() -> None:
    """Wrap vLLM's worker (and engine core) so that its own weight RPCs cannot leave a FourSight engine half
    loaded or silently out of sync (issue 53): ``reload_weights`` of a FourSight model is checked whole first
    (:func:`check_reload`), and every method of :data:`WEIGHT_CHANGING_RPCS` gives the worker a new weights id
    (what ``foursight_engine_state`` reports; in the engine core, vLLM's weight version); ``reset_weights`` keeps
    the layers' calibration (:func:`kept_calibration`), so a full update repairs what it zeroed. Idempotent; installed
    by the plugin entry point (:func:`foursight.quant_methods.vllm_plugin.register`), never on import."""
    try:
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:  # another vLLM layout
        return
    from foursight.quant_methods.config import foursight_layers
    from foursight.quant_methods.engine_hooks import wrap_method

    def changed(worker, method: str) -> None:
        worker._foursight_weights_id = f"changed-by-{method}-{uuid.uuid4().hex[:8]}"

    for method in WEIGHT_CHANGING_RPCS:
        if not hasattr(Worker, method):
            continue

        def wrap(original, method=method):
            def run(self, *args, **kwargs):
                guarded = None  # a checked reload loads checkpoint tensors, which the sync guard of load_weights refuses
                calibration = {}
                if method == "reset_weights" and foursight_layers(self.get_model()):
                    calibration = kept_calibration(self.get_model())
                if method == "reload_weights":
                    model = self.get_model()
                    if foursight_layers(model):
                        keys = ("weights_iterator", "weights_path", "is_checkpoint_format")
                        given = {**dict(zip(keys, args)), **kwargs}
                        kept = check_reload(model, self.model_config, **given)
                        if kept is not None:
                            given["weights_iterator"] = kept
                        args, kwargs = (), given
                        guarded = model.__dict__.get("load_weights")
                        model.load_weights = unchecked_load_weights(model)
                first_load = method == "load_model" and not getattr(self, "_foursight_model_loaded", False)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    for t, saved in calibration.values():
                        t.data.copy_(saved)
                    if guarded is not None:
                        model.load_weights = guarded
                    if first_load:  # the engine's start: the checkpoint it serves, no change
                        self._foursight_model_loaded = True
                    elif changes_weights(method, args, kwargs):
                        changed(self, method)

            return run

        wrap_method(Worker, method, wrap)

    def wrap_core(original):
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            try:
                return original(self, method, timeout, args, kwargs)
            finally:
                if changes_weights(method, args, kwargs, CORE_WEIGHT_CHANGING_RPCS):
                    self._weight_version = f"changed-by-{method}"

        return collective_rpc

    wrap_method(EngineCore, "collective_rpc", wrap_core)
