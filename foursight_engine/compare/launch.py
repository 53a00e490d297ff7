"""How ``foursight compare`` launches and drives its engines: :func:`open_engine` starts (or reaches)
one backend of :mod:`foursight.trainer_bridge.backends` with its server, :func:`drive` samples and
teacher-force scores through it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch

from foursight.compare.spec import CompareError, EngineSpec
from foursight.trainer_bridge.protocol import Rollout


async def drive(engine, desc: str, concurrency: int, prompts: list[list[int]] | None, max_tokens: int, temperature: float,
                 seed: int, rollouts: list[Rollout] | None) -> tuple[list[Rollout], list[torch.Tensor]]:
    """Start ``engine``; sample ``prompts`` (when given, prompt ``i`` with seed ``seed + i``) and
    then teacher-force score the rollouts (the sampled ones, or ``rollouts``); stop it."""
    from tqdm.auto import tqdm

    from foursight.trainer_bridge.protocol import SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def each(items, fn, what):
        bar = tqdm(total=len(items), desc=f"{what} {desc}", unit="seq")

        async def one(i, it):
            async with sem:
                out = await fn(i, it)
                bar.update(1)
                return out

        try:
            return await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
        finally:
            bar.close()

    await engine.start()
    try:
        if prompts is not None:
            sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0)
            rollouts = [r for r in await each(prompts, lambda i, p: engine.generate(p, sp, max_tokens, seed + i), "generate") if r.token_ids]
            if not rollouts:
                raise RuntimeError(f"{desc} generated no tokens")
        scores = await each(rollouts, lambda i, r: engine.score(r.prompt_ids, r.token_ids), "score")
    finally:
        await engine.aclose()
    return rollouts, [torch.tensor(v, dtype=torch.float64) for v in scores]


def default_sglang_python() -> str:
    """The SGLang venv's python (``$FOURSIGHT_SGLANG_PYTHON``, else ``.venv-sglang`` beside the repo)."""
    env = os.environ.get("FOURSIGHT_SGLANG_PYTHON")
    if env:
        return env
    repo = Path(__file__).resolve().parents[2]
    return str(repo / ".venv-sglang" / "bin" / "python")


def open_engine(spec: EngineSpec, model_dirs: dict[str, Path], urls: dict[str, str], logs: Path, sglang_python: str,
                max_model_len: int, api_key: str | None = None):
    """Start (or connect to) one engine through its row of the engine registry: ``(backend, server or None)``.
    An in-process kind loads the precision's model folder here; a server kind is reached at its ``--engine-url``
    (``api_key`` goes to it), else its launcher starts a server (none of them has a key)."""
    from foursight.trainer_bridge.backends.registry import load

    row = spec.row
    src = model_dirs[spec.precision]
    if row.in_process is not None:
        engine = load(row.in_process)
        if spec.precision == "fp8":
            import torch
            from transformers import AutoModelForCausalLM

            from foursight.hf import quantize_hf_model_fp8

            model = quantize_hf_model_fp8(AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval())
            return engine(model=model, tokenizer=src), None
        return engine(src), None
    backend = load(row.server)
    if spec.name in urls:
        return backend(urls[spec.name], api_key=api_key), None
    if row.launcher is None:
        raise CompareError(f"--engines {spec.name}: compare cannot start a {row.title} server; give one with --engine-url {spec.name}=URL")
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--quantization", "foursight"] if spec.precision != "bf16" else []
    srv = load(row.launcher)(src, log_path=logs / f"{spec.kind}-{spec.precision}.log", extra_args=extra, max_model_len=max_model_len,
                             python=sglang_python)
    return backend(srv.url), srv
