"""In-process vLLM engines for the tests (CPU build): start one, reach its model, close it, and the
teacher-forced logprobs of a fresh engine (in this process or in a subprocess of its own)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from helpers.logprobs import engine_prompt_logprobs

#: the FourSight worker extension (weight updates through ``collective_rpc``)
EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"


def make_llm(model: str | Path, **kw):
    """``vllm.LLM`` on ``model`` with the tests' settings (eager, 256 tokens, BF16, seed 0, the FourSight
    worker extension); ``kw`` adds or overrides (e.g. ``quantization="foursight"``). In process (so that
    :func:`engine_model` reaches the model) where the test module set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
    from vllm import LLM

    args = dict(enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0, worker_extension_cls=EXT)
    args.update(kw)
    return LLM(model=str(model), **args)


def engine_model(llm) -> torch.nn.Module:
    """The ``torch.nn.Module`` an in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) engine runs."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def close(llm) -> None:
    del llm
    gc.collect()


def fresh_logprobs(model: str | Path, seqs, **kw) -> list[torch.Tensor]:
    """Teacher-forced logprobs of ``seqs`` from a new engine on ``model`` (:func:`make_llm` ``**kw``), closed after."""
    llm = make_llm(model, **kw)
    try:
        return engine_prompt_logprobs(llm, seqs)
    finally:
        close(llm)


def subprocess_prompt_logprobs(ckpt: Path, workdir: Path, n_texts: int = 4, max_len: int = 32) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Teacher-forced logprobs of vLLM ``--quantization foursight`` on ``ckpt``, in a subprocess of its
    own (an engine that never shares this process's state), on the first ``n_texts`` built-in texts
    (``max_len`` tokens). Returns (the token sequences, one float64 tensor per sequence)."""
    return subprocess_prompt_logprobs_each([ckpt], workdir, n_texts, max_len)[0]


def subprocess_prompt_logprobs_each(ckpts: list[Path], workdir: Path, n_texts: int = 4,
                                    max_len: int = 32) -> list[tuple[list[list[int]], list[torch.Tensor]]]:
    """:func:`subprocess_prompt_logprobs` for several checkpoints in ONE subprocess (Python, torch and vLLM
    imported once: about 10 s saved per checkpoint on 2 cores): one engine per checkpoint, in the order
    given, each built after the previous one is closed; each checkpoint's sequences come from its own
    tokenizer. Returns (sequences, logprobs) per checkpoint. A caller comparing two of them for equality
    should also compare two that must differ, placed between them: an engine that kept its predecessor's
    weights would make equal what is not."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    script = textwrap.dedent(f"""
        import gc, os, sys, json
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TORCHDYNAMO_DISABLE="1")
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        if __name__ == "__main__":
            from vllm import LLM
            from transformers import AutoTokenizer
            from foursight.calibration import builtin_texts
            from helpers.logprobs import engine_prompt_logprobs, fixed_sequences
            out = []
            for ckpt in {[str(c) for c in ckpts]!r}:
                llm = LLM(model=ckpt, quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16")
                seqs = fixed_sequences(AutoTokenizer.from_pretrained(ckpt), builtin_texts()[:{n_texts}], {max_len})
                lps = engine_prompt_logprobs(llm, seqs)
                out.append({{"seqs": seqs, "lps": [x.tolist() for x in lps]}})
                del llm
                gc.collect()
            print("RESULT" + json.dumps(out))
    """)
    (workdir / "s.py").write_text(script)
    r = subprocess.run([sys.executable, str(workdir / "s.py")], capture_output=True, text=True, timeout=900 * len(ckpts), cwd=workdir,
                       env={**os.environ})
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[6:])
    return [(x["seqs"], [torch.tensor(v, dtype=torch.float64) for v in x["lps"]]) for x in res]
