"""SGLang plugin: makes ``--quantization foursight`` / ``Engine(quantization="foursight")`` work.

Registered in pyproject.toml as the entry point
``[project.entry-points."sglang.srt.plugins"] foursight = "foursight.quant_methods.sglang_plugin:register"``.
SGLang calls ``load_plugins()`` in the Engine, ``launch_server``, the scheduler, the
detokenizer and the DP controller, so every spawned process registers the method before it
resolves the quantization name; nothing has to be patched by the user.

SGLang has no registration decorator. ``QUANTIZATION_METHODS`` is a dict that
``configs/model_config.py`` imported by name, so it is mutated in place (never rebound); the
CLI's ``--quantization`` choices are extended through ``add_quantization_method_choices``; and
on x86 CPUs with AMX, where SGLang only accepts methods listed in ``CPU_QUANTIZATION_METHODS``,
the method is added there too (it runs the PyTorch reference on CPU).

``--quantization foursight`` also serves a compressed-tensors NVFP4 folder unconverted (k = 0):
the config's ``override_quantization_method`` takes it over and the weight iterator below adds
the empty k = 0 tensors (:func:`foursight.compressed_tensors_format.as_foursight_weights`).

Registering also makes SGLang's weight iterator check every tensor of a ``foursight`` model finite
(a NaN norm or an Inf embedding row stops the load with an error naming the tensor instead of
killing the engine at its first request) and, at load, compares the tensors with the model's
parameters; and it checks every weight update WHOLE before SGLang writes anything of it
(``update_weights_from_disk``, ``update_weights_from_tensor``, ``update_weights_from_distributed``:
names, dtypes, shapes, finite values), so a refused update answers ``success: false`` naming the
tensor and the served weights stay bit-identical (issue 28).

Side effects, and why they cannot be avoided: SGLang offers no hook before a load or an update, so
:func:`register` wraps two methods of its ``DefaultModelLoader`` and three of its ``WeightUpdater``
(each wrapper passes every model that is not ``foursight`` straight through). This happens only
when SGLang calls the entry point, never on ``import foursight`` or on importing this module.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("foursight.quant_methods.sglang")

NAME = "foursight"  # foursight.schema.QUANT_METHOD (not imported here: registration stays import-light)


def _install_load_check() -> None:
    """Wrap ``DefaultModelLoader._get_weights_iterator`` so that, for models whose quantization is
    ``foursight``, every tensor it yields is checked finite (:func:`foursight.schema.check_finite`
    raises ``CheckpointError`` naming it; a compressed-tensors folder is read as k = 0 FourSight),
    and ``_get_all_weights`` so that a whole load is compared with the model's parameters (a missing
    norm or a stray tensor is named: :func:`foursight.quant_methods.config.checked_complete`).
    Idempotent; other models are untouched."""
    try:
        from sglang.srt.model_loader.loader import DefaultModelLoader
    except ImportError:  # another SGLang layout: the FourSight layers' own checks still run
        return
    from foursight.quant_methods.engine_hooks import wrap_method

    def wrap_iterator(original):
        def _get_weights_iterator(self, source, *args, **kwargs):
            if getattr(getattr(source, "model_config", None), "quantization", None) != NAME:
                return original(self, source, *args, **kwargs)
            path = getattr(source, "model_or_path", "")
            qc = getattr(getattr(source.model_config, "hf_config", None), "quantization_config", None)
            # an update's folder was checked whole before this (_install_update_check); here a folder
            # a writer left incomplete or a truncated file is named before SGLang reads it, and every
            # tensor is checked finite as it passes (a checkpoint load stops at the first bad one)
            from foursight.quant_methods.config import check_folder, served_weights

            check_folder(path)

            return served_weights(original(self, source, *args, **kwargs), qc, f" in {path}")

        return _get_weights_iterator

    def wrap_all(original):
        def _get_all_weights(self, model_config, model):
            it = original(self, model_config, model)
            if getattr(model_config, "quantization", None) != NAME:
                return it
            from foursight.quant_methods.config import checked_complete

            return checked_complete(it, model, f" in {getattr(model_config, 'model_path', '')}")

        return _get_all_weights

    wrap_method(DefaultModelLoader, "_get_weights_iterator", wrap_iterator)
    wrap_method(DefaultModelLoader, "_get_all_weights", wrap_all)


def _serves_foursight(updater) -> bool:
    return getattr(getattr(updater, "model_config", None), "quantization", None) == NAME


def _refused(e: Exception) -> tuple[bool, str]:
    from foursight.schema import REFUSED_PREFIX

    return False, f"{REFUSED_PREFIX}{e}"


def check_folder_update(model, path: str, model_config) -> int:
    """Check a whole update folder against ``model`` before SGLang reads it: not left incomplete by
    a writer, every tensor read (finite, a truncated file named) and, as the served model reads it
    (a compressed-tensors folder as k = 0 FourSight), its names, dtypes and shapes
    (:func:`foursight.quant_methods.update_check.check_update`). Raises CheckpointError naming the
    tensor or the file; returns the number of tensors."""
    from foursight.quant_methods.config import served_weights
    from foursight.quant_methods.update_check import check_update
    from foursight.schema import check_complete
    from foursight.tensor_io import iter_safetensors

    check_complete(path)
    qc = getattr(getattr(model_config, "hf_config", None), "quantization_config", None)
    where = f" in {path}"
    return check_update(model, served_weights(iter_safetensors(path, check=False), qc, where), checkpoint_tensors=True, where=where)


def _install_update_check() -> None:
    """Wrap SGLang's weight-update entry points (``WeightUpdater.update_weights_from_disk``,
    ``update_weights_from_tensor``, ``load_weights_from_distributed``) so that, for a ``foursight``
    model, the WHOLE update is checked (names, dtypes, shapes, finite values, global-scale ranges:
    :func:`foursight.quant_methods.update_check.check_update`) before SGLang writes its first
    tensor: a refused update answers ``success: false`` naming the tensor and changes nothing
    (issue 28). SGLang's ``load_weights`` writes tensor by tensor, skips names it does not know and
    casts any dtype, so without this a bad tensor found late left the ones before it applied (and
    served under the next version), and an int32 or NaN tensor was applied. Idempotent; other
    models, and custom ``load_format`` loaders, are untouched."""
    try:
        from sglang.srt.model_executor.model_runner_components import weight_updater as wu
    except ImportError:  # another SGLang layout: the FourSight layers' own per-tensor checks still run
        return
    from foursight.quant_methods.engine_hooks import wrap_method
    from foursight.quant_methods.update_check import check_update
    from foursight.schema import CheckpointError

    def wrap_disk(original):
        def update_weights_from_disk(self, model_path, load_format, *args, **kwargs):
            if _serves_foursight(self) and os.path.isdir(model_path):
                try:
                    check_folder_update(self.get_model(), model_path, self.model_config)
                except CheckpointError as e:
                    return _refused(e)
            return original(self, model_path, load_format, *args, **kwargs)

        return update_weights_from_disk

    def _tensors(self, named_tensors, load_format):
        """The update's ``(name, tensor)`` pairs as SGLang would load them (its own unpacking)."""
        if load_format == "flattened_bucket":
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

            meta = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                            end_idx=m.end_idx, numel=m.numel) for m in named_tensors["metadata"]]
            return FlattenedTensorBucket(flattened_tensor=named_tensors["flattened_tensor"], metadata=meta).reconstruct_tensors()
        import torch
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # as SGLang does before it unpacks a serialized tensor
        device = torch.get_device_module(self.device).current_device()
        tp_rank = get_parallel().tp_rank
        return [(name, wu._unwrap_tensor(t, tp_rank=tp_rank, device=device)) for name, t in named_tensors]

    def wrap_tensor(original):
        def update_weights_from_tensor(self, named_tensors, load_format=None):
            if not _serves_foursight(self) or load_format not in (None, "flattened_bucket", "direct"):
                return original(self, named_tensors, load_format)
            items = list(_tensors(self, named_tensors, load_format))
            direct = load_format == "direct"  # engine parameter names, loaded as they are
            try:
                check_update(self.get_model(), items, map_name=(lambda n: n) if direct else None, checkpoint_tensors=True)
            except CheckpointError as e:
                return _refused(e)
            if direct:  # written into the parameters without their loaders: released codes come back first
                from foursight.quant_methods.config import foursight_layers
                from foursight.quant_methods.plan import restore_layer

                for m in foursight_layers(self.get_model()).values():
                    restore_layer(m)
            return original(self, items, "direct" if direct else None)

        return update_weights_from_tensor

    def wrap_distributed(original):
        def load_weights_from_distributed(self, named_tensors):
            if _serves_foursight(self):
                named_tensors = list(named_tensors)
                try:
                    check_update(self.get_model(), named_tensors, checkpoint_tensors=True)
                except CheckpointError as e:
                    return _refused(e)
            return original(self, named_tensors)

        return load_weights_from_distributed

    wrap_method(wu.WeightUpdater, "update_weights_from_disk", wrap_disk)
    wrap_method(wu.WeightUpdater, "update_weights_from_tensor", wrap_tensor)
    wrap_method(wu.WeightUpdater, "load_weights_from_distributed", wrap_distributed)


def register() -> None:
    """Register FourSight with SGLang (idempotent; a no-op when SGLang is not installed)."""
    try:
        from sglang.srt.layers import quantization as q
    except ImportError:  # SGLang absent: nothing to register with
        logger.debug("sglang not importable; FourSight SGLang plugin not registered")
        return
    _install_load_check()
    _install_update_check()
    from foursight.quant_methods.sglang_method import FourSightSGLangConfig

    q.QUANTIZATION_METHODS[NAME] = FourSightSGLangConfig
    q.BASE_QUANTIZATION_METHODS[NAME] = FourSightSGLangConfig
    cpu = getattr(q, "CPU_QUANTIZATION_METHODS", None)
    if isinstance(cpu, dict):
        cpu[NAME] = FourSightSGLangConfig
    try:
        from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    except ImportError:  # older layouts keep the choices in server_args
        from sglang.srt.server_args import QUANTIZATION_CHOICES, add_quantization_method_choices  # type: ignore
    if NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([NAME])
