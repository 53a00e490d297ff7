"""Writing and reading FourSight checkpoints (``foursight quantize``), and ``foursight calibrate``
(the same calibration and channel choice, written as a channels file only).

A checkpoint is an HF folder: ``config.json`` with ``quantization_config`` (see
:class:`foursight.schema.FourSightConfig`), safetensors with the tensors named in
:mod:`foursight.schema`, the tokenizer, ``foursight_layers.json`` (the per-layer error table)
and ``foursight_channels.json`` (:class:`foursight.channels_file.ChannelsFile`: channel sets +
calibrated input amax, reusable for online quantization). The tensors are written and read by
:mod:`foursight.tensor_io`. It is written through the one folder writer,
:func:`foursight.folder_writer.folder_writer` (a temporary folder under an incomplete-run marker,
renamed at the end; ``--force`` replaces only what is ours), as ``import`` and ``export`` are.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from foursight import schema
from foursight.calibration import check_calibration_batches, collect_stats, load_calibration_texts
from foursight.channels import choose_channels, layer_error
from foursight.channels_file import ChannelsFile, check_channels_destination
from foursight.folder_writer import folder_writer, prepare_destination, resolve_out
from foursight.layer import dequantized_activation, quantize_weight
from foursight.nvfp4 import BLOCK_SIZE
from foursight.quantize_config import QuantizeConfig
from foursight.schema import CheckpointError, FourSightConfig, find_linears
from foursight.tensor_io import write_safetensors


@dataclass
class LayerReport:
    """One row of the per-layer table (relative output error on calibration activations)."""

    name: str
    group: str
    in_features: int
    out_features: int
    k: int
    err_nvfp4: float
    err_foursight: float
    outlier_share: float  # share of the input's total variance held by the selected channels

    @property
    def reduction(self) -> float:
        return 1.0 - self.err_foursight / self.err_nvfp4 if self.err_nvfp4 > 0 else 0.0


def check_model_quantizable(model: nn.Module, names: list[str]) -> None:
    """Fail before any work if a layer has K not a multiple of 16 or non-finite weights (names it)."""
    mods = dict(model.named_modules())
    for n in names:
        w = mods[n].weight
        if w.shape[1] % BLOCK_SIZE:
            raise CheckpointError(
                f"layer {n}: in_features={w.shape[1]} is not a multiple of {BLOCK_SIZE}; add it to --ignore"
            )
        if not bool(torch.isfinite(w).all()):
            raise CheckpointError(f"layer {n}: weight has non-finite values (NaN/Inf)")


@dataclass
class QuantizeResult:
    out_dir: Path
    config: FourSightConfig
    layers: list[LayerReport]
    #: the ``ignore`` patterns of the BF16 carve-out (``QuantizeConfig.bf16_layers`` resolved on the model), [] without one
    bf16_layers: list[str]


def quantize_model(model_dir: str | Path, out_dir: str | Path, cfg: QuantizeConfig | None = None, progress: bool = True) -> QuantizeResult:
    """Calibrate, select channels, quantize and write a FourSight checkpoint.

    Args:
        model_dir: a BF16 HF causal-LM folder.
        out_dir: destination (must not exist unless ``cfg.force``; :func:`foursight.folder_writer.prepare_destination`).
        cfg: the options of ``foursight quantize`` (:class:`~foursight.quantize_config.QuantizeConfig`; default: its
            defaults), each checked here, before any work, naming its flag: ``channels`` (k per input group: an
            integer, a percentage of K (``"2%"``), ``0`` = plain NVFP4), ``calib`` (JSONL, ``{"text": ...}`` per line;
            None: the built-in texts), ``ignore`` (names / suffixes / ``re:`` patterns left unquantized) plus the BF16
            carve-out ``bf16_layers`` (resolved on the model: :func:`foursight.bf16_layers.bf16_layer_patterns`),
            ``error_target`` (per-group k: the smallest of 0, 16, 32, 64, ... whose relative output error on
            calibration rows is <= it; ``channels`` is then ignored) with its cap ``max_k``, ``activations``,
            ``activation_scale``, ``batch_size``, ``max_length``, ``force``. Its ``model``, ``out`` and ``report``
            belong to the command and are not read here.
    Returns:
        :class:`QuantizeResult` with the per-layer table.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from tqdm.auto import tqdm

    opts = cfg if cfg is not None else QuantizeConfig()
    channels, error_target, max_k, batch_size, max_length = str(opts.channels), opts.error_target, opts.max_k, opts.batch_size, opts.max_length
    model_dir = Path(model_dir)
    out_dir = prepare_destination(out_dir, opts.force, source=model_dir)  # resolved, before anything else
    check_calibration_batches(batch_size, max_length)
    if error_target is None:
        schema.check_channel_spec(channels)
    elif not error_target > 0:
        raise ValueError(f"--error-target must be > 0 (a relative output error per layer), got {error_target}")
    for flag, field, value in (("--activations", "activation_dtype", opts.activations),
                               ("--activation-scale", "activation_scale", opts.activation_scale)):
        allowed = typing.get_args(FourSightConfig.model_fields[field].annotation)  # the schema's Literal
        if value not in allowed:
            raise ValueError(f"{flag} {value!r}: expected {' or '.join(allowed)}")
    carve: list[str] = []
    if opts.bf16_layers:  # the practitioners' carve-out: whole layers kept in BF16, as more ignore patterns
        from foursight.bf16_layers import bf16_layer_patterns, num_blocks_of

        carve = bf16_layer_patterns(opts.bf16_layers, num_blocks_of(schema.read_config(model_dir)))
    ignore = [*opts.ignore, *carve]
    cfg = FourSightConfig.parse(
        {
            "ignore": ignore,
            "activation_dtype": opts.activations,
            "activation_scale": opts.activation_scale,
            "channel_budget": f"error-target:{error_target}" if error_target is not None else channels,
        }
    )
    texts = load_calibration_texts(opts.calib)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    names = find_linears(model, cfg)
    if not names:
        raise CheckpointError(f"{model_dir}: no linear layers left to quantize (ignore={ignore})")
    check_model_quantizable(model, names)
    # validate the channel spec against every layer before the slow part
    if error_target is None:
        mods0 = dict(model.named_modules())
        for n in names:
            schema.parse_channel_budget(channels, mods0[n].weight.shape[1], layer=n)

    groups = collect_stats(model, tok, texts, names, batch_size=batch_size, max_length=max_length, progress=progress)
    mods = dict(model.named_modules())
    missing = [n for n in names if not any(n in g.members for g in groups.values())]
    if missing:
        raise CheckpointError(f"layers never called during calibration: {missing[:5]}")

    tensors: dict[str, torch.Tensor] = {}
    reports: list[LayerReport] = []
    channels_file = ChannelsFile()
    for g in tqdm(list(groups.values()), desc="quantizing", unit="group", disable=not progress):
        weights = [mods[n].weight.detach() for n in g.members]
        choice = choose_channels(g, weights, channels, error_target, max_k)
        k, ch, fp4_amax, in_gs, share = choice.k, choice.channels, choice.fp4_amax, choice.input_global_scale, choice.outlier_share
        rows = g.rows if g.rows is not None else torch.zeros(0, g.in_features, dtype=torch.bfloat16)
        xd_fs = dequantized_activation(rows, ch) if rows.shape[0] else None
        xd_0 = dequantized_activation(rows, ch[:0]) if rows.shape[0] and k else xd_fs
        for n, w in zip(g.members, weights):
            qw = quantize_weight(w, ch, name=n)
            base = quantize_weight(w, ch[:0], name=n) if k else qw
            e_fs = layer_error(rows, w, qw, xd_fs) if rows.shape[0] else float("nan")
            e_fp4 = layer_error(rows, w, base, xd_0) if rows.shape[0] else float("nan")
            reports.append(LayerReport(n, g.key, w.shape[1], w.shape[0], k, e_fp4, e_fs, share))
            bias = None if mods[n].bias is None else mods[n].bias.detach().to(torch.bfloat16)
            tensors.update(schema.encode_module(n, qw, in_gs, bias))
            cfg.channels[n] = k
        channels_file.record(g.members, ch, fp4_amax)
    cfg.channel_selection = "calibration" if any(cfg.channels.values()) else "none"

    quantized = set(names)
    for pname, p in model.state_dict().items():
        mod = pname.rsplit(".", 1)[0]
        if mod in quantized:
            continue
        if pname == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
            continue
        tensors[pname] = p.detach().contiguous()

    _write_checkpoint(model, tok, out_dir, cfg, tensors, reports, channels_file, opts.force)
    return QuantizeResult(out_dir, cfg, reports, carve)


