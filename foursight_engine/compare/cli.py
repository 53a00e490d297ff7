"""``foursight compare``: the command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from foursight.cli_util import DEFAULT_CHANNELS, ChannelsOption, ModelOption, guarded
from foursight.compare.run import run_compare
from foursight.compare.spec import CompareError, parse_engines
from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD


@guarded
def compare_command(
    model: ModelOption = None,
    engines: str = typer.Option("hf:bf16,vllm:bf16,vllm:foursight,vllm:nvfp4", "--engines",
                                help="Comma list of KIND:PRECISION (KIND hf|vllm|sglang, PRECISION bf16|foursight|nvfp4|w4a16|fp8; fp8 is hf only)."),
    prompts: str = typer.Option("builtin", "--prompts", help="Prompt source: 'builtin' or a JSONL file (prompt/text or messages per line)."),
    n: int = typer.Option(64, "--n", min=1, help="Number of rollouts (prompts are cycled)."),
    max_tokens: int = typer.Option(128, "--max-tokens", min=1, help="Completion length cap."),
    out: Path = typer.Option(Path("report"), "--out", help="Report folder (report.md, metrics.json, plots)."),
    generator: Optional[str] = typer.Option(None, "--generator", help="KIND:PRECISION that samples the rollouts (default: the first of --engines)."),
    channels: ChannelsOption = DEFAULT_CHANNELS,
    temperature: float = typer.Option(1.0, "--temperature", min=0.0, help="Sampling temperature of the generator (0 = greedy)."),
    seed: int = typer.Option(0, "--seed", help="Rollout i is sampled with seed + i."),
    engine_url: Optional[list[str]] = typer.Option(None, "--engine-url", help="KIND:PRECISION=URL of a running server (repeatable)."),
    foursight_ckpt: Optional[Path] = typer.Option(None, "--foursight-ckpt", help="Use this FourSight checkpoint instead of quantizing."),
    nvfp4_ckpt: Optional[Path] = typer.Option(None, "--nvfp4-ckpt", help="Use this plain-NVFP4 (k=0) checkpoint instead of quantizing."),
    tail_threshold: float = typer.Option(DEFAULT_TAIL_THRESHOLD, "--tail-threshold", min=0.0,
                                         help="τ in nats: a token is a tail token when |Δlogp| > τ (default ln 3, as the filters)."),
    attribute: bool = typer.Option(False, "--attribute", help="Rank layer groups by the NVFP4 mismatch they cause (HF engine)."),
    attribute_by: str = typer.Option("type", "--attribute-by", help="type (q_proj, ... across blocks) or block."),
    attribute_n: int = typer.Option(16, "--attribute-n", min=1, help="Rollouts used by --attribute."),
    sglang_python: Optional[str] = typer.Option(None, "--sglang-python", help="Python of the SGLang venv (default .venv-sglang)."),
    max_model_len: int = typer.Option(1024, "--max-model-len", min=16, help="--max-model-len of the vLLM servers compare starts."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FOURSIGHT_ENGINE_API_KEY",
                                          help="API key for the servers given by --engine-url (sent as Authorization: Bearer KEY)."),
):
    """Measure training-inference mismatch across engines and precisions; write report.md, metrics.json and plots.

    The first of --engines generates the rollouts unless --generator is given; every engine and the
    learner (HF BF16) then score the identical tokens teacher-forced. FourSight/NVFP4 checkpoints are
    made with `foursight quantize` (--channels) unless given.
    """
    from foursight.models import resolve_model

    specs = parse_engines(engines)
    if attribute_by not in ("type", "block"):
        raise CompareError("--attribute-by must be 'type' or 'block'")
    src = resolve_model(model)
    run_compare(src, specs, out, prompts=prompts, n=n, max_tokens=max_tokens, temperature=temperature, seed=seed,
                generator=generator, channels=channels, engine_urls=engine_url or [], foursight_ckpt=foursight_ckpt,
                nvfp4_ckpt=nvfp4_ckpt, tail_threshold=tail_threshold, attribute=attribute, attribute_by=attribute_by,
                attribute_n=attribute_n, sglang_python=sglang_python, max_model_len=max_model_len, api_key=api_key,
                command="foursight compare " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 and sys.argv[1] == "compare" else "")
    print(f"report: {out / 'report.md'}")
