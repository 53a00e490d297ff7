"""benchmarks/kernels/probe_decode_step.py: kernel names sort into the right categories, and the
per-step sums divide the profiled events by the number of replays; the CPU smoke runs end to end."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_P = _ROOT / "benchmarks" / "kernels" / "probe_decode_step.py"
_spec = importlib.util.spec_from_file_location("probe_decode_step", _P)
pds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pds)


@pytest.mark.parametrize("name,cat", [
    ("_act_quant_kernel", "quantizer"),
    ("_producer_kernel", "producer"),  # the fused add + RMSNorm / SiLU·mul (and quantizer): not "norm"
    ("_fragment_gemm_kernel", "foursight_gemm"),
    ("_split_reduce_kernel", "foursight_gemm"),
    ("_dequant_weight_kernel", "foursight_gemm"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "cublas"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "cublas"),
    ("pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>", "norm"),
    ("void at::native::elementwise_kernel<128, 2>(silu)", "other"),
])
def test_category(name, cat):
    assert pds.category(name) == cat


def test_summarize_divides_by_steps_and_ranks_kernels():
    ev = [("_act_quant_kernel", 3.0), ("_fragment_gemm_kernel", 20.0), ("_act_quant_kernel", 5.0),
          ("_fragment_gemm_kernel", 22.0), ("nvjet_x", 10.0), ("elementwise", 2.0)]
    s = pds.summarize(ev, steps=2)
    assert s["us_per_step"]["quantizer"] == pytest.approx(4.0)
    assert s["us_per_step"]["foursight_gemm"] == pytest.approx(21.0)
    assert s["us_per_step"]["cublas"] == pytest.approx(5.0) and s["us_per_step"]["other"] == pytest.approx(1.0)
    assert s["kernel_us_per_step"] == pytest.approx(31.0) and s["kernels_per_step"] == pytest.approx(3.0)
    assert [t["name"] for t in s["top_kernels"]][:2] == ["_fragment_gemm_kernel", "nvjet_x"]
    assert s["top_kernels"][0]["per_step"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="steps"):
        pds.summarize(ev, steps=0)


def test_cpu_smoke_writes_both_files(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(_P), "--tiny", "--device", "cpu", "--out", str(tmp_path),
                        "--modes", "bf16,foursight-w4a4", "--batches", "1", "--steps", "1",
                        "--producers", "torch"],  # eager RMSNorm: CPU ops the profiler sees (the interpreter's kernels it does not)
                       cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    res = json.loads((tmp_path / "decode_step.json").read_text())
    rows = {m: rs[0] for m, rs in res["modes"].items()}
    assert "error" not in rows["bf16"] and "error" not in rows["foursight-w4a4"], rows
    # the tiny decoder's 5 RMSNorms per step (2 per layer, 2 layers, + the final one) are found as norm
    norm = [t for t in rows["bf16"]["top_kernels"] if t["category"] == "norm"]
    assert norm and norm[0]["per_step"] == pytest.approx(5.0) and rows["bf16"]["us_per_step"]["norm"] > 0
    assert "| foursight-w4a4 | 1 |" in (tmp_path / "decode_step.md").read_text()
