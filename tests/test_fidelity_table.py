"""benchmarks/fidelity/fidelity_table.py's pieces: the exact KL against hand values, the per-target k against
foursight.channels.choose_k, and a tiny end-to-end run (HF only)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from helpers.scripts import benchmark_path, load_benchmark

fid = load_benchmark("fidelity_table")


def test_exact_kl_hand_values():
    p = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]))
    q = torch.log(torch.tensor([[0.25, 0.25, 0.5], [1 / 3, 1 / 3, 1 / 3]]))
    want = (0.5 * math.log(2) + 0.25 * math.log(0.5)) / 2  # second token: 0
    assert fid.exact_kl([p], [q]) == pytest.approx(want, rel=1e-6)
    assert fid.exact_kl([p], [p]) == pytest.approx(0.0, abs=1e-9)


def test_choose_k_levels_equals_choose_k(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight import schema
    from foursight.calibration import collect_stats, load_calibration_texts
    from foursight.channels import choose_k
    from foursight.schema import find_linears

    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    groups = collect_stats(m, tok, load_calibration_texts(None)[:8], find_linears(m, schema.FourSightConfig()), progress=False)
    targets = [0.05, 0.1, 0.2, 0.5]
    got = fid.choose_k_levels(groups, m, targets)
    ks = set()
    for g in groups.values():
        w = [m.get_submodule(n).weight.detach() for n in g.members]
        for t in targets:
            assert got[g.key][t] == choose_k(g, w, "0", t, None), (g.key, t)
            ks.add(got[g.key][t])
    assert len(ks) > 1  # the targets do pick different budgets
    from foursight.channels import choose_k_levels

    for g in groups.values():  # with a cap, as foursight rl --error-target --max-k
        w = [m.get_submodule(n).weight.detach() for n in g.members]
        capped = choose_k_levels(g, w, targets, 32)
        assert capped == {t: choose_k(g, w, "0", t, 32) for t in targets}, g.key


def test_fidelity_table_tiny_end_to_end(tiny_llama_dir, tmp_path):
    out = tmp_path / "fid"
    r = subprocess.run([sys.executable, str(benchmark_path("fidelity_table")), "--model", str(tiny_llama_dir), "--n", "3",
                        "--max-tokens", "6", "--ks", "16", "--targets", "0.1", "--w4a16-k", "16", "--no-vllm", "--bf16-layers", "attention&first:1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.with_suffix(".json").read_text())
    rows = res["rows"]
    carve = "nvfp4 + bf16 attention&first:1"
    assert list(rows) == ["nvfp4", carve, "foursight k=16", "foursight error-target 0.1", "w4a16 foursight k=16", "fp8 rowwise"]
    # the carve-out: 4 attention layers of block 0 (of 14 linears) in BF16; its row is closer to BF16 than plain NVFP4
    assert rows["nvfp4"]["bf16_weight_share"] == 0 and 0 < rows[carve]["bf16_weight_share"] < 0.5
    assert rows[carve]["exact_kl"] < rows["nvfp4"]["exact_kl"] and rows["fp8 rowwise"]["bf16_weight_share"] is None
    for name, row in rows.items():
        assert row["exact_kl"] >= 0 and row["mean_abs_dlogp"] > 0, name
        assert set(row["filters_keep"]) == {"max_token", "max_token(τ=2.5)", "tail_count", "geo_mean", "quantile"}
    assert rows["nvfp4"]["k_fraction"] == 0 and rows["foursight k=16"]["k_fraction"] > 0
    assert rows["fp8 rowwise"]["exact_kl"] < rows["nvfp4"]["exact_kl"]
    assert "| fp8 rowwise |" in out.with_suffix(".md").read_text()


def test_fidelity_table_small_table_and_percent_rows(tiny_llama_dir, tmp_path):
    """The options of a small table (issue 35 item 5's carve-out row): ``--ks`` with a percentage of K
    gives per-layer k as ``--channels`` reads it (here 10 %: k = 16 for K = 128, 32 for K = 256, as 2 %
    does for SmolLM2's 576 and 1536), and ``--targets ''``, ``--w4a16-k 0``, ``--no-fp8`` leave those rows
    out; the result names its commit and machine."""
    from transformers import AutoModelForCausalLM

    from foursight import schema
    from foursight.schema import find_linears

    out = tmp_path / "fid"
    r = subprocess.run([sys.executable, str(benchmark_path("fidelity_table")), "--model", str(tiny_llama_dir), "--n", "2",
                        "--max-tokens", "4", "--ks", "10%", "--targets", "", "--w4a16-k", "0", "--no-fp8", "--no-vllm", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.with_suffix(".json").read_text())
    assert list(res["rows"]) == ["nvfp4", "foursight 10%"]
    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    in_f = [m.get_submodule(n).in_features for n in find_linears(m, schema.FourSightConfig())]
    ks = [schema.parse_channel_budget("10%", k) for k in in_f]
    assert len(set(ks)) > 1  # the percentage gives different k for different K
    assert res["rows"]["foursight 10%"]["k_mean"] == pytest.approx(sum(ks) / len(ks))
    assert len(res["commit"]) == 40 and res["machine"]["cores"] >= 1 and len(res["machine"]["loadavg_end"]) == 3
    assert res["commit"] in out.with_suffix(".md").read_text()
