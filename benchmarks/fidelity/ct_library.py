"""A compressed-tensors NVFP4 checkpoint made by the compressed-tensors library alone, shared by
``tests/test_interop.py``, ``tests/test_interop_compensation.py`` and ``benchmarks/fidelity/import_compensation.py``
(test and benchmark tooling, not product code: FourSight itself never writes compressed-tensors
checkpoints from a BF16 model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def library_ct_checkpoint(bf16_dir: Path, out: Path, w4a4: bool = True) -> Path:
    """A compressed-tensors NVFP4 checkpoint made by the compressed-tensors library alone: its
    global-scale and block-scale helpers, its NVFP4 compressor and its config (llm-compressor's
    steps without the calibration loop; the input scale from one forward's max |x|)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme("NVFP4" if w4a4 else "NVFP4A16", ["Linear"])
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: amax.__setitem__(n, float(a[0].abs().max())))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    with torch.no_grad():
        model(**tok("The quick brown fox jumps over the lazy dog. 12 + 30 = 42.", return_tensors="pt"))
    for h in hooks:
        h.remove()
    sd = {}
    for n, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or n == "lm_head":
            continue
        w = m.weight.detach()
        gs = generate_gparam(w.float().min(), w.float().max()).reshape(1)
        blocks = w.float().reshape(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gs)
        local = {"weight": w, "weight_scale": scale, "weight_global_scale": gs}
        if w4a4:
            local["input_global_scale"] = generate_gparam(torch.tensor(-amax[n]), torch.tensor(amax[n])).reshape(1)
        for k, v in NVFP4PackedCompressor.compress(local, scheme).items():
            sd[f"{n}.{k}"] = v.detach().contiguous()
        if m.bias is not None:
            sd[f"{n}.bias"] = m.bias.detach()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for k, v in model.state_dict().items():
        if tied and k == "lm_head.weight":
            continue  # tied to the embeddings (SmolLM2): not stored, as transformers saves it
        if k.rsplit(".", 1)[0] not in {p.rsplit(".", 1)[0] for p in sd} and not (k.endswith("weight") and f"{k[:-7]}.weight_packed" in sd):
            sd.setdefault(k, v.contiguous())
    out.mkdir(parents=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized",
                            quantization_status=QuantizationStatus.COMPRESSED, ignore=["lm_head"]).to_dict()
    qc["quant_method"] = "compressed-tensors"
    cfg = json.loads((bf16_dir / "config.json").read_text())
    cfg["quantization_config"] = json.loads(json.dumps(qc, default=str))
    (out / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(out)
    return out
