"""The engine-neutral part of the FourSight quantization config, shared by the vLLM and SGLang adapters.

:class:`FourSightMethodConfig` is mixed into each engine's ``QuantizationConfig`` subclass
(``FourSightVllmConfig(FourSightMethodConfig, vllm QuantizationConfig)``, likewise for SGLang), so
both engines take the same decisions by construction:

* the two load modes (a FourSight checkpoint, or a BF16 model quantized at load with the online
  settings);
* the method name, the activation dtypes, the minimum CUDA capability and the config files;
* the ignore-list rule for a (possibly fused) layer, with one error wording.

Also here: what an engine checks of a checkpoint it loads (:func:`check_folder`, :func:`served_weights`,
:func:`checked_complete`) and the model's FourSight layers (:func:`foursight_layers`). The linear
method the engines share is :class:`foursight.quant_methods.plan.FourSightLinearMethodBase`, next to
the per-layer plan its hooks drive.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch

from foursight.compressed_tensors_format import CT_METHOD  # the compressed-tensors checkpoints --quantization foursight also serves
from foursight.quant_methods.online import OnlineSettings
from foursight.quant_methods.param_names import DEFAULT_PACKED_MODULES, ENGINE_SKIPPED, packed_name_map
from foursight.quant_methods.sharding import shard_names
from foursight.schema import QUANT_METHOD, CheckpointError, FourSightConfig

#: The Triton SpliceGEMM kernels emulate FP4 on BF16 tensor cores: Ampere (8.0) or newer.
#: (On CPU the PyTorch reference runs; the engines check the capability only on CUDA.)
MIN_CAPABILITY = 80


def parse_quantization_config(config: dict[str, Any]) -> FourSightConfig:
    """The :class:`FourSightConfig` of a checkpoint's ``quantization_config``.

    A FourSight one goes through the strict schema. A compressed-tensors NVFP4 one (the format
    llm-compressor writes) is read as the plain-NVFP4 (k = 0) FourSight checkpoint it is, so
    ``--quantization foursight`` serves it with FourSight's kernels without a conversion
    (:func:`foursight.compressed_tensors_format.foursight_config_from_ct`; the engine's weight iterator adds the empty
    k = 0 tensors, :func:`foursight.compressed_tensors_format.as_foursight_weights`). Raises CheckpointError naming the field.
    """
    if config.get("quant_method") == CT_METHOD:
        from foursight.compressed_tensors_format import foursight_config_from_ct

        return foursight_config_from_ct(config)
    return FourSightConfig.parse(dict(config))


def serves_user_choice(hf_quant_cfg: dict[str, Any], user_quant: str | None) -> bool:
    """Whether ``--quantization foursight`` takes over a checkpoint of another ``quant_method``:
    only a compressed-tensors one (then validated by :func:`parse_quantization_config`)."""
    return user_quant == QUANT_METHOD and isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == CT_METHOD


def check_folder(path: Any) -> None:
    """Before an engine reads a checkpoint folder: refuse one a writer left incomplete
    (:func:`foursight.schema.check_complete`, naming the marker) and name a truncated or unreadable
    safetensors file (headers only: :func:`foursight.tensor_io.check_headers`). A Hub id or a file is
    left to the engine."""
    import os

    from foursight.schema import check_complete
    from foursight.tensor_io import check_headers

    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        check_complete(path)
        check_headers(path)


def checked_complete(weights, model: torch.nn.Module, where: str = "", packed: dict[str, list[str]] | None = None):
    """``(name, tensor)`` pairs of ``weights`` passed on unchanged, compared with what ``model`` needs.

    Each checkpoint name is mapped to the engine's parameter name (a fused layer's shards,
    ``q_proj`` -> ``qkv_proj``, by ``packed`` or the model's ``packed_modules_mapping``); a name
    outside the model's parameters raises :class:`CheckpointError` ("unexpected tensor") at once,
    and when the stream ends every parameter that holds data and was not named (a norm, an
    embedding, an unquantized layer; tied weights are one parameter and need one tensor) raises
    "missing tensor", naming it. A fused layer's missing shard is the FourSight layer's own check.
    """
    map_name = packed_name_map(model, packed)
    cfg = getattr(model, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    params = {n for n, p in model.named_parameters() if p.numel() > 0}
    if tied:  # vLLM's in-place reload restores lm_head as a parameter of its own (issue 53); the checkpoint has none
        params.discard("lm_head.weight")
    allowed = {n for n, _ in model.named_parameters()}
    seen: set[str] = set()
    for name, t in weights:
        mapped = map_name(name)
        if mapped not in allowed and not name.endswith(ENGINE_SKIPPED) and not (tied and name == "lm_head.weight"):
            raise CheckpointError(f"unexpected tensor {name}{where}: the model has no parameter for it")
        seen.add(mapped)
        yield name, t
    missing = sorted(params - seen)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]}{where}" + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
                              + ": the model needs it and the checkpoint does not hold it")


def served_weights(weights, hf_quant_cfg: Any, where: str = "", model: torch.nn.Module | None = None):
    """The ``(name, tensor)`` stream an engine adapter loads for a ``foursight`` model: every tensor
    checked finite (:func:`foursight.schema.checked_finite`), a compressed-tensors NVFP4
    folder's tensors read as the k = 0 FourSight checkpoint they are
    (:func:`foursight.compressed_tensors_format.as_foursight_weights`), and with ``model`` the names compared with
    the model's parameters (:func:`checked_complete`). The vLLM and SGLang loaders both wrap this."""
    from foursight.schema import checked_finite

    if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == CT_METHOD:
        from foursight.compressed_tensors_format import as_foursight_weights

        weights = as_foursight_weights(weights, parse_quantization_config(hf_quant_cfg).activation_dtype)
    weights = checked_finite(weights, where)
    return weights if model is None else checked_complete(weights, model, where)


