"""One weight copy inside the engine (issue 36 item 6) on vLLM's own load road: a vLLM CPU engine serving
a FourSight checkpoint, its linears re-processed by the plugin with the ``triton`` backend (the fragment
form a GPU engine holds; built on the CPU, no kernel runs), so that the plugin releases the checkpoint
codes and block scales; then the trainer's sync as TRL colocate runs it (``model.load_weights`` with one
BF16 tensor per call, vLLM's name mapping and fused-shard loaders), a whole one and then ``q_proj`` of one
fused layer alone.

Oracle: the fragment form built from scratch (``prepare_weight``) of the new weights quantized with the
layer's channels, the form a fresh load of them gives. No forward runs (the CPU has no kernels; the
interpreter test tests/test_engine_weight_release.py checks the outputs)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from helpers.vllm_engine import engine_model, make_llm  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = pytest.mark.vllm


def _fragment_engine(model) -> dict[str, torch.nn.Module]:
    """Every FourSight layer re-processed with the triton backend (``refresh_layer``, the plugin's step)."""
    from foursight.dispatch import TritonBackend
    from foursight.quant_methods.config import foursight_layers
    from foursight.quant_methods.plan import refresh_layer

    layers = foursight_layers(model)
    for m in layers.values():
        m.foursight_plan.backend = TritonBackend()
        refresh_layer(m, m.quant_method.tp_context(m))
    return layers


def _expected_form(m, weights: dict[str, torch.Tensor]):
    """The fragment form of ``weights`` (HF names) for layer ``m``, built from scratch with its channels."""
    from foursight.kernels.prepared import prepare_weight
    from foursight.layer import quantize_weight
    from foursight.quant_methods.sharding import concat_shards

    plan = m.foursight_plan
    ch = m.bf16_channels.data[0].clone()
    parts = [quantize_weight(weights[f"{s}.weight"].bfloat16(), ch) for s in plan.layout.shard_names]
    return prepare_weight(concat_shards(parts, plan.layout.prefix), plan.layout.prefix)


def _assert_form(m, expected, name):
    pw = m.foursight_state.prepared.state
    for field in ("weight_global_scale", "weight_bf16", "bf16_channels"):
        assert torch.equal(getattr(pw, field), getattr(expected, field)), (name, field)
    assert torch.equal(pw.fragment.words, expected.fragment.words), name
    assert torch.equal(pw.fragment.scales, expected.fragment.scales), name


def _released(m) -> bool:
    return (m.foursight_plan.loader.released is not None and m.weight_packed.untyped_storage().nbytes() == 0
            and m.weight_scale.untyped_storage().nbytes() == 0)


def test_trl_sync_into_a_released_engine_equals_a_fresh_load(tiny_ckpt, tiny_llama_dir):
    new = perturbed_state(tiny_llama_dir, seed=11)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    q_new = perturbed_state(tiny_llama_dir, seed=12)[q0]
    llm = make_llm(tiny_ckpt, quantization="foursight")
    try:
        model = engine_model(llm)
        layers = _fragment_engine(model)
        assert layers and all(_released(m) for m in layers.values())

        # TRL colocate's sync: one load_weights call per tensor, no post-load step
        with torch.no_grad():
            for name, t in new.items():
                model.load_weights(weights=[(name, t)])
        for n, m in layers.items():
            assert not m.foursight_plan.loader.stale and _released(m), n  # every shard arrived: rebuilt in its loader, released again
            _assert_form(m, _expected_form(m, new), n)

        # q_proj alone: the fused qkv_proj gets its checkpoint tensors back before the write, so k/v keep theirs
        qkv = layers["model.layers.0.self_attn.qkv_proj"]
        with torch.no_grad():
            model.load_weights(weights=[(q0, q_new)])
        assert qkv.foursight_plan.loader.stale and not _released(qkv)
        qkv.quant_method.process_weights_after_loading(qkv)  # the post-load step (vLLM's reload, finish_update)
        assert _released(qkv)
        _assert_form(qkv, _expected_form(qkv, {**new, q0: q_new}), "qkv_proj after q_proj alone")

        # with a vLLM weight offloader (cpu_offload_gb) the parameters are the weights it copies back to the CPU
        # after processing and streams every forward: the post-load step must leave them
        from vllm.model_executor.offloader.base import set_offloader
        from vllm.model_executor.offloader.uva import UVAOffloader

        with torch.no_grad():
            model.load_weights(weights=[(q0, new[q0])])
        set_offloader(UVAOffloader(cpu_offload_max_bytes=1 << 30))
        try:
            qkv.quant_method.process_weights_after_loading(qkv)
            assert qkv.weight_packed.untyped_storage().nbytes() > 0 and qkv.foursight_plan.loader.released is None
        finally:
            set_offloader(None)
        _assert_form(qkv, _expected_form(qkv, new), "qkv_proj with an offloader")
        with torch.no_grad():
            model.load_weights(weights=[(q0, new[q0])])
        qkv.quant_method.process_weights_after_loading(qkv)  # the next update without an offloader: released again
        assert _released(qkv)
        _assert_form(qkv, _expected_form(qkv, new), "qkv_proj after the offloader")
    finally:
        del llm
        gc.collect()


def test_a_serving_engine_frees_its_bf16_weights_and_refuses_updates(tiny_llama_dir, monkeypatch):
    """Online mode with ``FOURSIGHT_ONLINE_KEEP_BF16=0`` (a serving engine; docs/gpu.md: the 8B-shaped online engine
    held 23.24 GiB against BF16's 15.00 with them): every FourSight layer's BF16 ``weight`` has no storage left, the
    engine scores exactly as the default engine (which keeps them), and a trainer's ``load_weights`` is refused
    naming the setting, with nothing changed. Before: the setting did not exist and the weights stayed."""
    from foursight.calibration import builtin_texts
    from foursight.quant_methods.config import foursight_layers
    from helpers.logprobs import engine_prompt_logprobs, fixed_sequences
    from transformers import AutoTokenizer

    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), builtin_texts()[:3], 24)
    monkeypatch.setenv("FOURSIGHT_CHANNEL_BUDGET", "16")
    runs = {}
    for keep in ("1", "0"):
        monkeypatch.setenv("FOURSIGHT_ONLINE_KEEP_BF16", keep)
        llm = make_llm(tiny_llama_dir, quantization="foursight")
        try:
            layers = foursight_layers(engine_model(llm))
            sizes = {n: m.weight.untyped_storage().nbytes() for n, m in layers.items()}
            lps = engine_prompt_logprobs(llm, seqs)
            if keep == "0":
                new = perturbed_state(tiny_llama_dir, seed=4)
                name = "model.layers.0.mlp.down_proj.weight"
                with pytest.raises(Exception, match="FOURSIGHT_ONLINE_KEEP_BF16=0"):
                    llm.apply_model(lambda model: model.load_weights([(name, new[name])]))
                assert all(torch.equal(a, b) for a, b in zip(lps, engine_prompt_logprobs(llm, seqs)))
            runs[keep] = (sizes, lps)
        finally:
            del llm
            gc.collect()
    kept, freed = runs["1"][0], runs["0"][0]
    assert kept and all(v > 0 for v in kept.values()) and all(v == 0 for v in freed.values()), (kept, freed)
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][1], runs["0"][1]))
