"""A new policy's BF16 weights for the weight-update tests, and the reference model that holds them."""

from __future__ import annotations

from pathlib import Path

import torch


def perturbed_state(model_dir, seed: int = 0) -> dict[str, torch.Tensor]:
    """New BF16 weights (HF names): every linear weight moved by 50 % of its std, lm_head doubled."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in m.named_parameters():
        if n.endswith("proj.weight"):
            out[n] = (p.float() + 0.5 * p.float().std() * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
        elif n == "lm_head.weight":
            out[n] = (2 * p.float()).to(torch.bfloat16)
    return out


def reference_with_weights(ckpt: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The independent oracle of an update: the reference model of FourSight checkpoint ``ckpt`` with
    every FourSight layer re-quantized from ``state`` (its own channel set) and ``lm_head`` replaced."""
    from foursight.hf import FourSightLinear, load_reference_model

    ref = load_reference_model(ckpt)
    for n, mod in ref.named_modules():
        if isinstance(mod, FourSightLinear):
            mod.set_weight(state[n + ".weight"])
    ref.load_state_dict({"lm_head.weight": state["lm_head.weight"]}, strict=False)
    return ref
