"""Online quantization and the RL weight update on the real ``sglang.Engine`` (CPU).

``sglang.Engine(model_path=BF16_MODEL, quantization="foursight")`` quantizes the BF16 weights at
load with the channel sets of a ``foursight_channels.json`` (here: the one ``quantize_model``
wrote next to the tiny checkpoint, passed through ``FOURSIGHT_CHANNELS_FILE``). Same channels and
the same per-tensor global scale convention as the checkpoint writer, so the engine must match
the PyTorch reference model *of the checkpoint* (tolerance: the measured noise floor, see
test_server.py and ``helpers.sglang_engine.within_floor``).

Then ``engine.update_weights_from_tensor`` (inside SGLang's ``begin_weight_update`` /
``end_weight_update`` session) streams the BF16 weights of another model (the "new policy" of an
RL step) in HF naming; ``end_weight_update`` runs the post-load processing, which re-quantizes
the FourSight layers with the same channel sets; the logprobs must follow the reference of the
new policy quantized with those channels. ``update_weights_from_disk`` with a folder of BF16
tensors (the rollout bridge's contract) brings policy A back.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers.sglang_engine import (abs_diffs, bf16_model, engine_prompt_logprobs, floor_check, hf_prompt_logprobs, prompt_ids,
                                   reference_model, running_engine)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SEPARATION = 1.5


@pytest.fixture(scope="module")
def online_engine(tiny_llama_dir, tiny_ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOURSIGHT_CHANNELS_FILE", str(tiny_ckpt / "foursight_channels.json"))
        with running_engine(tiny_llama_dir) as eng:
            yield eng


def _rep(name, d):
    return f"{name}: mean |Δ| {d.mean():.5f}, max |Δ| {d.max():.5f} over {d.numel()} tokens"


def test_online_quantization_matches_checkpoint_reference(online_engine, tiny_ckpt, tiny_llama_dir):
    prompts = prompt_ids(tiny_ckpt, n=4)
    eng = engine_prompt_logprobs(online_engine, prompts)
    d_bf16 = abs_diffs(eng, hf_prompt_logprobs(bf16_model(tiny_llama_dir), prompts))
    c = floor_check(eng, reference_model(tiny_ckpt), prompts)
    msg = f"online engine vs checkpoint reference: {c.msg}; " + _rep("online engine vs bf16", d_bf16)
    print(msg)
    assert c.ok, msg
    assert float(c.d.mean()) * SEPARATION <= float(d_bf16.mean()), msg


def test_generate_with_output_logprobs(online_engine, tiny_ckpt):
    ids = prompt_ids(tiny_ckpt, n=1)[0]
    out = online_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0.0}, return_logprob=True)
    toks = out["meta_info"]["output_token_logprobs"]
    assert len(toks) == 5 and all(lp <= 0 for lp, _, _ in toks)
    assert [t[1] for t in toks] == out["output_ids"]


def test_weight_update_from_tensor_requantizes(online_engine, tiny_ckpt, tiny_llama_b_dir):
    from safetensors.torch import load_file

    from foursight.hf import quantize_hf_model

    prompts = prompt_ids(tiny_ckpt, n=4)
    before = engine_prompt_logprobs(online_engine, prompts)
    new = load_file(str(tiny_llama_b_dir / "model.safetensors"))
    # SGLang 0.5.23's session: begin (restore_weights_before_loading) -> tensors (load_weights)
    # -> end (process_weights_after_loading: the FourSight layers are re-quantized)
    ok, msg = online_engine.begin_weight_update()
    assert ok, msg
    ok, msg = online_engine.update_weights_from_tensor(list(new.items()))
    assert ok, msg
    ok, msg = online_engine.end_weight_update()
    assert ok, msg
    after = engine_prompt_logprobs(online_engine, prompts)
    chans = json.loads((tiny_ckpt / "foursight_channels.json").read_text())["channels"]
    ref_model = quantize_hf_model(bf16_model(tiny_llama_b_dir), {k: torch.tensor(v, dtype=torch.int32) for k, v in chans.items()})
    (d, ok, msg, _), moved = floor_check(after, ref_model, prompts), abs_diffs(after, before)
    m = f"after update vs reference of new policy: {msg}; " + _rep("after vs before", moved)
    print(m)
    assert ok, m
    assert float(moved.mean()) >= SEPARATION * float(d.mean()), m


def test_weight_update_from_disk_folder_of_bf16_tensors(online_engine, tiny_ckpt, tiny_llama_dir, tmp_path):
    """The rollout bridge's contract: a folder holding only ``*.safetensors`` of BF16 tensors in HF
    naming, loaded with ``update_weights_from_disk`` (full post-load processing). Back to policy A:
    the logprobs must again match the checkpoint reference of A."""
    import shutil

    upd = tmp_path / "update-a"
    upd.mkdir()
    shutil.copy(tiny_llama_dir / "model.safetensors", upd / "model.safetensors")
    out = online_engine.update_weights_from_disk(str(upd))
    ok, msg = out[0], out[1]
    assert ok, msg
    prompts = prompt_ids(tiny_ckpt, n=4)
    eng = engine_prompt_logprobs(online_engine, prompts)
    _, ok, m, _ = floor_check(eng, reference_model(tiny_ckpt), prompts)
    print("after disk update back to A vs checkpoint reference:", m)
    assert ok, m
