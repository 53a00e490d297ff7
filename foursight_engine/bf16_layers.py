"""BF16 carve-outs: whole linear layers kept in BF16 (``--bf16-layers``), and the BF16 byte share.

The NVFP4 baseline practitioners run (verl, NeMo RL, Miles) quantizes most linears and keeps some
in BF16: the attention projections, or the first and last transformer blocks. FourSight instead
keeps k input channels of every layer in BF16. The two are compared at the same share of BF16
weight bytes (:func:`bf16_weight_share`).

A ``--bf16-layers`` entry is one or more selectors joined by ``&`` (all must match); entries are
united. Selectors:

* ``attention`` — linears under an attention module (a path component ``self_attn``, ``attn``,
  ``attention`` or ``self_attention``);
* ``mlp`` — linears under ``mlp``, ``feed_forward`` or ``ffn``;
* ``first:N`` / ``last:N`` — linears of the first / last N transformer blocks (a path component
  ``layers.<i>``, ``h.<i>``, ``blocks.<i>`` or ``block.<i>``; needs the number of blocks);
* ``block:I`` — block I (negative counts from the end);
* anything else, alone: a module name, dotted suffix or ``re:<regex>``, as ``--ignore`` takes it.

Each entry becomes one ``--ignore`` pattern (:func:`bf16_layer_patterns`), so a checkpoint
records its carve-out in ``quantization_config.ignore`` and every engine that honours ``ignore``
serves those layers in BF16.
"""

from __future__ import annotations

import re
from typing import Iterable

_ATTN = r"(?=(?:.*\.)?(?:self_attn|attn|attention|self_attention)\.)"
_MLP = r"(?=(?:.*\.)?(?:mlp|feed_forward|ffn)\.)"
_BLOCK = r"(?=(?:.*\.)?(?:layers|h|blocks|block)\.(?:{ids})\.)"
_SEL = re.compile(r"^(attention|mlp|first:\d+|last:\d+|block:-?\d+)$")


class CarveOutError(ValueError):
    """A bad ``--bf16-layers`` entry (the message names it)."""


def _selector(sel: str, num_blocks: int | None, entry: str) -> str:
    if sel == "attention":
        return _ATTN
    if sel == "mlp":
        return _MLP
    kind, _, val = sel.partition(":")
    if num_blocks is None:
        raise CarveOutError(f"--bf16-layers {entry!r}: {kind}:N needs the model's number of blocks (num_hidden_layers)")
    n = int(val)
    if kind == "block":
        i = n + num_blocks if n < 0 else n
        if not 0 <= i < num_blocks:
            raise CarveOutError(f"--bf16-layers {entry!r}: block {n} is outside the model's {num_blocks} blocks")
        ids = [i]
    else:
        if not 1 <= n <= num_blocks:
            raise CarveOutError(f"--bf16-layers {entry!r}: N must be in 1..{num_blocks} (the model's blocks), got {n}")
        ids = list(range(n)) if kind == "first" else list(range(num_blocks - n, num_blocks))
    return _BLOCK.format(ids="|".join(map(str, ids)))


def bf16_layer_patterns(entries: Iterable[str], num_blocks: int | None = None) -> list[str]:
    """One ``ignore`` pattern per ``--bf16-layers`` entry (see the module docstring).

    Args:
        entries: the ``--bf16-layers`` values, e.g. ``["attention&first:2", "last:1"]``.
        num_blocks: the model's number of transformer blocks (``num_hidden_layers``), needed by
            ``first:N``, ``last:N`` and ``block:I``.
    Returns:
        Patterns for :attr:`foursight.schema.FourSightConfig.ignore` (``re:`` regexes for the
        selectors; a plain name / suffix / ``re:`` entry is passed through unchanged).
    """
    out: list[str] = []
    for entry in entries:
        entry = entry.strip()
        if not entry:
            raise CarveOutError("--bf16-layers: empty entry")
        parts = [p.strip() for p in entry.split("&")]
        if len(parts) == 1 and not _SEL.match(parts[0]):
            out.append(parts[0])  # a name, suffix or re: pattern, as --ignore takes it
            continue
        bad = [p for p in parts if not _SEL.match(p)]
        if bad:
            raise CarveOutError(f"--bf16-layers {entry!r}: {bad[0]!r} is not a selector (attention, mlp, first:N, last:N, block:I); "
                                "a module name or re: pattern cannot be combined with '&'")
        out.append("re:" + "".join(_selector(p, num_blocks, entry) for p in parts) + ".*")
    return out


