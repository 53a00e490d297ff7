"""Channel selection, the product's core choice: which input channels of a layer stay in BF16.

Per input group (the linears that read one activation: q/k/v, gate/up), FourSight keeps the ``k``
channels of highest activation variance, ``S``, in BF16 and quantizes the rest to NVFP4. This module is
the one home of everything that decides or follows from that choice:

* :func:`select_channels` — S: the top-``k`` channels by variance (or, without activation statistics,
  :func:`weight_based_channels`: by the largest |W| in the column);
* :func:`choose_k` — k: fixed (a count or a percentage of K, ``--channels``) or, with an error target
  (``--error-target``), the smallest of :func:`budget_candidates` (0, 16, 32, 64, ...) whose worst member
  error on the calibration rows is ≤ the target; :func:`choose_k_levels` does several targets at once;
* :func:`layer_error` — that error: the relative output error of the quantized layer (W4A4, dynamic
  activation scales) against BF16 on calibration rows;
* :func:`choose_channels` — all of it for one group: :class:`ChannelChoice` (k, S, the amax of the FP4 part
  of the input, the static ``input_global_scale`` made from it, the variance share of S);
* :func:`find_linears` — the layers a channel set is chosen for; :func:`calibrate_channel_sets` — S for
  every one of them in an in-memory model (``foursight rl``), and :func:`channel_summary` — what k came out.

The statistics themselves (:class:`~foursight.calibration.InputGroup`) come from
:mod:`foursight.calibration`. ``foursight quantize``/``calibrate``/``import``, ``foursight rl``, compare's
attribution and the benchmarks all choose through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from foursight import schema
from foursight.calibration import InputGroup, collect_stats
from foursight.layer import QuantizedWeight, dequantize_weight, dequantized_activation, quantize_weight, splice_matmul
from foursight.nvfp4 import BLOCK_SIZE
from foursight.schema import CheckpointError, find_linears


def select_channels(variance: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` channels by variance, sorted ascending, int32 [k] (ties broken by lower index)."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.int32)
    if k >= variance.numel():
        raise ValueError(f"k={k} must be < K={variance.numel()}")
    # stable: sort by (-variance, index)
    order = torch.argsort(-variance.to(torch.float64), stable=True)[:k]
    return torch.sort(order).values.to(torch.int32)


def weight_based_channels(weights: list[torch.Tensor], k: int) -> torch.Tensor:
    """Fallback selection without activation statistics: top-``k`` input channels by the
    largest |W| in the column across all weights that share the input (int32 [k], sorted)."""
    score = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0)
    return select_channels(score, k)


def budget_candidates(in_features: int, max_k: int | None = None) -> list[int]:
    """Channel counts tried by ``--error-target``: 0, 16, 32, 64, ... (< K, ≤ max_k)."""
    cap = in_features - BLOCK_SIZE if max_k is None else min(max_k, in_features - BLOCK_SIZE)
    out, k = [0], BLOCK_SIZE
    while k <= cap:
        out.append(k)
        k *= 2
    return out


def relative_error(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """‖y − y_ref‖ / ‖y_ref‖ in float64 (0 when y_ref is zero)."""
    ref = y_ref.double()
    den = float(ref.norm())
    return float((y.double() - ref).norm()) / den if den > 0 else 0.0


def layer_error(rows: torch.Tensor, weight: torch.Tensor, qw: QuantizedWeight, xd: torch.Tensor | None = None) -> float:
    """Relative output error of the quantized layer (W4A4, dynamic activation scales) on ``rows``.

    ``xd`` optionally caches ``dequantized_activation(rows, qw.bf16_channels)`` (shared by a group)."""
    y_ref = rows.float() @ weight.float().t()
    if xd is None:
        xd = dequantized_activation(rows, qw.bf16_channels)
    y = splice_matmul(xd, rows, qw, dequantize_weight(qw, torch.float32, include_bf16=False))
    return relative_error(y, y_ref)


def choose_k_levels(group: InputGroup, weights: list[torch.Tensor], targets: list[float], max_k: int | None = None) -> dict[float, int]:
    """For each error target, the smallest candidate k whose worst member error on the group's calibration
    rows is ≤ the target (the largest candidate if none is); each candidate's error is computed once for all
    targets. ``{target: k}``."""
    if group.rows is None or group.rows.shape[0] == 0:
        raise CheckpointError(f"layer {group.members[0]}: no calibration rows for --error-target")
    weights = [w.to(group.rows.device) for w in weights]  # the calibration rows stay where they were taken (CPU)
    res: dict[float, int] = {}
    cands = budget_candidates(group.in_features, max_k)
    for k in cands:
        ch = select_channels(group.stats.variance, k)
        err = max(layer_error(group.rows, w, quantize_weight(w, ch)) for w in weights)
        for t in targets:
            if t not in res and err <= t:
                res[t] = k
        if len(res) == len(targets):
            break
    for t in targets:
        res.setdefault(t, cands[-1])
    return res


def choose_k(group: InputGroup, weights: list[torch.Tensor], spec: str | int, error_target: float | None = None,
             max_k: int | None = None) -> int:
    """k for a group: fixed by ``spec`` (a count or a percentage of K) or, with ``error_target``, the
    smallest candidate whose worst member error is ≤ the target (:func:`choose_k_levels`)."""
    if error_target is None:
        return schema.parse_channel_budget(str(spec), group.in_features, layer=group.members[0])
    return choose_k_levels(group, weights, [error_target], max_k)[error_target]


@dataclass(frozen=True)
class ChannelChoice:
    """What one input group's channel choice decides (:func:`choose_channels`)."""

    k: int
    channels: torch.Tensor  # S, int32 [k], sorted
    fp4_amax: float  # max |x| over the channels not in S: the FP4 part of the input
    input_global_scale: torch.Tensor  # the static activation scale made from fp4_amax
    outlier_share: float  # share of the input's total variance held by S


