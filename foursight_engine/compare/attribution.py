"""``foursight compare --attribute``: which layers cause the plain-NVFP4 mismatch (HF engine)."""

from __future__ import annotations

from pathlib import Path

import torch

from foursight.trainer_bridge.protocol import Rollout


def attribute_layers(model_dir: Path, rollouts: list[Rollout], learner: list[torch.Tensor], by: str = "type",
                     error_target: float = 0.05, max_k: int = 256) -> dict:
    """Restore groups of layers of a plain-NVFP4 HF model to BF16 and rank the recovered mismatch.

    Args:
        by: ``"type"`` (q_proj, k_proj, ... across all blocks) or ``"block"`` (each decoder layer).
    Returns:
        {"nvfp4_mean", "n", "error_target", "rows": [{"group", "mean", "recovered", "k_needed"}]}.
    """
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.calibration import collect_stats, load_calibration_texts
    from foursight.channels import choose_k_levels
    from foursight.schema import find_linears
    from foursight.hf import quantize_hf_model, restore_bf16
    from foursight.schema import FourSightConfig
    from foursight.trainer_bridge.scoring import teacher_forced_logprobs

    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    names = find_linears(bf16, FourSightConfig())
    weights = {n: (bf16.get_submodule(n).weight.detach().clone(), None if bf16.get_submodule(n).bias is None else bf16.get_submodule(n).bias.detach().clone()) for n in names}
    groups = collect_stats(bf16, tok, load_calibration_texts(None), names, progress=False)
    k_needed: dict[str, int] = {}
    for g in groups.values():
        for n in g.members:
            k_needed[n] = choose_k_levels(g, [weights[n][0]], [error_target], max_k)[error_target]
    model = quantize_hf_model(bf16, {})

    def mean_mismatch() -> float:
        with torch.no_grad():
            d = [(teacher_forced_logprobs(model, [r.prompt_ids], [r.token_ids])[0][0, : len(r.token_ids)].double() - lp).abs()
                 for r, lp in zip(rollouts, learner)]
        return float(torch.cat(d).mean())

    base = mean_mismatch()
    key = (lambda n: n.rsplit(".", 1)[-1]) if by == "type" else (lambda n: (re.search(r"layers\.(\d+)\.", n) or [None, "other"])[1])
    grouped: dict[str, list[str]] = {}
    for n in names:
        grouped.setdefault(str(key(n)), []).append(n)
    rows = []
    from tqdm.auto import tqdm

    for gname, members in tqdm(list(grouped.items()), desc="attribution", unit="group"):
        removed = {n: restore_bf16(model, n, *weights[n]) for n in members}
        m = mean_mismatch()
        for n, mod in removed.items():  # put the FP4 layers back
            parent, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, mod)
        ks = sorted(k_needed[n] for n in members)
        label = gname if by == "type" else f"layers.{gname}"
        rows.append({"group": label, "mean": m, "recovered": 1 - m / base if base > 0 else 0.0,
                     "k_needed": f"{ks[len(ks) // 2]} / {ks[-1]}"})
    rows.sort(key=lambda r: -r["recovered"])
    return {"nvfp4_mean": base, "n": len(rollouts), "error_target": error_target, "by": by, "rows": rows}
