"""The packaged SmolLM2-135M-Instruct: FourSight k=32 against plain NVFP4, and a checkpoint that loads back."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]


def test_smollm2_k32_beats_plain_nvfp4_on_outlier_layers(smollm2_fs32_ckpt):
    rows = json.loads((smollm2_fs32_ckpt / "foursight_layers.json").read_text())
    assert len(rows) == 30 * 7 and all(r["k"] == 32 for r in rows)
    outlier = [r for r in rows if r["outlier_share"] > 0.3]  # 32 of 576+ channels hold > 30 % of the variance
    assert len(outlier) >= 20
    for r in outlier:
        assert r["err_foursight"] < 0.9 * r["err_nvfp4"], r
    # and across all layers, the median reduction is substantial
    red = sorted(1 - r["err_foursight"] / r["err_nvfp4"] for r in rows)
    assert red[len(red) // 2] > 0.15


def test_smollm2_checkpoint_loads_back_and_tracks_bf16(smollm2_fs32_ckpt, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.hf import FourSightLinear, load_reference_model

    ref = load_reference_model(smollm2_fs32_ckpt)
    assert sum(isinstance(m, FourSightLinear) for m in ref.modules()) == 210
    bf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lq = torch.log_softmax(ref(ids).logits.float(), -1)
        lb = torch.log_softmax(bf16(ids).logits.float(), -1)
    # the quantized model still predicts like the BF16 one on this easy prompt
    assert lq[0, -1].argmax() == lb[0, -1].argmax()
    tgt = ids[0, 1:]
    d = (lq[0, :-1].gather(1, tgt[:, None]) - lb[0, :-1].gather(1, tgt[:, None])).abs()
    assert float(d.mean()) < 0.5