def choose_channels(group: InputGroup, weights: list[torch.Tensor], spec: str | int = "32", error_target: float | None = None,
                    max_k: int | None = None) -> ChannelChoice:
    """k (:func:`choose_k`), S (:func:`select_channels`) and what follows from them for one input group."""
    k = choose_k(group, weights, spec, error_target, max_k)
    ch = select_channels(group.stats.variance, k)
    fp4_amax = group.stats.fp4_amax(ch)
    var = group.stats.variance
    share = float(var[ch.long()].sum() / var.sum()) if k and float(var.sum()) > 0 else 0.0
    return ChannelChoice(k, ch, fp4_amax, schema.static_input_scale([fp4_amax]), share)


def calibrate_channel_sets(model: nn.Module, tok: Any, texts: list[str], spec: str, ignore: Sequence[str] = ("lm_head",),
                           error_target: float | None = None, max_k: int | None = None) -> dict[str, torch.Tensor]:
    """S for every linear of an in-memory model (shared by q/k/v and gate/up) from its activations on
    ``texts``: :func:`foursight.calibration.collect_stats`, then :func:`choose_channels` per input group
    (with ``error_target``, on 512 sample rows, as ``foursight quantize --error-target`` does).
    ``foursight rl`` calibrates its rollout copy with it. Returns module name -> int32 [k]."""
    names = find_linears(model, schema.FourSightConfig(ignore=list(ignore)))
    groups = collect_stats(model, tok, texts, names, batch_size=8, max_length=256, keep_rows=512 if error_target else 16,
                           progress=False)
    out: dict[str, torch.Tensor] = {}
    for g in groups.values():
        choice = choose_channels(g, [model.get_submodule(n).weight.detach() for n in g.members], spec, error_target, max_k)
        out.update({n: choice.channels for n in g.members})
    return out


def channel_summary(model: nn.Module, channels: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``channels_k`` (distinct k), ``channels_k_mean`` and ``channels_k_fraction`` (mean of k / K over layers)."""
    if not channels:
        return {"channels_k": [0], "channels_k_mean": 0.0, "channels_k_fraction": 0.0}
    ks = {n: int(v.numel()) for n, v in channels.items()}
    frac = [ks[n] / model.get_submodule(n).in_features for n in ks]
    return {"channels_k": sorted(set(ks.values())), "channels_k_mean": sum(ks.values()) / len(ks),
            "channels_k_fraction": sum(frac) / len(frac)}
