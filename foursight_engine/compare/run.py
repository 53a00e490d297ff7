"""The ``foursight compare`` driver (checkpoints, rollouts once, every engine scores, the report):
:func:`run_compare`, and the command's body, :func:`compare`. The command is :func:`foursight.cli.compare`,
which imports this module only when it runs (``foursight --help`` does not import torch)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from foursight.compare.attribution import attribute_layers
from foursight.compare.config import CompareConfig
from foursight.compare.launch import default_sglang_python, drive, open_engine
from foursight.compare.prompts import load_prompts
from foursight.compare.report import engine_metrics, pairwise, print_table, write_plots, write_report
from foursight.compare.spec import LEARNER, CompareError, EngineSpec, parse_engine_urls, parse_engines
from foursight.precisions import CHANNEL_PRECISIONS, NVFP4_PRECISIONS
from foursight.trainer_bridge.metrics import abs_diff_summary
from foursight.trainer_bridge.protocol import Rollout


def ensure_checkpoints(model_dir: Path, precisions: set[str], channels: str, workdir: Path,
                       foursight_ckpt: Optional[Path], nvfp4_ckpt: Optional[Path]) -> dict[str, Path]:
    """BF16 folder and the FourSight / plain-NVFP4 / W4A16 checkpoints the engines need (quantized once, reused)."""
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.tensor_io import read_quant_config

    dirs = {"bf16": model_dir, "fp8": model_dir}  # fp8: the BF16 model, quantized in memory by the HF engine
    for prec, given in (("foursight", foursight_ckpt), ("nvfp4", nvfp4_ckpt)):  # checked before any quantization
        if given is None:
            continue
        flag = f"--{prec}-ckpt {given}"
        if prec not in precisions:
            raise CompareError(f"{flag}: no engine of this run has precision {prec}; nothing would use that checkpoint")
        try:
            qc = read_quant_config(given)
        except ValueError as e:
            raise CompareError(f"{flag}: {e}") from None
        if prec == "nvfp4" and any(qc.channels.values()):
            raise CompareError(f"{flag}: it keeps BF16 channels; the nvfp4 precision needs a plain-NVFP4 (k = 0) checkpoint "
                               "(`foursight quantize --channels 0`)")
        dirs[prec] = Path(given)
    for prec in NVFP4_PRECISIONS:  # the precisions served from a FourSight checkpoint
        if prec not in precisions or prec in dirs:
            continue
        ch = channels if prec in CHANNEL_PRECISIONS else "0"
        dst = workdir / f"{model_dir.name}-{prec}-k{ch.replace('%', 'pct')}"
        if not (dst / "config.json").exists():
            quantize_model(model_dir, dst, QuantizeConfig(channels=ch, activations="bf16" if prec == "w4a16" else "nvfp4"), progress=True)
        dirs[prec] = dst
    return dirs


def run_compare(model_dir: Path, engines: list[EngineSpec], cfg: CompareConfig | Path, **overrides) -> dict:
    """Run the whole comparison and write the report; returns the metrics dict.

    ``cfg`` is the run's :class:`CompareConfig` (or just its ``out`` folder, the other options from
    ``overrides`` and the config's defaults). ``engines`` are the parsed ``cfg.engines``. ``api_key`` is sent
    (``Authorization: Bearer``) to the servers given in ``engine_url``."""
    cfg = CompareConfig(out=Path(cfg), **overrides) if isinstance(cfg, (str, Path)) else dataclasses.replace(cfg, **overrides)
    out, n, max_tokens, temperature, seed, channels = cfg.out, cfg.n, cfg.max_tokens, cfg.temperature, cfg.seed, cfg.channels
    tail_threshold, max_model_len, api_key = cfg.tail_threshold, cfg.max_model_len, cfg.api_key
    from transformers import AutoTokenizer

    urls = parse_engine_urls(cfg.engine_url or [])
    gen = EngineSpec.parse(cfg.generator) if cfg.generator else engines[0]
    if gen.name not in {e.name for e in engines}:
        engines = [gen, *engines]
    specs = list(engines)
    if LEARNER not in {e.name for e in specs}:
        specs.append(EngineSpec("hf", "bf16"))
    unused = sorted(set(urls) - {e.name for e in specs})
    if unused:
        raise CompareError(f"--engine-url {unused[0]}: not an engine of this run (--engines {cfg.engines}"
                           + (f", --generator {cfg.generator}" if cfg.generator else "") + "); nothing would use that server")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = load_prompts(cfg.prompts, n, tok)  # before the checkpoints: a bad --prompts fails at once
    out.mkdir(parents=True, exist_ok=True)
    dirs = ensure_checkpoints(model_dir, {e.precision for e in specs}, channels, out / "checkpoints", cfg.foursight_ckpt, cfg.nvfp4_ckpt)
    sglang_python = cfg.sglang_python or default_sglang_python()

    t0 = time.time()
    order = [gen] + [e for e in specs if e != gen]
    scores: dict[str, list[torch.Tensor]] = {}
    rollouts: list[Rollout] = []
    for spec in order:
        engine, srv = open_engine(spec, dirs, urls, out / "logs", sglang_python, max_model_len, api_key)
        try:
            rollouts, scores[spec.name] = asyncio.run(drive(engine, spec.name, 1 if spec.row.in_process else 8,
                                                             prompt_ids if spec == gen else None, max_tokens, temperature, seed,
                                                             rollouts))
        finally:
            if srv is not None:
                srv.stop()
    learner = scores[LEARNER]
    result = {
        "config": {"model": str(model_dir), "engines": [e.name for e in engines], "generator": gen.name, "n": len(rollouts),
                   "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "channels": channels,
                   "tail_threshold": tail_threshold, "checkpoints": {k: str(v) for k, v in dirs.items()}, "command": cfg.command},
        "num_tokens": int(sum(len(s) for s in learner)),
        "engines": {e.name: engine_metrics(learner, scores[e.name], tail_threshold) for e in engines if e.name != LEARNER},
        "pairwise": pairwise({e.name: scores[e.name] for e in specs}),
        "generator_self_check": {},
        "seconds": 0.0,
    }
    if any(r.logprobs for r in rollouts):
        # the generator's own sampling logprobs against its own teacher-forced scoring (should be ~0)
        pairs = [(r.logprobs, s) for r, s in zip(rollouts, scores[gen.name]) if r.logprobs]
        s = abs_diff_summary(*zip(*pairs))
        if s["tokens"]:
            result["generator_self_check"] = {"mean_abs": s["mean"], "max_abs": s["max"]}
    if cfg.attribute:
        k = min(cfg.attribute_n, len(rollouts))
        result["attribution"] = attribute_layers(model_dir, rollouts[:k], learner[:k], by=cfg.attribute_by)
    result["seconds"] = time.time() - t0
    plots = write_plots(out, learner, {e.name: scores[e.name] for e in specs}, tail_threshold)
    (out / "metrics.json").write_text(json.dumps(result, indent=2))
    torch.save({"rollouts": [r.model_dump() for r in rollouts], "scores": scores}, out / "scores.pt")
    write_report(out, result, plots)
    print_table(result)
    return result


def compare(cfg: CompareConfig) -> None:
    """The body of ``foursight compare`` (the command and its help are :func:`foursight.cli.compare`, which
    imports this module only when the command runs): parse ``--engines``, run, say where the report is."""
    from foursight.models import resolve_model

    specs = parse_engines(cfg.engines)
    if cfg.attribute_by not in ("type", "block"):
        raise CompareError("--attribute-by must be 'type' or 'block'")
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        cfg = dataclasses.replace(cfg, command="foursight compare " + " ".join(sys.argv[2:]))
    run_compare(resolve_model(cfg.model), specs, cfg)
    print(f"report: {cfg.out / 'report.md'}")