class FourSightMethodConfig:
    """What both engine configs share (see the module docstring).

    The engine subclass calls :meth:`_init_foursight` from its ``__init__`` after the engine base
    class's own ``__init__``; ``config`` None means online mode.
    """

    mode: Literal["checkpoint", "online"]
    online: OnlineSettings | None
    fs_config: FourSightConfig
    packed_modules_mapping: dict[str, list[str]]

    def _init_foursight(self, config: FourSightConfig | None, online: OnlineSettings | None,
                        default_online: Callable[[], OnlineSettings] = OnlineSettings.from_env) -> None:
        if config is None:
            self.mode = "online"
            self.online = online or default_online()
            self.fs_config = self.online.as_config()
        else:
            self.mode = "checkpoint"
            self.online = None
            self.fs_config = config

    def __repr__(self) -> str:
        c = self.fs_config
        return f"{type(self).__name__}(mode={self.mode}, activation={c.activation_dtype}/{c.activation_scale}, ignore={c.ignore})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Checkpoints carry their config in config.json; an empty list makes the engine call
        # ``cls()`` for a BF16 model with --quantization foursight: online mode.
        return []

    def packed_mapping(self) -> dict[str, list[str]]:
        """The engine's fused-module map, or the Llama/Qwen one when it gives none."""
        return dict(getattr(self, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES)

    def quantizes(self, prefix: str) -> bool:
        """Whether the engine linear layer ``prefix`` is a FourSight layer.

        A shard is ignored when its checkpoint name or the fused layer's name matches
        ``ignore``; a fused layer whose shards disagree is refused.
        """
        names = shard_names(prefix, self.packed_mapping())
        ignored = {n: self.fs_config.is_ignored(n) or self.fs_config.is_ignored(prefix) for n in names}
        if all(ignored.values()):
            return False
        if any(ignored.values()):
            raise CheckpointError(f"{prefix}: some fused shards are in ignore and some are not ({ignored}); ignore all or none")
        return True


def foursight_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Engine module name -> module, for every layer with a FourSight plan (the layers
    :meth:`foursight.quant_methods.plan.FourSightLinearMethodBase.create_weights` made, in vLLM and SGLang alike)."""
    return {n: m for n, m in model.named_modules() if getattr(m, "foursight_plan", None) is not None}
