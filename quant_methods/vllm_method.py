"""vLLM glue for FourSight: the ``foursight`` QuantizationConfig and its LinearMethodBase.

Everything numeric and every check lives in :mod:`foursight.quant_methods.core` (shared with
SGLang) and :mod:`foursight.layer` / :mod:`foursight.schema`; this module only maps vLLM's
hooks onto them:

* ``create_weights``  → register the parameters of ``LayerPlan.param_specs`` with the core's
  loaders wrapped around vLLM's own (column / row / QKV / merged) weight loaders;
* ``process_weights_after_loading`` → ``LayerPlan.process`` (idempotent: the loaded parameters are
  never modified, the execution state is rebuilt from them);
* ``apply`` → ``core.apply_linear`` (SpliceGEMM on CUDA, the PyTorch reference on CPU).

Two ways in:

* a FourSight checkpoint: ``config.json["quantization_config"]["quant_method"] == "foursight"``
  (``from_config``), with or without ``--quantization foursight``;
* a BF16 checkpoint with ``--quantization foursight``: vLLM finds no config file for this
  method (``get_config_filenames`` is empty) and calls ``FourSightVllmConfig()``, which reads
  the online settings from ``FOURSIGHT_*`` environment variables (channels file, budget,
  activation mode). ``--hf-overrides '{"quantization_config_file": "foursight_channels.json"}'``
  passes the channels file as a vLLM option instead (``from_config_file``).

Register through the plugin entry point (:mod:`foursight.quant_methods.vllm_plugin`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from foursight.quant_methods.core import (
    LayerPlan,
    OnlineSettings,
    TPContext,
    apply_linear,
    layer_params,
    shard_names,
)
from foursight.schema import QUANT_METHOD, CheckpointError, FourSightConfig


def _tp_context(layer: torch.nn.Module) -> TPContext:
    """The layer's TP position and vLLM's TP-group collectives (only used when size > 1)."""
    rank, size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
    if size == 1:
        return TPContext(rank, size)
    from vllm.distributed import get_tp_group

    group = get_tp_group()

    def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group.device_group)
        return out

    def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
        return group.all_gather(t.contiguous(), dim=0)

    return TPContext(rank, size, all_reduce_max, all_gather_cat)


@register_quantization_config(QUANT_METHOD)
class FourSightVllmConfig(QuantizationConfig):
    """vLLM config of method ``foursight`` (checkpoint or online mode).

    Args:
        config: the checkpoint's validated :class:`FourSightConfig`; None for online mode.
        online: online settings (BF16 weights quantized at load); built from the environment
            when ``config`` is None and this is None.
    """

    def __init__(self, config: FourSightConfig | None = None, online: OnlineSettings | None = None):
        super().__init__()
        if config is None:
            self.online = online or OnlineSettings.from_env()
            self.fs_config = self.online.as_config()
            self.mode = "online"
        else:
            self.online = None
            self.fs_config = config
            self.mode = "checkpoint"

    def __repr__(self) -> str:
        return f"FourSightVllmConfig(mode={self.mode}, activation={self.fs_config.activation_dtype}/{self.fs_config.activation_scale}, ignore={self.fs_config.ignore})"

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # The Triton SpliceGEMM path emulates FP4 and needs bf16 tensor cores (Ampere+).
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Empty: a BF16 model with --quantization foursight gets FourSightVllmConfig() (online mode).
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FourSightVllmConfig":
        """From ``config.json["quantization_config"]``; raises CheckpointError naming a bad field."""
        return cls(FourSightConfig.parse(dict(config)))

    @classmethod
    def from_config_file(cls, path: str) -> "FourSightVllmConfig":
        """Online mode with a channels file, via ``--hf-overrides '{"quantization_config_file": PATH}'``."""
        return cls(None, OnlineSettings.from_env(channels_file=path))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings and lm_head (ParallelLMHead) stay unquantized
        names = shard_names(prefix, self.packed_modules_mapping)
        ignored = [self.fs_config.is_ignored(n) or self.fs_config.is_ignored(prefix) for n in names]
        if all(ignored):
            return UnquantizedLinearMethod()
        if any(ignored):
            raise CheckpointError(f"{prefix}: some fused shards are in ignore and some are not ({dict(zip(names, ignored))}); ignore all or none")
        return FourSightLinearMethod(self, prefix)


class FourSightLinearMethod(LinearMethodBase):
    """The compensated linear layer in vLLM (see the module docstring)."""

    def __init__(self, quant_config: FourSightVllmConfig, prefix: str):
        self.quant_config = quant_config
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        qc = self.quant_config
        plan = LayerPlan.for_layer(
            self.prefix,
            output_partition_sizes,
            input_size,
            input_size_per_partition,
            qc.fs_config,
            qc.packed_modules_mapping,
            tp_rank=int(getattr(layer, "tp_rank", 0)),
            tp_size=int(getattr(layer, "tp_size", 1)),
            mode=qc.mode,
            online=qc.online,
        )
        engine_loader = extra_weight_attrs.pop("weight_loader", None)
        for spec in plan.param_specs(params_dtype):
            p = Parameter(torch.full(spec.shape, plan.init_value(spec), dtype=torch.float32).to(spec.dtype) if spec.dtype != torch.float8_e4m3fn else torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
            set_weight_attrs(p, spec.attrs)
            set_weight_attrs(p, extra_weight_attrs)
            set_weight_attrs(p, {"weight_loader": plan.make_loader(spec, engine_loader)})
            layer.register_parameter(spec.name, p)
        layer.foursight_plan = plan
        layer.foursight_state = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate and build the execution state. Idempotent; called again after weight updates."""
        plan: LayerPlan = layer.foursight_plan
        layer.foursight_state = plan.process(layer_params(layer, plan), _tp_context(layer))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return apply_linear(layer.foursight_state, x, bias)


__all__ = ["FourSightVllmConfig", "FourSightLinearMethod"]
