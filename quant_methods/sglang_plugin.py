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
"""

from __future__ import annotations

import logging

logger = logging.getLogger("foursight.quant_methods.sglang")

NAME = "foursight"


def register() -> None:
    """Register FourSight with SGLang (idempotent; a no-op when SGLang is not installed)."""
    try:
        from sglang.srt.layers import quantization as q
    except ImportError:  # SGLang absent: nothing to register with
        logger.debug("sglang not importable; FourSight SGLang plugin not registered")
        return
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
