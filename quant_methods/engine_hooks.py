"""How FourSight wraps an engine's method, the one way (idempotent, marked, never at import).

vLLM and SGLang give a quantization method no hook before a checkpoint load or a weight update, so
the checks FourSight promises there (every tensor finite, a checkpoint compared with the model, a
weight update checked whole before anything of it is written: docs/reliability.md) wrap a few of
their methods. Each wrapper passes every model that is not ``foursight`` straight through. They are
installed only by the engines' plugin entry points (:func:`foursight.quant_methods.vllm_plugin.register`,
:func:`foursight.quant_methods.sglang_plugin.register`), which the engine itself calls in each of its
processes; ``import foursight`` and importing any module of this package wraps nothing
(tests/test_import_side_effects.py).
"""

from __future__ import annotations

from typing import Any, Callable

#: the attribute that marks a FourSight wrapper (a second install leaves the method as it is)
MARK = "_foursight_wrapped"


def wrap_method(cls: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``cls.<name>`` by ``wrap(original)``, once: a method already wrapped is left alone."""
    original = getattr(cls, name)
    if is_wrapped(cls, name):
        return
    new = wrap(original)
    setattr(new, MARK, True)
    setattr(cls, name, new)


def is_wrapped(cls: Any, name: str) -> bool:
    """Whether ``cls.<name>`` is a FourSight wrapper."""
    return bool(getattr(getattr(cls, name, None), MARK, False))
