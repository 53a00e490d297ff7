"""``foursight rl``'s in-process HF rollout engine (:class:`HFRollout`): a copy of the learner in the
rollout precision, synced through the bridge's HF weight sync
(:meth:`~foursight.trainer_bridge.backends.hf.HFEngine.load_tensors_sync`) and sampled in batches by
the one HF sampler (:func:`~foursight.trainer_bridge.hf_sampling.hf_generate`)."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from foursight.trainer_bridge import hf_sampling
from foursight.trainer_bridge.backends.base import EngineError, RolloutSetup
from foursight.trainer_bridge.backends.hf import HFEngine
from foursight.trainer_bridge.protocol import Rollout


class HFRollout:
    """In-process rollout engine: a copy of the learner in BF16, FP8 rowwise W8A8
    (:func:`foursight.hf.quantize_hf_model_fp8`), NVFP4 k=0, FourSight W4A4 or FourSight W4A16
    (:func:`foursight.hf.quantize_hf_model`, ``act_quant=False``).

    Weights are synced through the bridge's HF engine (:meth:`HFEngine.load_tensors_sync`):
    ``sync="inproc"`` hands it the learner's tensors, ``sync="file"`` a BF16 safetensors file.
    Samples come from :func:`~foursight.trainer_bridge.hf_sampling.hf_generate` (the one HF sampler).
    """

    def __init__(self, learner: Any, tok, precision: str, channels: dict[str, Any] | None,
                 sync: str = "inproc", ignore=("lm_head",)):
        from foursight.hf import quantize_hf_model, quantize_hf_model_fp8

        if sync not in ("inproc", "file"):
            raise EngineError(f"HFRollout sync: expected 'inproc' or 'file', got {sync!r}")
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
            raise EngineError(f"HFRollout precision: unknown {precision!r}")
        self.version = 0
        self._engine = None
        self.last_update: dict[str, Any] = {}

    @classmethod
    def for_rl(cls, setup: RolloutSetup) -> "HFRollout":
        return cls(setup.learner, setup.tok, setup.precision, setup.channels, sync=setup.sync, ignore=setup.ignore)

    def sync(self, learner: Any, version: int) -> dict[str, Any]:
        """Push the learner's weights (cast to BF16) into the engine and re-quantize its FourSight
        (or FP8) layers, through the bridge's HF weight sync (:meth:`HFEngine.load_tensors_sync`): from the
        tensors directly (``inproc``) or from a safetensors file (``file``)."""
        t0 = time.perf_counter()
        if self._engine is None:
            self._engine = HFEngine(model=self.model)
        sd = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in learner.named_parameters()}
        if self.sync_mode == "file":
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory(prefix="foursight-rl-") as d:
                path = str(Path(d) / "model.safetensors")
                save_file({n: t.cpu() for n, t in sd.items()}, path)
                info = self._engine.update_weights_sync(path, version)
        else:
            info = self._engine.load_tensors_sync(sd, version)
        self.version = version
        info["sync_s"] = time.perf_counter() - t0
        self.last_update = info
        return info

    def generate(self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, seed: int) -> list[Rollout]:
        """``n`` samples per prompt, grouped contiguously (prompt 0's n samples first), at
        temperature 1 over the full vocabulary: the raw logprobs are the sampling distribution."""
        flat = [list(p) for p in prompts for _ in range(n)]
        return hf_sampling.hf_generate(self.model, flat, max_new_tokens, eos_ids=hf_sampling.eos_ids(self.model, self.tok),
                                       seed=seed)

    def close(self) -> None:
        self.model = None
