"""Tensor parallelism 2 in the real vLLM CPU engine (two worker processes on this 2-core box).

vLLM's CPU backend refuses TP=2 on one NUMA node unless the worker threads are bound by hand
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). A W4A16 checkpoint is used so that the comparison with
the unsharded PyTorch reference is not dominated by FP4 activation re-rounding (see
docs/vllm.md): the row-parallel layers (o_proj, down_proj) then split K with each rank keeping
only its BF16 channels, and the whole model must stay at BF16 implementation noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    def stage(msg):
        print(f"[tp2] {msg}", file=sys.stderr, flush=True)
    if __name__ == "__main__":
        from vllm import LLM
        from transformers import AutoTokenizer
        from foursight.hf import load_reference_model
        from foursight.calibration import builtin_texts
        from foursight.trainer_bridge.metrics import abs_diff_summary
        from helpers.logprobs import engine_prompt_logprobs, fixed_sequences
        from foursight.trainer_bridge.scoring import sequence_logprobs as hf_prompt_logprobs
        ck, out = sys.argv[1], sys.argv[2]
        tok = AutoTokenizer.from_pretrained(ck)
        seqs = fixed_sequences(tok, builtin_texts()[:4], 32)
        llm = LLM(model=ck, quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0,
                  tensor_parallel_size=2, distributed_executor_backend="mp")
        stage("engine up")
        eng = engine_prompt_logprobs(llm, seqs)
        stage("engine logprobs done")
        # Stop the engine and its two workers before the reference runs, so the reference does not
        # share the 2 cores with busy-polling workers and no engine thread is left to the
        # interpreter's teardown.
        llm.llm_engine.engine_core.shutdown()
        del llm
        stage("engine shut down")
        ref = hf_prompt_logprobs(load_reference_model(ck), seqs)
        with open(out, "w") as f:
            json.dump(abs_diff_summary(eng, ref), f)
        stage("result written")
        sys.stdout.flush()
        os._exit(0)  # the result is on disk; nothing left in this process needs a clean teardown
    """
)


def test_tp2_w4a16_matches_unsharded_reference(tiny_llama_dir, tmp_path):
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    ck = quantize_model(tiny_llama_dir, tmp_path / "a16", QuantizeConfig(channels="16", activations="bf16"), progress=False).out_dir
    script, out = tmp_path / "run_tp2.py", tmp_path / "res.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")])))  # tests/helpers
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    for attempt in (1, 2):
        r = subprocess.run([sys.executable, str(script), str(ck), str(out)], env=env, capture_output=True, text=True, timeout=600)
        stages = [ln for ln in r.stderr.splitlines() if ln.startswith("[tp2] ")]
        if r.returncode >= 0:
            break
        # Killed by a signal: once in CI (2026-12-05) the process aborted ("terminate called without
        # an active exception", SIGABRT) with no Python error; it never reproduced here in 4 runs.
        # One more run tells a flaky engine teardown from a real failure; a second death fails.
        print(f"\nTP=2 attempt {attempt} killed by signal {-r.returncode} after stages {stages}")
    assert r.returncode == 0, f"stages reached: {stages}\n" + r.stderr[-4000:]
    gap = json.loads(out.read_text())
    print(f"\nTP=2 W4A16 k=16 tiny llama: engine vs unsharded reference |Δ| mean {gap['mean']:.4f} max {gap['max']:.4f}")
    # TP=1 BF16 engine vs HF BF16 on this model: ~0.011 mean, ~0.08 max
    assert gap["mean"] < 0.05 and gap["max"] < 0.3
