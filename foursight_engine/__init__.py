"""FourSight: NVFP4 (W4A4) rollouts with sparse BF16 channel compensation and TIM-aware filtering.

Sub-modules:
    nvfp4       NVFP4 numerics (quantize, dequantize, pack) bit-compatible with compressed-tensors
    layer       the compensated linear layer and its PyTorch reference forward
    schema      checkpoint tensor names, config schema and validation (the single source of truth)
    calibration per-channel activation statistics and channel selection
    checkpoint  writing and reading FourSight checkpoints
    models      the packaged SmolLM2 model and tiny random test models
    cli         the ``foursight`` command
"""

__version__ = "0.1.0"
