"""Test helper shared by the bridge weight-update tests: a new policy's BF16 weights."""

from __future__ import annotations

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
