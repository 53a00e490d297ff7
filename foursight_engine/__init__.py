"""FourSight: NVFP4 (W4A4) rollouts with sparse BF16 channel compensation and TIM-aware filtering.

Modules, by subject (docs/architecture.md has the layers and the data flows; tests/test_package_index.py keeps
this list whole):

numerics and the layer
    nvfp4          NVFP4 numerics (quantize, dequantize, pack) bit-compatible with compressed-tensors
    nvfp4_cpu      the weight sync's NVFP4 quantizer and dequantizer in native code on the CPU (bit-identical)
    fp8            FP8 rowwise W8A8 numerics (the FlashRL rollout anchor)
    layer          the compensated linear layer and its PyTorch reference forward (the oracle)
    dispatch       which backend (PyTorch reference, Triton kernels) runs a layer, chosen once
    kernels        (package) the Triton kernels of the layer
the format
    schema         tensor names, config schema, the codec, the marker, the names bridge and engines share
    tensor_io      the one safetensors reader and the one writer; the checkpoint reader
    channels_file  the channels file ``foursight_channels.json`` (format, reader, writer)
    compressed_tensors_format  compressed-tensors NVFP4 checkpoints read as FourSight k = 0 ones
making checkpoints
    calibration    calibration texts (the built-in ones too) and per-channel activation statistics
    channels       channel selection: which input channels stay BF16 (k and S)
    bf16_layers    whole layers kept in BF16 (``--bf16-layers``) and the BF16 byte share
    checkpoint     writing FourSight checkpoints (``quantize``); ``calibrate`` (a channels file only)
    interop        ``foursight export`` / ``import``: to and from compressed-tensors NVFP4
    folder_writer  the one folder writer (temporary folder, incomplete-run marker, ``--force`` rule)
    models         the packaged SmolLM2 model and tiny random test models
    cache          where FourSight keeps what it builds once per machine (``$FOURSIGHT_CACHE``)
running them
    hf             FourSight layers inside Hugging Face models (the reference model)
    hf_quantizer   the transformers quantizer: ``from_pretrained`` on a FourSight checkpoint
    quant_methods  (package) ``--quantization foursight`` in vLLM and SGLang
    serve          ``foursight serve``: vLLM's OpenAI server with FourSight
    precisions     the rollout precisions (bf16, fp8, nvfp4, foursight, w4a16): one vocabulary
    trainer_bridge (package) ``foursight bridge serve``: rollouts with per-token logprobs for a learner
the command line
    cli            the ``foursight`` command; cli_util (shared options, error style), cli_config (flags from a
                   config dataclass), quantize_config (``foursight quantize``'s options)
    compare, rl    (packages) the ``foursight compare`` and ``foursight rl`` applications
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
