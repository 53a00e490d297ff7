"""vLLM glue for FourSight: the ``foursight`` QuantizationConfig and its LinearMethodBase.

Everything numeric and every check lives in :mod:`foursight.quant_methods.plan` (with
:mod:`~foursight.quant_methods.layer_layout`, :mod:`~foursight.quant_methods.param_kinds`,
:mod:`~foursight.quant_methods.layer_loading` and :mod:`~foursight.quant_methods.layer_state`) and
:mod:`foursight.quant_methods.config` (shared with SGLang) and :mod:`foursight.schema`; this
module only maps vLLM's hooks onto them:

* ``create_weights``  → register the parameters of ``LayerPlan.param_specs`` with the core's
  loaders wrapped around vLLM's own (column / row / QKV / merged) weight loaders;
* ``process_weights_after_loading`` → ``LayerPlan.process`` (idempotent: the execution state is rebuilt
  from the loaded parameters, whose values never change; where the execution form gives them back
  exactly their codes are then released, and rebuilt before the next write: ``CheckpointPlan.release``);
* ``apply`` → ``layer_state.apply_linear`` (SpliceGEMM on CUDA, the PyTorch reference on CPU).

A trainer's BF16 weight sync through vLLM's own ``model.load_weights`` (TRL colocate: one tensor
at a time, no post-load step; verl: per bucket, then the post-load step once) reaches every
FourSight layer, in checkpoint and online mode, and is re-quantized before the layer's next
forward (docs/weight-sync.md; the shared code is :class:`~foursight.quant_methods.plan.FourSightLinearMethodBase`).
The embeddings and lm_head keep vLLM's unquantized method, with a re-pack on CPU after a sync
(:class:`FourSightEmbeddingMethod`).

Three ways in:

* a FourSight checkpoint: ``config.json["quantization_config"]["quant_method"] == "foursight"``
  (``from_config``), with or without ``--quantization foursight``;
* a compressed-tensors NVFP4 checkpoint (llm-compressor's ``nvfp4-pack-quantized``) with
  ``--quantization foursight``: ``override_quantization_method`` takes it over, ``from_config``
  reads its config as FourSight k = 0, and the weight iterator adds the empty k = 0 tensors
  (:func:`foursight.compressed_tensors_format.as_foursight_weights`), so FourSight's kernels serve it unconverted;
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

from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.model_executor.utils import set_weight_attrs

from foursight.quant_methods.config import FourSightMethodConfig, check_folder, parse_quantization_config, served_weights, serves_user_choice
from foursight.quant_methods.online import OnlineSettings
from foursight.quant_methods.param_names import vllm_name_map
from foursight.quant_methods.plan import FourSightLinearMethodBase
from foursight.quant_methods.sharding import TPContext
from foursight.schema import QUANT_METHOD, FourSightConfig


def vllm_tp_context(layer: torch.nn.Module) -> TPContext:
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


def install_load_check() -> None:
    """Every tensor a FourSight model loads from its checkpoint is checked finite.

    vLLM loads norms, embeddings and lm_head through its own loaders, so the FourSight layers'
    own checks (``schema.decode_module``) do not see them, and a NaN there kills the engine at its
    first request. This wraps ``DefaultModelLoader.get_all_weights`` for models whose
    ``quantization`` is ``foursight`` only: a non-finite tensor stops the load with a
    :class:`~foursight.schema.CheckpointError` naming it, and the tensors are compared with the
    model's parameters. After the load, the model's own ``load_weights`` (what TRL colocate and
    verl call for a weight sync) checks every call whole before it writes anything
    (:func:`foursight.quant_methods.update_check.guard_load_weights`). Idempotent; called by the plugin entry point
    (:func:`foursight.quant_methods.vllm_plugin.register`), not on import
    (:mod:`foursight.quant_methods.engine_hooks`).
    """
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError:  # another vLLM layout: the FourSight layers' own checks still run
        return
    from foursight.quant_methods.engine_hooks import wrap_method

    def wrap(original):
        def get_all_weights(self, model_config, model):
            it = original(self, model_config, model)
            if getattr(model_config, "quantization", None) != QUANT_METHOD:
                yield from it
                return
            qc = getattr(model_config.hf_config, "quantization_config", None)
            check_folder(model_config.model)  # an incomplete folder or a truncated file, named before vLLM reads it
            loaded: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

            def recorded(weights):
                for name, t in weights:
                    loaded[name] = (t.dtype, tuple(t.shape))
                    yield name, t
                # what a reload must give again, whole (vllm_weight_sync.check_reload)
                model.foursight_checkpoint_tensors = loaded

            yield from served_weights(recorded(it), qc, f" in {model_config.model}", model=model)

        return get_all_weights

    wrap_method(DefaultModelLoader, "get_all_weights", wrap)

    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    def wrap_load_model(original):
        def load_model(self, vllm_config, model_config, *args, **kwargs):
            model = original(self, vllm_config, model_config, *args, **kwargs)
            if getattr(model_config, "quantization", None) == QUANT_METHOD:
                from foursight.quant_methods.update_check import guard_load_weights

                guard_load_weights(model, vllm_name_map(model))  # a trainer's own load_weights: checked whole
            return model

        return load_model

    wrap_method(BaseModelLoader, "load_model", wrap_load_model)


@register_quantization_config(QUANT_METHOD)
class FourSightVllmConfig(FourSightMethodConfig, QuantizationConfig):
    """vLLM config of method ``foursight`` (checkpoint or online mode; shared behaviour in
    :class:`~foursight.quant_methods.config.FourSightMethodConfig`).

    Args:
        config: the checkpoint's validated :class:`FourSightConfig`; None for online mode.
        online: online settings (BF16 weights quantized at load); built from the environment
            when ``config`` is None and this is None.
    """

    def __init__(self, config: FourSightConfig | None = None, online: OnlineSettings | None = None):
        QuantizationConfig.__init__(self)
        self._init_foursight(config, online)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FourSightVllmConfig":
        """From ``config.json["quantization_config"]`` (FourSight, or compressed-tensors NVFP4 read as
        k = 0: :func:`~foursight.quant_methods.config.parse_quantization_config`); raises
        CheckpointError naming a bad field."""
        return cls(parse_quantization_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None) -> str | None:
        """``--quantization foursight`` on a compressed-tensors NVFP4 checkpoint serves it with FourSight
        (vLLM would otherwise refuse the mismatch between the two method names)."""
        return QUANT_METHOD if serves_user_choice(hf_quant_cfg, user_quant) else None

    @classmethod
    def from_config_file(cls, path: str) -> "FourSightVllmConfig":
        """Online mode with a channels file, via ``--hf-overrides '{"quantization_config_file": PATH}'``."""
        return cls(None, OnlineSettings.from_env(channels_file=path))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, VocabParallelEmbedding):
            return FourSightEmbeddingMethod()  # embeddings and lm_head (ParallelLMHead) stay unquantized
        if not isinstance(layer, LinearBase):
            return None
        return FourSightLinearMethod(self, prefix) if self.quantizes(prefix) else UnquantizedLinearMethod()


class FourSightEmbeddingMethod(UnquantizedEmbeddingMethod):
    """vLLM's unquantized embedding / lm_head method, never served stale after a BF16 sync.

    On CPU, vLLM's post-load step copies the weight into a pre-packed GEMM operand for the lm_head
    (``dispatch_cpu_unquantized_gemm``), so a new ``embed_tokens``/``lm_head`` weight loaded by a
    trainer's ``load_weights`` without a post-load step (TRL colocate) would leave the logits on
    the old one. Every load of the weight counts on the parameter (shared by a tied lm_head), and
    ``apply`` re-packs when the count moved. Identical to vLLM's method otherwise (a no-op on GPU)."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().create_weights(layer, *args, **kwargs)
        w = layer.weight
        inner = w.weight_loader

        def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, *a: Any, **kw: Any) -> None:
            inner(param, loaded_weight, *a, **kw)
            param.foursight_loads = getattr(param, "foursight_loads", 0) + 1

        w.weight_loader = weight_loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.foursight_packed_loads = getattr(layer.weight, "foursight_loads", 0)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if getattr(layer.weight, "foursight_loads", 0) != getattr(layer, "foursight_packed_loads", 0):
            self.process_weights_after_loading(layer)
        return super().apply(layer, x, bias)


class FourSightLinearMethod(FourSightLinearMethodBase, LinearMethodBase):
    """The compensated linear layer in vLLM (see the module docstring and
    :class:`~foursight.quant_methods.plan.FourSightLinearMethodBase`)."""

    def tp_context(self, layer: torch.nn.Module) -> TPContext:
        return vllm_tp_context(layer)

    def set_attrs(self, param: torch.nn.Parameter, attrs: dict[str, Any]) -> None:
        set_weight_attrs(param, attrs)

    def keeps_checkpoint(self) -> bool:
        """vLLM's weight offloading (``cpu_offload_gb``, the prefetch offloader: an offloader other than its
        no-op one) copies every parameter back to the CPU after processing and streams it each forward: the
        parameters are the weights there, never released (``LayerPlan.release``)."""
        from vllm.model_executor.offloader.base import NoopOffloader, get_offloader

        return not isinstance(get_offloader(), NoopOffloader)


__all__ = ["FourSightVllmConfig", "FourSightLinearMethod", "FourSightEmbeddingMethod"]
