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
the empty k = 0 tensors (:func:`foursight.interop.as_foursight_weights`).

Registering also makes SGLang's weight iterator check every tensor of a ``foursight`` model finite
(checkpoint load and ``update_weights_from_disk``), so a NaN norm or an Inf embedding row stops the
load with an error naming the tensor instead of killing the engine at its first request; a local
folder is checked whole before any weight is written, so a refused update leaves the served
weights in place.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("foursight.quant_methods.sglang")

NAME = "foursight"  # foursight.schema.QUANT_METHOD (not imported here: registration stays import-light)


def _install_load_check() -> None:
    """Wrap ``DefaultModelLoader._get_weights_iterator`` so that, for models whose quantization is
    ``foursight``, every tensor it yields is checked finite (:func:`foursight.schema.check_finite`
    raises ``CheckpointError`` naming it). Idempotent; other models are untouched."""
    try:
        from sglang.srt.model_loader.loader import DefaultModelLoader
    except ImportError:  # another SGLang layout: the FourSight layers' own checks still run
        return
    original = DefaultModelLoader._get_weights_iterator
    if getattr(original, "_foursight_checked", False):
        return

    def _get_weights_iterator(self, source, *args, **kwargs):
        if getattr(getattr(source, "model_config", None), "quantization", None) != NAME:
            return original(self, source, *args, **kwargs)
        path = getattr(source, "model_or_path", "")
        qc = getattr(getattr(source.model_config, "hf_config", None), "quantization_config", None)
        if os.path.isdir(path):
            # read and check every safetensors tensor *now*, when SGLang asks for the iterator and
            # before any weight is written: an update then fails with "Failed to get weights
            # iterator" and the served weights stay (SGLang's own rollback after a failure inside
            # the iterator would re-read the new, bad path)
            from foursight.schema import check_safetensors

            check_safetensors(path)
        from foursight.quant_methods.config import served_weights

        return served_weights(original(self, source, *args, **kwargs), qc, f" in {path}")

    _get_weights_iterator._foursight_checked = True  # type: ignore[attr-defined]
    DefaultModelLoader._get_weights_iterator = _get_weights_iterator

    # the whole load (not an update) is compared with the model's parameters: a missing norm or a
    # stray tensor is named (foursight.quant_methods.config.checked_complete)
    original_all = DefaultModelLoader._get_all_weights

    def _get_all_weights(self, model_config, model):
        it = original_all(self, model_config, model)
        if getattr(model_config, "quantization", None) != NAME:
            return it
        from foursight.quant_methods.config import checked_complete

        return checked_complete(it, model, f" in {getattr(model_config, 'model_path', '')}")

    DefaultModelLoader._get_all_weights = _get_all_weights


def register() -> None:
    """Register FourSight with SGLang (idempotent; a no-op when SGLang is not installed)."""
    try:
        from sglang.srt.layers import quantization as q
    except ImportError:  # SGLang absent: nothing to register with
        logger.debug("sglang not importable; FourSight SGLang plugin not registered")
        return
    _install_load_check()
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
