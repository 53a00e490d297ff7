"""Weight updates into an *unquantized* (BF16) vLLM CPU engine, the baseline an RL user compares
FourSight against. vLLM's CPU backend pre-packs unquantized linear weights and leaves the
parameter empty, so a plain ``load_weights`` failed ("load weight [128, 256] into parameter [0]").

Oracle: a fresh engine loaded from a folder holding the new weights (same load, same re-pack)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.calibration import builtin_texts  # noqa: E402
from helpers.checkpoints import folder_with  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from helpers.vllm_engine import engine_model, fresh_logprobs, make_llm  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = pytest.mark.vllm
def test_bf16_engine_update_equals_a_fresh_load_and_handles_half_a_fused_layer(tiny_llama_dir, tmp_path):
    """A whole update equals a fresh load of the new weights. Then an update of q_proj alone (half
    of the fused qkv_proj): where vLLM's CPU backend pre-packed the unquantized weight (oneDNN on
    AVX-512 BF16 hosts) the layer cannot take one shard, so the update is refused naming the fused
    layer before anything is loaded, and weights and version stay; where the weight is kept (the
    F.linear fallback of AVX2 hosts, and GPUs) it is applied, and equals a fresh load of the mixed
    weights. Which branch runs depends on the host; the test says which."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from foursight.quant_methods.vllm_weight_update import cpu_packed_linears

    new = perturbed_state(tiny_llama_dir, seed=5)
    save_file(new, str(tmp_path / "update.safetensors"))
    q0 = "model.layers.0.self_attn.q_proj.weight"
    q_old = load_file(str(tiny_llama_dir / "model.safetensors"))[q0]
    assert not torch.equal(q_old, new[q0])
    save_file({q0: q_old}, str(tmp_path / "q-only.safetensors"))
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), builtin_texts()[:3], 32)
    lp_fresh = fresh_logprobs(folder_with(tiny_llama_dir, tmp_path / "new-model", new), seqs)

    llm = make_llm(tiny_llama_dir)
    try:
        packed = bool(cpu_packed_linears(engine_model(llm)))
        lp_old = engine_prompt_logprobs(llm, seqs)
        (info,) = llm.collective_rpc("foursight_update_weights", args=(str(tmp_path / "update.safetensors"), 7))
        assert info["version"] == 7 and info["updated_tensors"] == len(new)
        llm.reset_prefix_cache()
        lp_new = engine_prompt_logprobs(llm, seqs)
        assert all(torch.equal(x, y) for x, y in zip(lp_new, lp_fresh))
        assert max(float((x - y).abs().max()) for x, y in zip(lp_new, lp_old)) > 0.05

        print(f"\nunquantized weights pre-packed by vLLM's CPU backend: {packed}")
        if packed:
            with pytest.raises(Exception, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight \(got q_proj; missing k_proj, v_proj\)"):
                llm.collective_rpc("foursight_update_weights", args=(str(tmp_path / "q-only.safetensors"), 8))
            assert llm.collective_rpc("foursight_weight_version") == [7]
            llm.reset_prefix_cache()
            assert all(torch.equal(x, y) for x, y in zip(engine_prompt_logprobs(llm, seqs), lp_fresh))
            return
        (info,) = llm.collective_rpc("foursight_update_weights", args=(str(tmp_path / "q-only.safetensors"), 8))
        assert info["version"] == 8 and info["updated_tensors"] == 1
        llm.reset_prefix_cache()
        lp_half = engine_prompt_logprobs(llm, seqs)
    finally:
        del llm
        gc.collect()
    lp_mixed = fresh_logprobs(folder_with(tiny_llama_dir, tmp_path / "mixed-model", {**new, q0: q_old}), seqs)
    assert all(torch.equal(x, y) for x, y in zip(lp_half, lp_mixed))
    assert max(float((x - y).abs().max()) for x, y in zip(lp_half, lp_fresh)) > 0.01
