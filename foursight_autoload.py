"""Registers FourSight's transformers quantizer (:mod:`foursight.hf_quantizer`) without importing
transformers, from ``import foursight`` and from torch's extension autoloading.

A top-level module of the ``foursight`` distribution, outside the ``foursight`` package and
standard library only, so that the ``torch.backends`` entry point (pyproject.toml; torch loads it
at the end of every ``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``) costs nothing and
cannot run into a half-imported transformers:

* ``transformers.quantizers.auto`` fully imported: register at once;
* not imported yet: a ``sys.meta_path`` finder wraps its loader and registers right after it runs;
* being imported right now (it imports torch, which runs the entry point): the finder registers at
  the next import once it has finished (``from_pretrained`` imports the model class first), and a
  later ``import foursight`` registers too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "transformers.quantizers.auto"


def _loaded() -> bool:
    mod = sys.modules.get(TARGET)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def _register() -> None:
    """Register; a failure warns instead of breaking the import of transformers that triggered it."""
    try:
        from foursight.hf_quantizer import register

        register()
    except Exception as e:  # noqa: BLE001 - this runs inside someone else's import
        import warnings

        warnings.warn(f"foursight: the transformers quantizer was not registered ({type(e).__name__}: {e})", RuntimeWarning, stacklevel=2)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    foursight = True

    def _remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path, target=None):
        if name == TARGET and TARGET not in sys.modules:
            self._remove()
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec
        if _loaded():  # it finished importing while this finder waited
            self._remove()
            _register()
        return None


def install() -> None:
    """Register now, or arrange to register when ``transformers.quantizers.auto`` has been imported (idempotent).

    The ``sys.meta_path`` finder is the one side effect, and only where it has work to do: not when
    transformers is not installed, never twice, and it removes itself once the module has loaded.
    It cannot be avoided: transformers has no plugin entry point for quantizers, and importing it
    here would cost every ``import torch`` the import of transformers (docs/ecosystem.md).
    """
    if _loaded():
        _register()
    elif not any(getattr(f, "foursight", False) for f in sys.meta_path) and _transformers_installed():
        sys.meta_path.insert(0, _Finder())


def _transformers_installed() -> bool:
    """Whether a ``transformers`` package can be found (its spec only: nothing is imported)."""
    if "transformers" in sys.modules:
        return True
    try:
        return importlib.machinery.PathFinder.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def torch_autoload() -> None:
    """The ``torch.backends`` entry point. Never raises: torch turns an error here into a failed ``import torch``."""
    try:
        install()
    except Exception as e:  # noqa: BLE001 - see the docstring
        import warnings

        warnings.warn(f"foursight: the transformers quantizer was not registered ({type(e).__name__}: {e}); "
                      "`import foursight` before from_pretrained", RuntimeWarning, stacklevel=2)
