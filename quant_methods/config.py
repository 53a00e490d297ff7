"""The engine-neutral part of the FourSight quantization config, shared by the vLLM and SGLang adapters.

:class:`FourSightMethodConfig` is mixed into each engine's ``QuantizationConfig`` subclass
(``FourSightVllmConfig(FourSightMethodConfig, vllm QuantizationConfig)``, likewise for SGLang), so
both engines take the same decisions by construction:

* the two load modes (a FourSight checkpoint, or a BF16 model quantized at load with the online
  settings);
* the method name, the activation dtypes, the minimum CUDA capability and the config files;
* the ignore-list rule for a (possibly fused) layer, with one error wording;
* the :class:`~foursight.quant_methods.plan.LayerPlan` of each layer (:meth:`FourSightMethodConfig.plan_for`).

:class:`FourSightLinearMethodBase` likewise holds the linear method's hooks (``create_weights``,
``process_weights_after_loading``, ``apply``); an engine supplies its TP collectives and its
``set_weight_attrs``.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch

from foursight.compressed_tensors_format import CT_METHOD  # the compressed-tensors checkpoints --quantization foursight also serves
from foursight.quant_methods.layer_layout import WEIGHT
from foursight.quant_methods.online import OnlineSettings
from foursight.quant_methods.plan import LayerPlan, apply_linear, layer_params, refresh_layer
from foursight.quant_methods.sharding import TPContext, shard_names
from foursight.schema import QUANT_METHOD, CheckpointError, FourSightConfig

#: The Triton SpliceGEMM kernels emulate FP4 on BF16 tensor cores: Ampere (8.0) or newer.
#: (On CPU the PyTorch reference runs; the engines check the capability only on CUDA.)
MIN_CAPABILITY = 80

#: The fused-module map of Llama/Qwen-style models, used when an engine gives none.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


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


#: tensors engines skip by name without a parameter for them (rotary tables some checkpoints carry)
ENGINE_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def packed_name_map(model: torch.nn.Module, packed: dict[str, list[str]] | None = None):
    """Checkpoint name -> engine parameter name through the fused-layer map (``packed`` or the
    model's ``packed_modules_mapping``): ``...self_attn.q_proj.weight`` -> ``...self_attn.qkv_proj.weight``."""
    packed = packed or dict(getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED_MODULES)
    shard_to_fused = {shard: fused for fused, shards in packed.items() for shard in shards}
    return lambda name: ".".join(shard_to_fused.get(p, p) for p in name.split("."))


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
    params = {n for n, p in model.named_parameters() if p.numel() > 0}
    allowed = {n for n, _ in model.named_parameters()}
    cfg = getattr(model, "config", None)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
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

    def plan_for(self, prefix: str, output_partition_sizes: list[int], input_size: int, input_size_per_partition: int,
                 tp_rank: int = 0, tp_size: int = 1) -> LayerPlan:
        """The plan of engine layer ``prefix`` (called from the engine's ``create_weights``)."""
        return LayerPlan.for_layer(prefix, output_partition_sizes, input_size, input_size_per_partition, self.fs_config,
                                   self.packed_mapping(), tp_rank=tp_rank, tp_size=tp_size, mode=self.mode, online=self.online)


def foursight_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Engine module name -> module, for every layer with a FourSight plan (the layers
    :meth:`FourSightLinearMethodBase.create_weights` made, in vLLM and SGLang alike)."""
    return {n: m for n, m in model.named_modules() if getattr(m, "foursight_plan", None) is not None}


class FourSightLinearMethodBase:
    """The engine-neutral linear method, mixed into each engine's ``LinearMethodBase`` subclass.

    The engine subclass provides :meth:`tp_context` (its TP group as a
    :class:`~foursight.quant_methods.sharding.TPContext`) and :meth:`set_attrs` (its
    ``set_weight_attrs``); it may wrap the loaders (:meth:`wrap_loader`).
    """

    def __init__(self, quant_config: FourSightMethodConfig, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def tp_context(self, layer: torch.nn.Module) -> TPContext:
        raise NotImplementedError

    def set_attrs(self, param: torch.nn.Parameter, attrs: dict[str, Any]) -> None:
        raise NotImplementedError

    def wrap_loader(self, layer: torch.nn.Module, loader: Callable) -> Callable:
        return loader

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        """Register the plan's parameters with the plan's loaders around the engine's own."""
        tp = self.tp_context(layer)
        plan = self.quant_config.plan_for(self.prefix, output_partition_sizes, input_size, input_size_per_partition,
                                          tp_rank=tp.rank, tp_size=tp.size)
        engine_loader = extra_weight_attrs.pop("weight_loader", None)
        for spec in plan.param_specs(params_dtype):
            p = torch.nn.Parameter(plan.initial_tensor(spec), requires_grad=False)
            core = plan.make_loader(spec, engine_loader, lambda: layer_params(layer, plan))
            self.set_attrs(p, {**spec.attrs, **extra_weight_attrs, "weight_loader": self.wrap_loader(layer, self._syncing_loader(layer, spec.name, core))})
            layer.register_parameter(spec.name, p)
        layer.foursight_plan = plan
        layer.foursight_state = None

    def _syncing_loader(self, layer: torch.nn.Module, name: str, loader: Callable) -> Callable:
        """A BF16 ``weight`` load that completes every shard of an already-served layer re-quantizes
        it at once, in place (:func:`~foursight.quant_methods.plan.refresh_layer`): TRL's
        one-tensor-at-a-time ``load_weights`` sync has no post-load step (docs/weight-sync.md)."""
        if name != WEIGHT:
            return loader

        def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any, **kw: Any) -> None:
            loader(param, loaded_weight, *args, **kw)
            plan: LayerPlan = layer.foursight_plan
            if layer.foursight_state is not None and plan.weight_complete():
                refresh_layer(layer, self.tp_context(layer))

        return weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate and build the execution state from the loaded parameters, when the layer has
        none yet or a tensor was loaded since the last build (idempotent; the parameters are never
        modified, so a second call or a call after a weight reload is safe)."""
        plan: LayerPlan = layer.foursight_plan
        if layer.foursight_state is None or plan.stale:
            refresh_layer(layer, self.tp_context(layer))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.foursight_plan.stale:  # part of a fused layer was synced and no post-load step ran
            refresh_layer(layer, self.tp_context(layer))
        return apply_linear(layer.foursight_state, x, bias)
