"""SGLang adapter: ``--quantization foursight`` (FourSight NVFP4 + sparse BF16 channels).

Thin glue between SGLang's quantization interface and the engine-neutral modules: the config
base :mod:`foursight.quant_methods.config`, the per-layer plan :mod:`foursight.quant_methods.plan`
(``LayerPlan`` / ``FourSightLinearMethodBase``) and :mod:`foursight.schema`, shared with the vLLM adapter, so
the same checkpoint loads unchanged on both engines and a bad one fails with the same message.

What is SGLang-specific here:

* :class:`FourSightSGLangConfig` -- SGLang's ``QuantizationConfig``. ``from_config`` receives
  ``config.json["quantization_config"]`` (plus SGLang's ``packed_modules_mapping`` /
  ``hf_config`` keys, stripped before the strict schema parse). A compressed-tensors NVFP4
  checkpoint (llm-compressor's ``nvfp4-pack-quantized``) served with ``--quantization foursight``
  is taken over by ``override_quantization_method`` and read as FourSight k = 0; the plugin's
  weight iterator adds the empty k = 0 tensors (:func:`foursight.compressed_tensors_format.as_foursight_weights`),
  as the vLLM adapter does. With no quantization config in
  the model (a BF16 model served with ``--quantization foursight``) SGLang calls the class with
  no arguments: that is online quantization, configured by ``FOURSIGHT_*`` environment variables
  (see ``online.OnlineSettings``) and, if present, the model folder's ``foursight_channels.json``.
* :class:`FourSightSGLangLinearMethod` -- SGLang's ``LinearMethodBase``. Parameters get the
  core's loaders wrapped around SGLang's own v1 column/row/QKV/merged loader.
* The RL weight update. SGLang 0.5.23 wraps ``update_weights_from_tensor`` /
  ``update_weights_from_distributed`` in a ``begin_weight_update`` / ``end_weight_update``
  session whose end runs ``process_weights_after_loading`` (and ``update_weights_from_disk``
  runs it too); the core's processing is idempotent and never touches the loaded parameters,
  so this simply rebuilds the execution state. A BF16 ``<module>.weight`` reaches a
  checkpoint-mode layer through its empty ``weight`` parameter and is quantized with the layer's
  channels (:meth:`~foursight.quant_methods.param_kinds.BF16UpdateParam.load`). For code that calls
  ``model.load_weights`` directly, every loader marks its layer stale, a layer whose every shard
  got a new weight is rebuilt at once, and ``apply`` rebuilds a stale one before use
  (:func:`refresh_foursight_layers` does it eagerly); the same shared code as the vLLM adapter
  (docs/weight-sync.md).

Registration with SGLang happens in :mod:`foursight.quant_methods.sglang_plugin` (entry point
``sglang.srt.plugins``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from sglang.srt.layers.linear import LinearBase
from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang.srt.utils import set_weight_attrs

from foursight.quant_methods.config import FourSightMethodConfig, foursight_layers, parse_quantization_config, serves_user_choice
from foursight.quant_methods.online import OnlineSettings
from foursight.quant_methods.plan import FourSightLinearMethodBase, refresh_layer, restore_layer
from foursight.quant_methods.sharding import TPContext
from foursight.schema import CHANNELS_FILE, ENV_CHANNELS_FILE, QUANT_METHOD, FourSightConfig

logger = logging.getLogger("foursight.quant_methods.sglang")

#: Keys SGLang adds to the checkpoint's quantization_config before ``from_config``.
_SGLANG_EXTRA_KEYS = ("packed_modules_mapping", "hf_config")


def _model_path_from_sglang() -> str | None:
    """The served model folder, from SGLang's global server args (None outside an engine)."""
    try:
        from sglang.srt.server_args import get_global_server_args

        return getattr(get_global_server_args(), "model_path", None)
    except Exception:  # not set yet / not in an engine process
        return None


def _default_online_settings() -> OnlineSettings:
    """Online settings: ``FOURSIGHT_*`` env vars; the channels file is ``$FOURSIGHT_CHANNELS_FILE``
    or, when unset, ``<model>/foursight_channels.json`` if that file exists."""
    path = os.environ.get(ENV_CHANNELS_FILE) or None
    if path is None:
        model = _model_path_from_sglang()
        if model and (Path(model) / CHANNELS_FILE).is_file():
            path = str(Path(model) / CHANNELS_FILE)
    return OnlineSettings.from_env(path)


