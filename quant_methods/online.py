"""Online (load-time) quantization settings: a BF16 model served with ``--quantization foursight``.

The channels file (:class:`foursight.channels_file.ChannelsFile`), the ``FOURSIGHT_*`` environment
variables every engine process inherits, and the channel set of a layer quantized at load
(:func:`resolve_channels`: the channels file's, or the weight-based fallback).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from foursight.channels import select_channels
from foursight.channels_file import ChannelsFile
from foursight.layer import check_channels
from foursight.quant_methods.sharding import TPContext
from foursight.schema import (ENV_ACTIVATION_DTYPE, ENV_ACTIVATION_SCALE, ENV_CHANNEL_BUDGET, ENV_CHANNELS_FILE, ENV_IGNORE, ENV_ONLINE_KEEP_BF16,
                              CheckpointError, FourSightConfig, parse_channel_budget)

if TYPE_CHECKING:  # annotations only: resolve_channels reads a layout's names and sizes
    from foursight.quant_methods.layer_layout import LayerLayout

logger = logging.getLogger("foursight.quant_methods")
#: the weight-based channel fallback warns once per channels file (and once when there is none): the keys warned
#: of so far (``"missing:<path>"``, ``"nofile"``); a test clears it to see the warning again
warned_fallback: set[str] = set()

#: The online path reads :mod:`foursight.schema`'s ``ENV_*`` variables (every engine process inherits them).
#: Budget used when neither a channels file nor ``FOURSIGHT_CHANNEL_BUDGET`` is given.
DEFAULT_ONLINE_BUDGET = "2%"


@dataclass
class OnlineSettings:
    """How BF16 weights are quantized at load (``--quantization foursight`` on a BF16 model).

    Attributes:
        channels_file: parsed channels file, or None (weight-based fallback).
        budget: ``--channels``-style budget ("32" or "2%") for the fallback.
        act_quant: W4A4 (True) or W4A16 (False).
        static_act_scale: use ``input_amax`` of the channels file as a static activation scale.
        ignore: module names / suffixes / ``re:`` patterns left unquantized.
        keep_bf16: keep each layer's BF16 weights after quantizing them (``FOURSIGHT_ONLINE_KEEP_BF16``, default
            on): a weight update re-quantizes from them. Off, a serving engine gives their memory to the KV cache
            (an 8B-shaped model held 23.24 GiB with them against BF16's 15.00 on the H100, docs/gpu.md) and refuses
            updates.
    """

    channels_file: ChannelsFile | None = None
    budget: str = DEFAULT_ONLINE_BUDGET
    act_quant: bool = True
    static_act_scale: bool = False
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    keep_bf16: bool = True

    @classmethod
    def from_env(cls, channels_file: str | None = None) -> "OnlineSettings":
        """Settings from the ``FOURSIGHT_*`` environment variables (an explicit path wins)."""
        path = channels_file or os.environ.get(ENV_CHANNELS_FILE) or None
        cf = ChannelsFile.read(path) if path else None
        act = os.environ.get(ENV_ACTIVATION_DTYPE, "nvfp4")
        if act not in ("nvfp4", "bf16"):
            raise CheckpointError(f"{ENV_ACTIVATION_DTYPE}={act!r}: expected 'nvfp4' or 'bf16'")
        sc = os.environ.get(ENV_ACTIVATION_SCALE, "dynamic")
        if sc not in ("dynamic", "static"):
            raise CheckpointError(f"{ENV_ACTIVATION_SCALE}={sc!r}: expected 'dynamic' or 'static'")
        if sc == "static" and (cf is None or not cf.input_amax):
            raise CheckpointError(f"{ENV_ACTIVATION_SCALE}=static needs a channels file with 'input_amax' (format_version 2, from `foursight calibrate`)")
        ignore = [s for s in os.environ.get(ENV_IGNORE, "lm_head").split(",") if s]
        budget = os.environ.get(ENV_CHANNEL_BUDGET, DEFAULT_ONLINE_BUDGET)
        keep = os.environ.get(ENV_ONLINE_KEEP_BF16, "1")
        if keep not in ("0", "1"):
            raise CheckpointError(f"{ENV_ONLINE_KEEP_BF16}={keep!r}: expected '1' (keep the BF16 weights for weight updates) or '0'")
        return cls(cf, budget, act == "nvfp4", sc == "static", ignore, keep == "1")

    def as_config(self) -> FourSightConfig:
        """A :class:`FourSightConfig` describing these settings (``channels`` filled lazily)."""
        return FourSightConfig(
            activation_dtype="nvfp4" if self.act_quant else "bf16",
            activation_scale="static" if self.static_act_scale else "dynamic",
            ignore=list(self.ignore),
            channel_selection="calibration" if self.channels_file else "weight",
            channel_budget=self.budget,
        )


def resolve_channels(settings: OnlineSettings | None, layout: LayerLayout, weight: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Global channel set (int32 [k], sorted) of a layer quantized at load, from its local BF16 ``weight``.

    From the channels file when it lists the layer's shards (they must agree), else the
    weight-based fallback with the budget, with a warning logged once per process.
    """
    st = settings or OnlineSettings()
    cf = st.channels_file
    if cf is not None:
        sets = [cf.channels.get(n) for n in layout.shard_names]
        if all(s is not None for s in sets):
            if any(s != sets[0] for s in sets[1:]):
                raise CheckpointError(f"{layout.prefix}: channels file {cf.path} lists different channels for the fused shards {layout.shard_names}")
            return check_channels(cf.channel_tensor(layout.shard_names[0]), layout.input_size, layout.prefix)
        missing = [n for n, s in zip(layout.shard_names, sets) if s is None]
        key = f"missing:{cf.path}"
        if key not in warned_fallback:
            warned_fallback.add(key)
            logger.warning("FourSight: channels file %s has no entry for %s (and maybe others); using weight-based channel selection for those layers", cf.path, missing[0])
    else:
        if "nofile" not in warned_fallback:
            warned_fallback.add("nofile")
            logger.warning(
                "FourSight: no channels file (set %s or pass one to the quantization config); selecting BF16 channels from the weights "
                "(largest column amax, budget %s). Calibrated channels from `foursight calibrate` are better.",
                ENV_CHANNELS_FILE,
                st.budget,
            )
    k = parse_channel_budget(st.budget, layout.input_size, layout.prefix)
    return weight_based_channels(weight, k, tp, layout.k_split)


def weight_based_channels(weight_rows: torch.Tensor, k: int, tp: TPContext | None = None, k_split: bool = False) -> torch.Tensor:
    """Fallback channel selection from the weight alone: the k input channels with the largest
    column amax ``max_n |W[n, c]|``.

    Args:
        weight_rows: [N_loc, K_loc] the (local part of the) fused weight of all shards.
        k: number of channels.
        tp: TP context. Column-parallel (``k_split=False``): the column amax is max-reduced over
            ranks. Row-parallel (``k_split=True``): each rank's K slice is gathered.
        k_split: whether this layer's K is split across ranks.
    Returns:
        int32 [k] sorted global channel indices (ties broken by the lower index).
    """
    tp = tp or TPContext()
    score = weight_rows.float().abs().amax(dim=0)  # [K_loc]
    if tp.size > 1:
        score = tp.gather_cat(score.contiguous()) if k_split else tp.reduce_max(score.contiguous())
    # same ranking as the offline fallback (foursight.channels.weight_based_channels)
    return select_channels(score.cpu(), k)
