"""vLLM in this process (``vllm.LLM``) as ``foursight rl``'s rollout engine (the CPU smoke path).

:class:`VLLMRollout` serves a FourSight checkpoint written by :func:`foursight.checkpoint.quantize_model`
(k=0 for ``nvfp4``) and takes the learner's weights every step through the FourSight worker
extension ``foursight_update_weights`` (a BF16 safetensors file). The CPU build runs it in CI;
vLLM served over HTTP is :mod:`foursight.trainer_bridge.backends.vllm`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from foursight.trainer_bridge.backends.base import EngineError, RolloutSetup
from foursight.trainer_bridge.protocol import Rollout


class VLLMRollout:
    """vLLM rollout engine (in-process ``LLM``; CPU build in CI): a FourSight checkpoint written by
    :func:`foursight.checkpoint.quantize_model` (k=0 for ``nvfp4``), weights synced every step
    through the worker extension ``foursight_update_weights`` (a BF16 safetensors file).

    The checkpoint and the update file live in ``workdir``; without one, a temporary folder that
    :meth:`close` removes (it holds a whole quantized checkpoint)."""

    EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"
    #: the rollout model lives in vLLM, not as a module of this process (RolloutEngine.model)
    model = None

    def __init__(self, model_dir: Path, tok, precision: str, channels_spec: str, workdir: Path | None = None,
                 max_model_len: int = 512, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if precision not in ("nvfp4", "foursight"):
            # vLLM-CPU re-packs plain BF16 linear weights after loading, so its own load_weights
            # cannot update them in place; the FourSight worker extension handles FourSight layers.
            raise EngineError("VLLMRollout: the precision must be nvfp4 or foursight (weights are synced through "
                          "the FourSight worker extension); use the HF rollout engine for bf16")
        self.tok, self.precision = tok, precision
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="foursight-rl-")) if workdir is None else Path(workdir)
        self.llm = None
        try:
            from foursight.checkpoint import quantize_model
            from foursight.quantize_config import QuantizeConfig

            k = channels_spec if precision == "foursight" else "0"
            src = quantize_model(model_dir, self.workdir / f"ckpt-{precision}", QuantizeConfig(channels=k), progress=False).out_dir
            self.llm = LLM(model=str(src), enforce_eager=True, max_model_len=max_model_len, dtype="bfloat16", seed=seed,
                           worker_extension_cls=self.EXT, logprobs_mode="raw_logprobs")
        except BaseException:
            self.close()
            raise
        self.version = 0
        self.last_update: dict[str, Any] = {}

    @classmethod
    def for_rl(cls, setup: RolloutSetup) -> "VLLMRollout":
        return cls(setup.model_dir, setup.tok, setup.precision, setup.channels_spec, seed=setup.seed)  # its own temporary folder

    def sync(self, learner: Any, version: int) -> dict[str, Any]:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        sd = {n: p.detach().to(torch.bfloat16).cpu().contiguous() for n, p in learner.named_parameters()}
        path = self.workdir / "update.safetensors"
        save_file(sd, str(path))
        info = dict(self.llm.collective_rpc("foursight_update_weights", args=(str(path), version))[0])
        self.version = version
        info["sync_s"] = time.perf_counter() - t0
        self.last_update = info
        return info

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens, logprobs=0, seed=seed)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        res = []
        for p, o in zip(prompts, outs):
            for c in o.outputs:
                toks = list(c.token_ids)
                lps = [float(d[t].logprob) for t, d in zip(toks, c.logprobs)]
                res.append(Rollout(prompt_ids=list(p), token_ids=toks, logprobs=lps, finish_reason=c.finish_reason or "length"))
        return res

    def close(self) -> None:
        """Release the engine and remove the temporary folder (when this object made it)."""
        import gc

        self.llm = None
        gc.collect()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
