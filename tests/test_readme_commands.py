"""README commands run as printed: the quantize command of "Run the main job" makes the packaged
SmolLM2 FourSight checkpoint, and the serve command starts vLLM's OpenAI server on it in the
install the README makes, which completes a prompt the way the model should. (The install and
test commands are what `.ci/run` runs.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def readme_bash_lines() -> list[str]:
    """Every command line of the README's ```bash blocks (continuations joined)."""
    text = (REPO / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        cur = ""
        for raw in block.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                cur += line[:-1].strip() + " "
                continue
            cur += line.strip()
            if cur and not cur.startswith("#"):
                lines.append(cur)
            cur = ""
    return lines


def test_readme_prints_a_serve_command():
    serve = [c for c in readme_bash_lines() if " serve " in f" {c} " and "bridge" not in c]
    assert serve == [".venv/bin/foursight serve out/smollm2-foursight --port 8000"], serve


@pytest.mark.vllm
@pytest.mark.realmodel
@pytest.mark.slow
def test_readme_quantize_and_serve_commands_as_printed_get_a_completion(smollm2_fs32_ckpt, tmp_path):
    """The README's serve command, parsed from README.md and run by bash in a folder laid out as
    the README's steps leave it (``.venv`` from setup.sh, ``out/smollm2-foursight`` from
    ``foursight quantize``, here the same command's cached output), answers ``/v1/completions``;
    greedy decoding of the capital-of-France prompt says Paris (the BF16 model does; a broken or
    random-weight load does not)."""
    pytest.importorskip("vllm")
    (cmd,) = [c for c in readme_bash_lines() if c.startswith(".venv/bin/foursight serve ")]
    port = int(shlex.split(cmd)[shlex.split(cmd).index("--port") + 1])
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            pytest.fail(f"port {port} (printed in README.md) is already in use; the README command cannot run as printed")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    # the README's quantize command, as printed, makes out/smollm2-foursight (~20 s); it must be
    # the checkpoint the tests' cached `quantize --channels 32` gives, bit for bit
    (quant,) = [c for c in readme_bash_lines() if c.startswith(".venv/bin/foursight quantize")]
    q = subprocess.run(["bash", "-c", quant], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert q.returncode == 0 and "wrote out/smollm2-foursight" in q.stdout, q.stdout[-3000:] + q.stderr[-3000:]
    from foursight.checkpoint import read_tensors

    got, ref = read_tensors(tmp_path / "out" / "smollm2-foursight"), read_tensors(smollm2_fs32_ckpt)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in got)
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "TORCHDYNAMO_DISABLE")}  # the command sets them
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": 6,
                                                      "temperature": 0.0, "logprobs": 1}, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert "Paris" in ch["text"], ch["text"]
        lps = ch["logprobs"]["token_logprobs"]
        assert len(lps) == 6 and all(v <= 0 for v in lps)
        text = log.read_text()
        assert "[foursight serve] VLLM_CPU_KVCACHE_SPACE=1 TORCHDYNAMO_DISABLE=1 " in text
        assert "--quantization foursight --enforce-eager" in text, text[-3000:]  # what vLLM was told (its INFO line is not always logged)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
