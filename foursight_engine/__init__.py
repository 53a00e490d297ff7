"""FourSight: NVFP4 (W4A4) rollouts with sparse BF16 channel compensation and TIM-aware filtering.

Sub-modules (docs/architecture.md has the layers and the data flows):
    nvfp4          NVFP4 numerics (quantize, dequantize, pack) bit-compatible with compressed-tensors
    layer          the compensated linear layer and its PyTorch reference forward (the oracle)
    schema         the format: tensor names, config schema, the codec, the channels file
    dispatch       which backend (PyTorch reference, Triton kernels) runs a layer, chosen once
    calibration    per-channel activation statistics and channel selection
    checkpoint     writing and reading FourSight checkpoints
    channels_file  ``foursight calibrate``: a channels file without quantizing
    hf             FourSight layers inside Hugging Face models (the reference model)
    hf_quantizer   the transformers quantizer: ``from_pretrained`` on a FourSight checkpoint
    models         the packaged SmolLM2 model and tiny random test models
    cli, cli_util  the ``foursight`` command
    compare, rl    the ``foursight compare`` and ``foursight rl`` applications
"""

__version__ = "0.1.0"


def _transformers_hook() -> None:
    """Register the FourSight quantizer with transformers (:mod:`foursight.hf_quantizer`) without
    importing transformers here: at once when ``transformers.quantizers.auto`` is already loaded,
    else right after it loads (a ``sys.meta_path`` finder that wraps its loader)."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys

    target = "transformers.quantizers.auto"

    def register() -> None:
        from foursight.hf_quantizer import register as _register

        _register()

    if target in sys.modules:
        register()
        return

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            register()

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target_=None):
            if name != target:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec

    if not any(type(f).__name__ == "_Finder" and getattr(f, "foursight", False) for f in sys.meta_path):
        finder = _Finder()
        finder.foursight = True
        sys.meta_path.insert(0, finder)


_transformers_hook()
