"""Activation-side compensation on an imported compressed-tensors NVFP4 checkpoint, measured on the
real SmolLM2-135M-Instruct (issue 15; docs/ecosystem.md, "Compensation on an imported NVFP4 checkpoint").

    python benchmarks/fidelity/import_compensation.py [--n 16] [--max-tokens 64] [--budgets 16,32,2%] \
        [--fs-budgets 0,16,32] [--out benchmarks/results/import_compensation]

1. **The compressed-tensors checkpoint** of the packaged SmolLM2 (``foursight.models.prepare_smollm2``)
   is made by the compressed-tensors library alone, with ``benchmarks/fidelity/ct_library.py``'s
   ``library_ct_checkpoint`` (the one the interop tests use): the library's global /
   block scale helpers and its NVFP4 compressor, W4A4, with the static input scales from one
   sentence's max |x| (llm-compressor's steps without its calibration loop).
2. **Imports** (``foursight import``, :func:`foursight.interop.import_compressed_tensors`): k = 0
   (the checkpoint's own static input scales) and the channel budgets ``--budgets``; plus an
   ablation, **k = 0 with the static input scales recalibrated** exactly as the compensated imports
   recalibrate them (:func:`foursight.interop.compensate_import` with budget 0), so the gain of the
   BF16 channels is separated from the gain of the new scales.
3. **FourSight from the BF16 model** (``foursight quantize``, :func:`foursight.checkpoint.quantize_model`,
   which re-chooses the FP4 part with S zeroed) at ``--fs-budgets``, with static scales (as the
   imports) and with dynamic scales (as docs/fidelity.md's rows).
4. **Measurement**: docs/fidelity.md's (``benchmarks/fidelity/fidelity_table.py``'s functions): ``--n``
   completions of the built-in chat prompts sampled once by the HF BF16 model (``--no-vllm`` there:
   temperature 1, rollout i with seed ``--seed`` + i), teacher-forced by each checkpoint's FourSight
   reference model (:func:`foursight.hf.load_reference_model`); mean / p99 |Δlogp| and the exact
   KL(BF16 ‖ config) over the vocabulary against the BF16 model, tail fractions and filter keep rates.

Writes ``OUT.json`` and ``OUT.md`` (fidelity_table's table format).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import fidelity_table as fid  # noqa: E402  (benchmarks/fidelity/fidelity_table.py)
from common import add_sampling_args  # noqa: E402  (benchmarks/common.py)
from ct_library import library_ct_checkpoint  # noqa: E402  (benchmarks/fidelity/ct_library.py)


def k_fraction(model) -> tuple[float, float]:
    """Mean k and mean k / K over the FourSight layers of a reference model."""
    from foursight.hf import FourSightLinear

    ks = [(m.bf16_channels.numel(), m.in_features) for m in model.modules() if isinstance(m, FourSightLinear)]
    return sum(k for k, _ in ks) / len(ks), sum(k / kk for k, kk in ks) / len(ks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sampling_args(ap, n=16, max_tokens=64)
    ap.add_argument("--budgets", default="16,32,2%", help="--channels of the compensated imports")
    ap.add_argument("--fs-budgets", default="0,16,32", help="--channels of the FourSight-quantized comparison rows")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/import_compensation"))
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.compare.launch import drive
    from foursight.compare.prompts import load_prompts
    from foursight.compare.report import engine_metrics
    from foursight.hf import load_reference_model
    from foursight.compressed_tensors_format import read_compressed_tensors
    from foursight.interop import compensate_import, import_compressed_tensors, write_checkpoint_folder
    from foursight.models import resolve_model
    from foursight.trainer_bridge.backends.hf import HFEngine
    from foursight.trainer_bridge.metrics import DEFAULT_TAIL_THRESHOLD

    t0 = time.time()
    torch.manual_seed(0)
    md = Path(resolve_model(a.model))
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "foursight-import-compensation"  # checkpoints: outside the repo
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    timings: dict[str, float] = {}

    ct = library_ct_checkpoint(md, work / "ct")
    timings["ct_checkpoint"] = time.time() - t0
    # the completions, once (HF BF16 sampling)
    t1 = time.time()
    tok = AutoTokenizer.from_pretrained(md)
    prompts = load_prompts("builtin", a.n, tok)
    rollouts, _ = asyncio.run(drive(HFEngine(str(md)), "hf:bf16", 1, prompts, a.max_tokens, 1.0, a.seed, None))
    timings["rollouts"] = time.time() - t1
    base = AutoModelForCausalLM.from_pretrained(md, dtype=torch.bfloat16).eval()
    learner, learner_full = fid.score_full(base, rollouts)
    del base
    print(f"{len(rollouts)} rollouts, {sum(len(r.token_ids) for r in rollouts)} tokens", flush=True)

    # the checkpoints: (row name, source description, how to make it)
    def imp(spec):
        return lambda out: import_compressed_tensors(ct, out, channels=spec, progress=False)

    def recal0(out):
        cfg, tensors, cf = compensate_import(ct, *read_compressed_tensors(ct), "0", progress=False)
        return write_checkpoint_folder(out, ct, cfg, tensors, False, "import", channels_file=cf)

    def fsq(spec, scale):
        return lambda out: quantize_model(md, out, QuantizeConfig(channels=spec, activation_scale=scale), progress=False).out_dir

    configs = [("import k=0 (CT static scales)", "foursight import, W4A4 static", imp("0")),
               ("import k=0, scales recalibrated", "compensate_import budget 0, W4A4 static", recal0)]
    configs += [(f"import --channels {b}", "foursight import, W4A4 static", imp(b)) for b in a.budgets.split(",")]
    for scale in ("static", "dynamic"):
        configs += [(f"quantize --channels {b} ({scale})", f"foursight quantize, W4A4 {scale}", fsq(b, scale))
                    for b in a.fs_budgets.split(",")]

    rows: dict[str, dict] = {}
    for i, (name, source, make) in enumerate(configs):
        t1 = time.time()
        ck = make(work / f"ck{i}")
        t_make = time.time() - t1
        m = load_reference_model(ck)
        k_mean, k_frac = k_fraction(m)
        samp, full = fid.score_full(m, rollouts)
        del m
        met = engine_metrics(learner, samp, DEFAULT_TAIL_THRESHOLD)
        rows[name] = {
            "source": source,
            "mean_abs_dlogp": met["tim/abs_log_ratio_mean"], "p99_abs_dlogp": met.get("abs_dlogp_p99"),
            "exact_kl": fid.exact_kl(learner_full, full), "k3": met["tim/k3_mean"],
            "tail_token_fraction": met["tim/tail_token_fraction"], "tail_seq_fraction": met["tim/tail_seq_fraction"],
            "filters_keep": fid.filter_keeps(learner, samp), "k_mean": k_mean, "k_fraction": k_frac,
            "checkpoint_seconds": t_make, "seconds": time.time() - t1,
        }
        del full
        shutil.rmtree(ck, ignore_errors=True)
        print(f"{name}: mean |Δ| {rows[name]['mean_abs_dlogp']:.4f}, KL {rows[name]['exact_kl']:.4f}, k/K {k_frac:.3f} "
              f"({rows[name]['seconds']:.0f} s)", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    res = {"command": "python benchmarks/fidelity/import_compensation.py " + (f"--model {a.model} " if a.model else "")
                      + f"--n {a.n} --max-tokens {a.max_tokens} --seed {a.seed} --budgets {a.budgets} --fs-budgets {a.fs_budgets}",
           "model": str(md), "generator": "hf:bf16", "n": len(rollouts), "tokens": sum(len(r.token_ids) for r in rollouts),
           "max_tokens": a.max_tokens, "tail_threshold": DEFAULT_TAIL_THRESHOLD, "rows": rows, "vllm_cross_check": None,
           "timings": timings, "seconds": time.time() - t0, "torch": torch.__version__, "threads": torch.get_num_threads()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    md_text = fid.to_markdown(res)
    a.out.with_suffix(".md").write_text(md_text)
    print(md_text)


if __name__ == "__main__":
    main()