class FourSightSGLangConfig(FourSightMethodConfig, QuantizationConfig):
    """SGLang ``QuantizationConfig`` for FourSight checkpoints and online quantization (shared
    behaviour in :class:`~foursight.quant_methods.config.FourSightMethodConfig`).

    Args:
        config: the parsed checkpoint config; None means online quantization of a BF16 model.
        online: online settings (default: from the environment, see module docstring).
    """

    def __init__(self, config: FourSightConfig | None = None, online: OnlineSettings | None = None):
        QuantizationConfig.__init__(self)
        self._init_foursight(config, online, _default_online_settings)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FourSightSGLangConfig":
        """Parse ``config.json["quantization_config"]`` with the shared strict schema (FourSight, or
        compressed-tensors NVFP4 read as k = 0: :func:`~foursight.quant_methods.config.parse_quantization_config`)."""
        raw = {k: v for k, v in config.items() if k not in _SGLANG_EXTRA_KEYS}
        out = cls(parse_quantization_config(raw))
        if config.get("packed_modules_mapping"):
            out.packed_modules_mapping = dict(config["packed_modules_mapping"])
        return out

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None) -> str | None:
        """``--quantization foursight`` on a compressed-tensors NVFP4 checkpoint serves it with
        FourSight (SGLang would otherwise refuse the mismatch between the two method names)."""
        return QUANT_METHOD if serves_user_choice(hf_quant_cfg, user_quant) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        if not isinstance(layer, LinearBase):
            return None  # embeddings / lm_head (ParallelLMHead) / MoE stay unquantized
        return FourSightSGLangLinearMethod(self, prefix) if self.quantizes(prefix) else UnquantizedLinearMethod()

    def get_scaled_act_names(self) -> list[str]:
        return []


def _tp_context(layer: torch.nn.Module) -> TPContext:
    """The layer's TP group as a core :class:`TPContext` (identity at TP=1)."""
    from sglang.srt.distributed.utils import get_group_rank_size

    group = getattr(layer, "tp_group", None)
    rank, size = get_group_rank_size(group)
    if size == 1:
        return TPContext()

    def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.device_group)
        return t

    def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
        return group.all_gather(t, dim=0)

    return TPContext(rank, size, all_reduce_max, all_gather_cat)


class FourSightSGLangLinearMethod(FourSightLinearMethodBase, LinearMethodBase):
    """SGLang ``LinearMethodBase`` for one FourSight layer (fused q/k/v and gate/up included);
    the shared hooks are :class:`~foursight.quant_methods.plan.FourSightLinearMethodBase`'s
    (every load marks the layer stale, ``apply`` rebuilds a stale layer)."""

    def tp_context(self, layer: torch.nn.Module) -> TPContext:
        return _tp_context(layer)

    def set_attrs(self, param: torch.nn.Parameter, attrs: dict[str, Any]) -> None:
        set_weight_attrs(param, attrs)

    def keeps_checkpoint(self) -> bool:
        """SGLang's ``--cpu-offload-gb`` / group offloading (an offloader other than its no-op one) streams the
        parameters from the CPU: they are the weights there, never released (``LayerPlan.release``)."""
        from sglang.srt.utils.offloader import NoopOffloader, get_offloader

        return not isinstance(get_offloader(), NoopOffloader)

    def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
        # Parameters keep their checkpoint layout (process never rewrites them); where the execution form
        # released the codes (one weight copy, plan.py) they come back now, as the session may write them
        # without their loaders; the layer is rebuilt at the session's end (process_weights_after_loading).
        restore_layer(layer)
        layer.foursight_plan.loader.stale = True


def refresh_foursight_layers(model: torch.nn.Module, only_stale: bool = True) -> int:
    """Rebuild the execution state of (stale) FourSight layers now; returns how many were rebuilt."""
    n = 0
    for m in foursight_layers(model).values():
        if m.foursight_plan.loader.stale or not only_stale:
            refresh_layer(m, m.quant_method.tp_context(m))
            n += 1
    return n


__all__ = [
    "FourSightSGLangConfig",
    "FourSightSGLangLinearMethod",
    "refresh_foursight_layers",
]
