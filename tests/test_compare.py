"""`foursight compare` end to end on the real vLLM CPU engine with the tiny model, and its parts."""

from __future__ import annotations

import json

import pytest
import torch

from foursight.compare import CompareError, engine_metrics, pairwise, parse_engine_urls, parse_engines


def test_engine_spec_parsing_names_the_flag():
    assert [e.name for e in parse_engines("hf:bf16, vllm:foursight")] == ["hf:bf16", "vllm:foursight"]
    with pytest.raises(CompareError, match="--engines: 'vllm:fp8'.*HF engine only"):
        parse_engines("vllm:fp8")
    with pytest.raises(CompareError, match="--engines: 'vllm:int3'"):
        parse_engines("vllm:int3")
    assert [e.name for e in parse_engines("hf:fp8,vllm:w4a16")] == ["hf:fp8", "vllm:w4a16"]
    with pytest.raises(CompareError, match="repeated"):
        parse_engines("hf:bf16,hf:bf16")
    assert parse_engine_urls(["vllm:bf16=http://127.0.0.1:8000/"]) == {"vllm:bf16": "http://127.0.0.1:8000"}
    with pytest.raises(CompareError, match="--engine-url"):
        parse_engine_urls(["vllm:bf16"])


def test_metrics_against_hand_values():
    learner = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    engine = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.5])]
    m = engine_metrics(learner, engine, tail_threshold=0.4)
    assert m["tim/abs_log_ratio_mean"] == pytest.approx(0.5 / 3)
    assert m["tim/abs_log_ratio_max"] == pytest.approx(0.5)
    assert m["tim/tail_tokens"] == 1 and m["tim/tail_seq_fraction"] == pytest.approx(0.5)
    # k3 = rho - 1 - log rho with rho = exp(r), r = learner - engine = 0.5 on one token
    assert m["tim/k3_mean"] == pytest.approx((torch.exp(torch.tensor(0.5)) - 1 - 0.5).item() / 3, rel=1e-6)
    pw = pairwise({"a": learner, "b": engine})
    assert pw["a"]["a"] == 0 and pw["a"]["b"] == pytest.approx(0.5 / 3)


def test_compare_hf_fp8_and_w4a16(tiny_llama_dir, tmp_path):
    """hf:fp8 (FP8 rowwise W8A8, quantized in memory) and hf:w4a16 (a W4A16 checkpoint) score the
    same tokens as the learner; FP8's mismatch is below half of plain NVFP4's, W4A16's below NVFP4's,
    and the W4A16 checkpoint says activation_dtype bf16."""
    from foursight.compare.run import run_compare

    res = run_compare(tiny_llama_dir, parse_engines("hf:bf16,hf:fp8,hf:nvfp4,hf:w4a16"), tmp_path / "r", n=4, max_tokens=8,
                      channels="16")
    m = {k: v["tim/abs_log_ratio_mean"] for k, v in res["engines"].items()}
    assert 0 < m["hf:fp8"] < 0.5 * m["hf:nvfp4"], m
    assert 0 < m["hf:w4a16"] < m["hf:nvfp4"], m
    cfg = json.loads((tmp_path / "r" / "checkpoints" / f"{tiny_llama_dir.name}-w4a16-k16" / "config.json").read_text())
    assert cfg["quantization_config"]["activation_dtype"] == "bf16"
    assert (tmp_path / "r" / "report.md").read_text().count("hf:fp8") >= 2


@pytest.mark.vllm
@pytest.mark.slow
def test_compare_end_to_end_vllm(tiny_llama_dir, tmp_path):
    pytest.importorskip("vllm")
    from foursight.compare.run import run_compare

    out = tmp_path / "report"
    res = run_compare(tiny_llama_dir, parse_engines("vllm:bf16,hf:bf16,vllm:foursight,vllm:nvfp4"), out, n=12, max_tokens=24,
                      channels="16", max_model_len=256, seed=1)
    m = res["engines"]
    bf = m["vllm:bf16"]["tim/abs_log_ratio_mean"]
    fs = m["vllm:foursight"]["tim/abs_log_ratio_mean"]
    fp4 = m["vllm:nvfp4"]["tim/abs_log_ratio_mean"]
    print(f"mean |dlogp| vs HF BF16: vllm:bf16 {bf:.5f}  vllm:foursight {fs:.5f}  vllm:nvfp4 {fp4:.5f}")
    assert bf < fp4 / 5, (bf, fp4)  # BF16 engine vs BF16 learner: far below NVFP4 vs BF16
    assert fs < fp4, (fs, fp4)  # compensation helps
    assert res["generator_self_check"]["mean_abs"] < 0.05  # sampling logprobs == teacher-forced scoring
    # the report files exist and parse
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["engines"]) == {"vllm:bf16", "vllm:foursight", "vllm:nvfp4"}
    assert metrics["num_tokens"] > 50
    md = (out / "report.md").read_text()
    assert "| vllm:foursight |" in md and "cdf_abs_dlogp.png" in md
    for png in ("cdf_abs_dlogp.png", "seq_max_hist.png", "dlogp_vs_position.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_label_the_histogram_and_keep_the_legend_off_the_data(tmp_path):
    """The per-sequence histogram says what its y-axis counts, and the position plot's legend
    sits outside the axes (its box and the axes' box do not overlap once drawn)."""
    from foursight.compare.report import write_plots

    g = torch.Generator().manual_seed(0)
    learner = [-torch.rand(30, generator=g, dtype=torch.float64) for _ in range(8)]
    scores = {f"vllm:{p}": [a + 0.3 * torch.randn(30, generator=g, dtype=torch.float64) for a in learner]
              for p in ("bf16", "foursight", "nvfp4")}
    figs: dict = {}
    files = write_plots(tmp_path, learner, scores, tail_threshold=0.5, figures=figs)
    assert files == ["cdf_abs_dlogp.png", "seq_max_hist.png", "dlogp_vs_position.png"]
    hist_axes = figs["seq_max_hist.png"].axes
    assert len(hist_axes) == 3 and all(ax.get_ylabel() == "sequences" for ax in hist_axes)
    fig = figs["dlogp_vs_position.png"]
    (ax,) = fig.axes
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    leg, box = ax.get_legend().get_window_extent(r), ax.get_window_extent(r)
    assert leg.x0 >= box.x1 or not leg.overlaps(box), (leg, box)
    assert len(ax.get_legend().get_texts()) == 3
    for png in files:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
