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
    else right after it loads (:mod:`foursight_autoload`, which torch's ``torch.backends`` entry
    point also runs at every ``import torch``)."""
    import foursight_autoload

    foursight_autoload.install()


_transformers_hook()
