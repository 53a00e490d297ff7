"""A compressed-tensors NVFP4 checkpoint served by SGLang unconverted: ``python -m
sglang.launch_server --model-path CT_FOLDER --quantization foursight``.

The folder is made by the compressed-tensors library alone (``benchmarks/fidelity/ct_library.py``, W4A4
NVFP4 preset, llm-compressor's ``nvfp4-pack-quantized`` format). SGLang's method-name check is
overridden by ``FourSightSGLangConfig.override_quantization_method``, its config is read as
FourSight k = 0, and the plugin's weight iterator adds the empty k = 0 tensors. Oracle: the same
folder converted by ``foursight import`` (a separate path: the conversion writes the tensors to
disk and its config lists every unquantized layer), served by the same SGLang, must give the
same teacher-forced logprobs bit for bit; and both differ from the BF16 model's (the quantized
layers are in use). Without the override SGLang refuses the folder ("does not match the
quantization method specified in the `quantization` argument").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.checkpoints import library_ct_checkpoint
from helpers.sglang_engine import abs_diffs, bf16_model, hf_prompt_logprobs, prompt_ids, running_server, server_prompt_logprobs

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

pytest.importorskip("compressed_tensors")


def _served_logprobs(model: Path, prompts: list[list[int]], log: Path) -> list[list[float]]:
    with running_server(model, log) as url:
        return server_prompt_logprobs(url, prompts)


def test_sglang_serves_the_compressed_tensors_folder_directly(tiny_llama_dir, tmp_path):
    from foursight.interop import import_compressed_tensors
    from foursight.quant_methods.sglang_method import FourSightSGLangConfig

    ct_dir = library_ct_checkpoint(tiny_llama_dir, tmp_path / "ct")
    qc = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert FourSightSGLangConfig.override_quantization_method(qc, "foursight") == "foursight"
    assert FourSightSGLangConfig.override_quantization_method(qc, None) is None
    assert FourSightSGLangConfig.override_quantization_method({"quant_method": "awq"}, "foursight") is None

    k0 = import_compressed_tensors(ct_dir, tmp_path / "k0")
    prompts = prompt_ids(k0, n=3)
    direct = _served_logprobs(ct_dir, prompts, tmp_path / "direct.log")
    imported = _served_logprobs(k0, prompts, tmp_path / "imported.log")
    d = abs_diffs(direct, imported)
    bf16 = abs_diffs(direct, hf_prompt_logprobs(bf16_model(tiny_llama_dir), prompts))
    print(f"\nSGLang, compressed-tensors folder vs its foursight import: max |d| {float(d.max()):.3g}; "
          f"vs the BF16 model: mean |d| {float(bf16.mean()):.4f} over {d.numel()} tokens")
    assert float(d.max()) == 0.0
    assert float(bf16.mean()) > 0.05