def num_blocks_of(model_or_config) -> int | None:
    """``num_hidden_layers`` (or ``n_layer``) of an HF model or config, None if it has neither."""
    cfg = getattr(model_or_config, "config", model_or_config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        v = getattr(cfg, key, None) if not isinstance(cfg, dict) else cfg.get(key)
        if isinstance(v, int):
            return v
    return None


def bf16_weight_share(layers: Iterable[tuple[str, int, int, int]], carved: Iterable[str]) -> dict:
    """The share of a model's quantizable linear weights held in BF16.

    Args:
        layers: ``(name, out_features N, in_features K, k)`` of every linear that is either
            quantized (k BF16 input channels, 0 for plain NVFP4) or carved out; linears that no
            configuration quantizes (``lm_head``) are left out of both sides.
        carved: names of the carved-out (whole BF16) layers among ``layers``.
    Returns:
        ``bf16_weight_share`` (BF16 weight elements / all weight elements of ``layers``: a carved
        layer counts N·K, a FourSight layer N·k; equal to the share of the BF16 bytes these
        weights take unquantized), its two parts ``bf16_layer_share`` and ``bf16_channel_share``,
        and ``bf16_layers`` (the carved names, sorted).
    """
    carved = set(carved)
    total = whole = chans = 0
    for name, n, k_dim, k in layers:
        total += n * k_dim
        if name in carved:
            whole += n * k_dim
        else:
            chans += n * k
    if not total:
        raise CarveOutError("bf16_weight_share: no layers")
    return {"bf16_weight_share": (whole + chans) / total, "bf16_layer_share": whole / total,
            "bf16_channel_share": chans / total, "bf16_layers": sorted(carved)}


def model_bf16_share(model, base_ignore: Iterable[str], carve_patterns: Iterable[str], channels: dict | None = None) -> dict:
    """:func:`bf16_weight_share` of an HF model: every ``nn.Linear`` not matched by ``base_ignore``;
    those matched by ``carve_patterns`` are carved out, the rest quantized with ``channels``
    (module name → channel index tensor or k; missing: k = 0)."""
    from torch import nn

    from foursight.schema import FourSightConfig

    base = FourSightConfig(ignore=list(base_ignore))
    carve = FourSightConfig(ignore=list(carve_patterns))
    rows, carved = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or base.is_ignored(name):
            continue
        ch = (channels or {}).get(name, 0)
        rows.append((name, m.out_features, m.in_features, ch if isinstance(ch, int) else int(ch.numel())))
        if carve.is_ignored(name):
            carved.append(name)
    return bf16_weight_share(rows, carved)


def checkpoint_bf16_share(ckpt_dir, carve_patterns: Iterable[str]) -> dict:
    """:func:`bf16_weight_share` of a written FourSight checkpoint, from its tensor shapes: every
    FourSight layer (N·k of N·K in BF16) and every 2-D ``<module>.weight`` matched by
    ``carve_patterns`` (whole in BF16)."""
    from pathlib import Path

    from foursight import schema
    from foursight.tensor_io import read_quant_config
    from foursight.tensor_io import read_headers

    ckpt_dir = Path(ckpt_dir)
    cfg = read_quant_config(ckpt_dir)
    carve = schema.FourSightConfig(ignore=list(carve_patterns))
    shapes = read_headers(ckpt_dir)  # the files the index lists (or every *.safetensors), headers only
    rows, carved = [], []
    for name, shp in shapes.items():
        if name.endswith("." + schema.WEIGHT_PACKED):
            mod = name[: -len(schema.WEIGHT_PACKED) - 1]
            rows.append((mod, shp[0], shp[1] * 2, cfg.channels_for(mod)))
        elif name.endswith(".weight") and len(shp) == 2 and carve.is_ignored(name[: -len(".weight")]):
            mod = name[: -len(".weight")]
            rows.append((mod, shp[0], shp[1], 0))
            carved.append(mod)
    return bf16_weight_share(rows, carved)