def _write_checkpoint(model, tok, out_dir, cfg, tensors, reports, channels_file, force) -> None:
    with folder_writer(out_dir, force, "quantize") as tmp:
        write_safetensors(tmp, tensors)
        hf_cfg = model.config.to_dict()
        hf_cfg["quantization_config"] = cfg.model_dump()
        hf_cfg["torch_dtype"] = "bfloat16"
        hf_cfg.pop("dtype", None)
        hf_cfg["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, default=str))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / schema.LAYER_REPORT_FILE).write_text(
            json.dumps(
                [dict(r.__dict__, reduction=r.reduction) for r in reports],
                indent=1,
                default=lambda v: None if isinstance(v, float) and math.isnan(v) else v,
            )
        )
        channels_file.write(tmp / schema.CHANNELS_FILE)


def prepare_channels_destination(out: str | Path, force: bool = False) -> Path:
    """The resolved ``out`` of a channels file, checked before any slow work: a folder there is refused; an
    existing file only with ``force``, and then only a channels file (:meth:`foursight.channels_file.ChannelsFile.read`
    accepts it); every refusal is a :class:`FileExistsError` naming it, and nothing is changed."""
    p = resolve_out(out)
    check_channels_destination(p)
    if p.exists() or p.is_symlink():
        if not force:
            raise FileExistsError(f"{p} exists; pass --force to replace it")
        if p.is_symlink() or not p.is_file():
            raise FileExistsError(f"refusing to replace {p} with --force: it is not a regular file; nothing was changed")
        try:
            ChannelsFile.read(p)
        except CheckpointError as e:
            raise FileExistsError(f"refusing to replace {p} with --force: it is not a channels file ({e}); nothing was changed, "
                                  "choose another --out") from None
    return p


def calibrate_channels(model_dir, out, channels="32", calib=None, ignore=("lm_head",), batch_size=8, max_length=256,
                       force: bool = False) -> Path:
    """``foursight calibrate``: calibrate the BF16 model in ``model_dir`` and write the channels file ``out``
    (no quantization), with the channel selection and the FP4-part amax ``quantize`` writes beside a checkpoint
    (:func:`prepare_channels_destination`: an existing file only with ``force``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = prepare_channels_destination(out, force)  # before the slow part
    schema.check_channel_spec(channels)
    check_calibration_batches(batch_size, max_length)
    cfg = schema.FourSightConfig(ignore=list(ignore))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    names = find_linears(model, cfg)
    check_model_quantizable(model, names)
    groups = collect_stats(model, tok, load_calibration_texts(calib), names, batch_size=batch_size, max_length=max_length)
    cf = ChannelsFile()
    for g in groups.values():
        choice = choose_channels(g, [], channels)
        cf.record(g.members, choice.channels, choice.fp4_amax)
    prepare_channels_destination(out, force)  # again: another run may have written it meanwhile
    return cf.write(out)
