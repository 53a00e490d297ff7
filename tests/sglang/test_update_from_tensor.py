"""A trainer's BF16 sync into an SGLang engine serving a FourSight *checkpoint* (CPU).

``engine.update_weights_from_tensor`` with the learner's BF16 tensors in HF naming (what verl's and
slime's SGLang rollouts call; SGLang 0.5.23 requires it inside a ``begin_weight_update`` /
``end_weight_update`` session, whose end runs the post-load step) reaches every FourSight layer through
its empty ``weight`` parameter, which quantizes each shard with the checkpoint's own channel set
(:meth:`foursight.quant_methods.param_kinds.BF16UpdateParam.load`). Before, SGLang's loader found no
``qkv_proj.weight`` parameter in a checkpoint-mode layer and the update failed.

Oracle: the PyTorch reference model of the new weights quantized with the checkpoint's channels
(``foursight.hf.quantize_hf_model``), within the measured BF16 implementation floor
(``helpers.sglang_engine.within_floor``), and far from the previous policy. Twice in a row (B, then back
to A), then half a fused layer (q_proj of layer 0 alone).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.sglang_engine import abs_diffs, bf16_model, engine_prompt_logprobs, hf_prompt_logprobs, noise_floor, prompt_ids, within_floor

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

Q0 = "model.layers.0.self_attn.q_proj.weight"


def _reference(model_dir, tiny_ckpt, state=None):
    """The reference model of BF16 weights (``model_dir``, with ``state`` loaded over them)
    quantized with the checkpoint's channel sets."""
    from foursight.hf import quantize_hf_model

    m = bf16_model(model_dir)
    if state is not None:
        m.load_state_dict(state, strict=False)
    chans = json.loads((tiny_ckpt / "foursight_channels.json").read_text())["channels"]
    return quantize_hf_model(m, {k: torch.tensor(v, dtype=torch.int32) for k, v in chans.items()})


def _update(engine, items) -> None:
    for step in (engine.begin_weight_update, lambda: engine.update_weights_from_tensor(items), engine.end_weight_update):
        ok, msg = step()
        assert ok, msg


def _check(engine, ref_model, prompts, before, what):
    got = engine_prompt_logprobs(engine, prompts)
    ref = hf_prompt_logprobs(ref_model, prompts)
    d, moved = abs_diffs(got, ref), abs_diffs(got, before)
    ok, msg = within_floor(d, noise_floor(ref_model, prompts, ref))
    m = f"{what}: {msg}; moved from before: mean {float(moved.mean()):.4f}"
    print(m)
    assert ok, m
    assert float(moved.mean()) > 1.5 * float(d.mean()), m
    return got


def test_bf16_update_from_tensor_into_a_checkpoint_engine(ckpt_engine, tiny_ckpt, tiny_llama_dir, tiny_llama_b_dir):
    from safetensors.torch import load_file

    prompts = prompt_ids(tiny_ckpt, n=4)
    a = load_file(str(tiny_llama_dir / "model.safetensors"))
    b = load_file(str(tiny_llama_b_dir / "model.safetensors"))
    start = engine_prompt_logprobs(ckpt_engine, prompts)

    _update(ckpt_engine, list(b.items()))
    on_b = _check(ckpt_engine, _reference(tiny_llama_b_dir, tiny_ckpt), prompts, start, "checkpoint engine after B")

    _update(ckpt_engine, list(a.items()))
    on_a = _check(ckpt_engine, _reference(tiny_llama_dir, tiny_ckpt), prompts, on_b, "back to A")

    # half of the fused qkv_proj of layer 0: q from B, k/v stay A's
    _update(ckpt_engine, [(Q0, b[Q0])])
    mixed = _reference(tiny_llama_dir, tiny_ckpt, {Q0: b[Q0]})
    _check(ckpt_engine, mixed, prompts, on_a, "A with q_proj of layer 0 from B")
