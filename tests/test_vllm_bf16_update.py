"""Weight updates into an *unquantized* (BF16) vLLM CPU engine, the baseline an RL user compares
FourSight against. vLLM's CPU backend pre-packs unquantized linear weights and leaves the
parameter empty, so a plain ``load_weights`` failed ("load weight [128, 256] into parameter [0]").

Oracle: a fresh engine loaded from a folder holding the new weights (same load, same re-pack)."""

from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.models import builtin_texts  # noqa: E402
from foursight.quant_methods.vllm_eval import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from weight_helpers import perturbed_state  # noqa: E402

pytestmark = pytest.mark.vllm
EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"


def _llm(path):
    from vllm import LLM

    return LLM(model=str(path), enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0, worker_extension_cls=EXT)


def test_bf16_engine_update_equals_a_fresh_load_and_refuses_half_a_fused_layer(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    new = perturbed_state(tiny_llama_dir, seed=5)
    fresh_dir = tmp_path / "new-model"
    shutil.copytree(tiny_llama_dir, fresh_dir)
    merged = load_file(str(fresh_dir / "model.safetensors"))
    merged.update(new)
    save_file(merged, str(fresh_dir / "model.safetensors"))
    save_file(new, str(tmp_path / "update.safetensors"))
    q0 = "model.layers.0.self_attn.q_proj.weight"
    save_file({q0: new[q0]}, str(tmp_path / "q-only.safetensors"))
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), builtin_texts()[:3], 32)

    llm = _llm(fresh_dir)
    try:
        lp_fresh = engine_prompt_logprobs(llm, seqs)
    finally:
        del llm
        gc.collect()

    llm = _llm(tiny_llama_dir)
    try:
        lp_old = engine_prompt_logprobs(llm, seqs)
        (info,) = llm.collective_rpc("foursight_update_weights", args=(str(tmp_path / "update.safetensors"), 7))
        assert info["version"] == 7 and info["updated_tensors"] == len(new)
        llm.reset_prefix_cache()
        lp_new = engine_prompt_logprobs(llm, seqs)
        assert all(torch.equal(x, y) for x, y in zip(lp_new, lp_fresh))
        assert max(float((x - y).abs().max()) for x, y in zip(lp_new, lp_old)) > 0.05

        # half of a fused q/k/v: refused naming the fused layer, which keeps its weights; version stays
        with pytest.raises(Exception, match=r"model\.layers\.0\.self_attn\.qkv_proj"):
            llm.collective_rpc("foursight_update_weights", args=(str(tmp_path / "q-only.safetensors"), 8))
        assert llm.collective_rpc("foursight_weight_version") == [7]
        llm.reset_prefix_cache()
        assert all(torch.equal(x, y) for x, y in zip(engine_prompt_logprobs(llm, seqs), lp_fresh))
    finally:
        del llm
        gc.collect()
