"""``foursight serve`` on a GPU (vLLM's OpenAI server, its defaults: compile and CUDA graphs), the bridge in
front of it, the official ``openai`` client through the bridge, and a weight update through the bridge's route.

The BF16 SmolLM2 folder is served with ``--quantization foursight`` (online, the k = 32 channels of its
FourSight checkpoint), as an RL user serves the policy. Oracle of the update: a fresh server on the new
weights, same command, scores the same sequences bit for bit the same. Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from foursight.calibration import builtin_texts  # noqa: E402
from helpers.checkpoints import folder_with  # noqa: E402
from helpers.logprobs import fixed_sequences, server_prompt_logprobs  # noqa: E402
from helpers.vllm_engine import EXT  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.realmodel, pytest.mark.slow]


def foursight_serve(model: Path, channels: Path, weights_dir: Path, log: Path, token: str):
    """``foursight serve MODEL`` exactly as a user types it, plus what the bridge needs from the engine (the worker
    extension, vLLM's dev routes, the weights token and folder)."""
    from foursight.schema import ENV_WEIGHTS_DIR, ENV_WEIGHTS_TOKEN
    from foursight.trainer_bridge.launch import ServerProcess, free_port

    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from foursight.cli import main; sys.argv[0] = 'foursight'; main()", "serve", str(model),
           "--port", str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.15", "--worker-extension-cls", EXT]
    env = {**os.environ, "FOURSIGHT_CHANNELS_FILE": str(channels), "VLLM_SERVER_DEV_MODE": "1", ENV_WEIGHTS_TOKEN: token,
           ENV_WEIGHTS_DIR: str(weights_dir.resolve())}
    env.pop("TORCHDYNAMO_DISABLE", None)
    srv = ServerProcess(cmd, env, port, log)
    srv.what = "foursight serve"
    return srv.start(timeout_s=420)


def test_serve_bridge_openai_client_and_update(smollm2_dir, tmp_path):
    import httpx
    import openai
    from safetensors.torch import save_file

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.client import RolloutClient
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app
    from transformers import AutoTokenizer

    ck = quantize_model(smollm2_dir, tmp_path / "fs32", QuantizeConfig(channels="32"), progress=False).out_dir
    channels = ck / "foursight_channels.json"
    wdir = tmp_path / "weights"
    wdir.mkdir()
    new = {n: t.contiguous() for n, t in perturbed_state(smollm2_dir, seed=5).items()}
    save_file(new, str(wdir / "step1.safetensors"))
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(smollm2_dir), builtin_texts()[:6], 48)
    token = secrets.token_hex(16)

    srv = foursight_serve(Path(smollm2_dir), channels, wdir, tmp_path / "serve.log", token)
    bridge = None
    try:
        log = (tmp_path / "serve.log").read_text(errors="replace")
        assert "enforce_eager=True" not in log and "--enforce-eager" not in log, "foursight serve ran vLLM eagerly on a GPU"
        bridge = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=smollm2_dir, weights_token=token)], weights_dirs=[wdir])).start()
        client = openai.OpenAI(base_url=bridge.url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=12, temperature=0.0, logprobs=1)
        lp = c.choices[0].logprobs.token_logprobs
        assert c.choices[0].text.strip() and len(lp) == 12 and all(x is not None and x <= 0 for x in lp), c
        own = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": 12,
                                                            "temperature": 0.0, "logprobs": 1}, timeout=120).json()
        assert own["choices"][0]["text"] == c.choices[0].text  # the bridge serves what the engine generates
        before = server_prompt_logprobs(srv.url, seqs)
        with RolloutClient(bridge.url) as rc:
            ack = rc.update_weights(version=1, path=str(wdir / "step1.safetensors"))
        assert ack["version"] == 1, ack
        after = server_prompt_logprobs(srv.url, seqs)
        assert not all(torch.equal(a, b) for a, b in zip(before, after)), "the update changed nothing"
    finally:
        if bridge is not None:
            bridge.stop()
        srv.stop()
    fresh_dir = folder_with(Path(smollm2_dir), tmp_path / "bf16-step1", new)
    srv2 = foursight_serve(fresh_dir, channels, wdir, tmp_path / "serve2.log", token)
    try:
        fresh = server_prompt_logprobs(srv2.url, seqs)
    finally:
        srv2.stop()
    assert all(torch.equal(a, b) for a, b in zip(after, fresh)), max(float((a - b).abs().max()) for a, b in zip(after, fresh))
