"""vLLM itself on one GPU, as RL rollouts run it: BF16, FP8, vLLM's NVFP4 and FourSight, one engine per process.

    python benchmarks/engine/bench_engine.py --out DIR                       # every row, every workload
    python benchmarks/engine/bench_engine.py --rows bf16,fs128 --out DIR     # some rows
    python benchmarks/engine/bench_engine.py --dry-run --out DIR             # CPU: arguments, models, the table, no engine

Model: a Llama-3.1-8B-shaped decoder (``llama-3.1-8b-config.json``: 32 layers, hidden 4096, GQA 32/8, MLP 14336,
vocab 128256), random weights made on the device by vLLM's dummy loader (uniform in ±1e-3; no checkpoint, no
tokenizer: token-id prompts) and quantized there by each row's method:

* ``bf16``: vLLM unquantized; ``fp8``: ``quantization="fp8"`` (vLLM's dynamic FP8 of the BF16 weights);
* ``nvfp4``: vLLM's own NVFP4 (a compressed-tensors ``nvfp4-pack-quantized`` config, as FourSight's export writes
  it; on Hopper vLLM serves it with Marlin, W4A16); the dummy loader leaves its packed weights as allocated;
* ``fs0`` / ``fs128``: ``quantization="foursight"`` (online, weight-based channels, ``FOURSIGHT_CHANNEL_BUDGET``
  0 or 128 BF16 channels per input), as a serving engine: ``FOURSIGHT_ONLINE_KEEP_BF16=0`` frees the BF16 weights
  once quantized, as a FourSight checkpoint would hold them;
* ``fs128keep``: the same with the BF16 weights kept (the default, what an RL engine that takes weight syncs holds).

vLLM's defaults otherwise: ``torch.compile`` and CUDA graphs on, prefix caching on, ``gpu_memory_utilization``
0.9, ``max_num_seqs`` 512 (the largest workload), ``max_model_len`` 1024.

Workloads, as RL rollouts run: 256-token random prompts, 512 output tokens each (``ignore_eos``), n = 8 samples
per prompt, sampled at temperature 1, submitted at once as one wave of ``c`` sequences: ``c`` = 64, 256, 512
(8, 32, 64 prompts), plus latency rows at ``c`` = 1 (n = 1) and 16 (2 prompts x 8).

Per row and workload: output tokens/s (all output tokens / the wave's wall time), time per output token (the
wave's wall time minus that of the same wave with ``max_tokens=1`` on fresh prompts, over 511 steps), and once
per row the weights' GPU memory (vLLM's own "Model loading took X GiB" line) and the KV-cache capacity vLLM
reports ("GPU KV cache size: N tokens") at utilization 0.9. Every row runs in its own process (a fresh CUDA
context, vLLM's own engine-core process), one after the other, on one machine. The output names the card,
the commit and the kernels' sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# an engine as users run it: the autotuner's choices kept on disk, so that a second start on this card skips the timing
os.environ.setdefault("FOURSIGHT_TUNE_CACHE", str(Path.home() / ".cache" / "foursight" / "autotune"))
sys.path.insert(0, str(HERE.parent))
from common import git_commit, kernels_sha256  # noqa: E402

CONFIG = HERE / "llama-3.1-8b-config.json"
ROWS = {
    "bf16": {"label": "vLLM BF16", "quantization": None},
    "fp8": {"label": "vLLM FP8 (dynamic)", "quantization": "fp8"},
    "nvfp4": {"label": "vLLM NVFP4 (compressed-tensors; Marlin on Hopper)", "quantization": None, "ct_nvfp4": True},
    "fs0": {"label": "FourSight W4A4, k = 0", "quantization": "foursight", "budget": "0", "env": {"FOURSIGHT_ONLINE_KEEP_BF16": "0"}},
    "fs128": {"label": "FourSight W4A4, k = 128", "quantization": "foursight", "budget": "128", "env": {"FOURSIGHT_ONLINE_KEEP_BF16": "0"}},
    "fs128keep": {"label": "FourSight W4A4, k = 128, BF16 weights kept for syncs", "quantization": "foursight", "budget": "128"},
}
DEFAULT_ROWS = "bf16,fp8,nvfp4,fs0,fs128"
#: name -> (prompts, samples per prompt); concurrency = prompts x n, one wave
WORKLOADS = {"c1": (1, 1), "c16": (2, 8), "c64": (8, 8), "c256": (32, 8), "c512": (64, 8)}


def model_dir(row: str, root: Path) -> Path:
    """A folder with only config.json (the dummy loader needs no weights); vLLM's NVFP4 row adds the
    compressed-tensors quantization_config that FourSight's export writes (``foursight.interop``)."""
    d = root / f"model-{row}"
    d.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(CONFIG.read_text())
    if ROWS[row].get("ct_nvfp4"):
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

        qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])}, format="nvfp4-pack-quantized",
                                quantization_status=QuantizationStatus.COMPRESSED, ignore=["lm_head"])
        q = qc.to_dict()
        q["quant_method"] = "compressed-tensors"
        cfg["quantization_config"] = json.loads(json.dumps(q, default=str))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def child(args: argparse.Namespace) -> None:
    """One row in this process: start the engine, run the workloads, write the row's JSON."""
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    row = ROWS[args.child]
    if row.get("budget") is not None:
        os.environ["FOURSIGHT_CHANNEL_BUDGET"] = row["budget"]
    os.environ.update(row.get("env", {}))
    t0 = time.time()
    mdir = model_dir(args.child, Path(args.work))
    kw = dict(model=str(mdir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=args.prompt_len + args.output_len + 64, gpu_memory_utilization=args.gpu_util,
              max_num_seqs=max(WORKLOADS[w][0] * WORKLOADS[w][1] for w in args.workloads))
    if row["quantization"]:
        kw["quantization"] = row["quantization"]
    llm = LLM(**kw)
    startup = time.time() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    res = {"row": args.child, "label": row["label"], "startup_s": round(startup, 1), "kv_blocks": cc.num_gpu_blocks,
           "block_size": cc.block_size, "kv_tokens_config": (cc.num_gpu_blocks or 0) * cc.block_size, "workloads": {}}
    vocab = json.loads(CONFIG.read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int) -> list:
        return [TokensPrompt(prompt_token_ids=torch.randint(10, vocab - 10, (args.prompt_len,), generator=gen).tolist()) for _ in range(n)]

    def wave(n_prompts: int, n: int, max_tokens: int) -> tuple[float, int]:
        sp = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0, detokenize=False)
        ps = prompts(n_prompts)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        return wall, sum(len(c.token_ids) for o in outs for c in o.outputs)

    wave(16, 1, 32)  # warm-up: the first requests pay one-time costs (allocator, sampler, graphs' first replay)
    for name in args.workloads:
        if time.time() - t0 > args.budget_s:
            res["workloads"][name] = {"skipped": f"budget {args.budget_s}s spent"}
            continue
        n_prompts, n = WORKLOADS[name]
        first, _ = wave(n_prompts, n, 1)
        wall, toks = wave(n_prompts, n, args.output_len)
        res["workloads"][name] = {"concurrency": n_prompts * n, "output_tokens": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 1),
                                  "prefill_wave_s": round(first, 3), "tpot_ms": round(1000 * (wall - first) / (args.output_len - 1), 3)}
        print(f"[{args.child}] {name}: {res['workloads'][name]}", flush=True)
    Path(args.json).write_text(json.dumps(res, indent=1))


def parse_log(text: str) -> dict:
    """vLLM's own lines: the weights' memory and the KV-cache capacity."""
    out = {}
    m = re.findall(r"Model loading took ([\d.]+) GiB", text)
    if m:
        out["weights_gib"] = float(m[-1])
    m = re.findall(r"GPU KV cache size: ([\d,]+) tokens", text)
    if m:
        out["kv_tokens"] = int(m[-1].replace(",", ""))
    m = re.findall(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", text)
    if m:
        out["max_concurrency"] = float(m[-1])
    return out


def card() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "no GPU"
    except OSError:
        return "no GPU"


def table(results: list[dict], header: str, workloads: list[str]) -> str:
    base = next((r for r in results if r["row"] == "bf16" and "workloads" in r), None)
    lines = [header, "", "| row | weights GiB | KV-cache tokens | " + " | ".join(f"tok/s c={WORKLOADS[w][0] * WORKLOADS[w][1]}" for w in workloads)
             + " | " + " | ".join(f"TPOT ms c={WORKLOADS[w][0] * WORKLOADS[w][1]}" for w in workloads) + " |",
             "|---|---:|---:|" + "---:|" * (2 * len(workloads))]
    for r in results:
        if "error" in r:
            lines.append(f"| {r.get('label', r['row'])} | failed: {r['error'][:120]} |")
            continue
        cells = []
        for w in workloads:
            x = r["workloads"].get(w, {})
            b = (base or {}).get("workloads", {}).get(w, {})
            if "tok_s" not in x:
                cells.append("—")
            elif "tok_s" in b and r is not base:
                cells.append(f"{x['tok_s']:,.0f} ({x['tok_s'] / b['tok_s']:.2f}x)")
            else:
                cells.append(f"{x['tok_s']:,.0f}")
        tpot = [f"{r['workloads'][w]['tpot_ms']:.2f}" if "tpot_ms" in r["workloads"].get(w, {}) else "—" for w in workloads]
        kv = r.get("kv_tokens") or r.get("kv_tokens_config")
        kvs = "—" if not kv else f"{kv:,}" + (f" ({kv / (base.get('kv_tokens') or base.get('kv_tokens_config')):.2f}x)" if base and r is not base and kv else "")
        lines.append(f"| {r['label']} | {r.get('weights_gib', float('nan')):.2f} | {kvs} | " + " | ".join(cells) + " | " + " | ".join(tpot) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, from {', '.join(ROWS)} (default {DEFAULT_ROWS})")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--gpu-util", type=float, default=0.9)
    ap.add_argument("--budget-s", type=float, default=360, help="per row: workloads not started by then are skipped")
    ap.add_argument("--timeout-s", type=float, default=450, help="per row: the process is killed after this")
    ap.add_argument("--out", required=False, default="out/engine")
    ap.add_argument("--dry-run", action="store_true", help="write the models and an empty table, start no engine")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in args.workloads if w not in WORKLOADS] + [r for r in args.rows.split(",") if r not in ROWS]
    if bad:
        ap.error(f"unknown rows or workloads: {bad}")
    if args.child:
        return child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"vLLM engine benchmark (benchmarks/engine/bench_engine.py): card {card()}, commit {git_commit()}, kernels sha256 "
              f"{kernels_sha256()[:16]}; Llama-3.1-8B-shaped, dummy weights; prompts {args.prompt_len}, outputs {args.output_len}, "
              f"gpu_memory_utilization {args.gpu_util}")
    results = []
    # one fixed folder per row: vLLM's compile cache is keyed by the model's path, so a second start reuses it
    work = str(Path(tempfile.gettempdir()) / "foursight-engine-models")
    Path(work).mkdir(parents=True, exist_ok=True)
    for row in args.rows.split(","):
        if args.dry_run:
            if not ROWS[row].get("ct_nvfp4"):  # compressed-tensors may be absent on the CPU side
                model_dir(row, Path(work))
            results.append({"row": row, "label": ROWS[row]["label"], "workloads": {}})
            continue
        js, log = out / f"{row}.json", out / f"{row}.log"
        js.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", row, "--json", str(js), "--work", work, "--workloads", ",".join(args.workloads),
               "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--gpu-util", str(args.gpu_util),
               "--budget-s", str(args.budget_s)]
        t = time.time()
        print(f"[bench_engine] {row}: {' '.join(cmd[1:])}", flush=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text(errors="replace")
        res = json.loads(js.read_text()) if js.exists() else {"row": row, "label": ROWS[row]["label"],
                                                                 "error": f"exit {rc}: " + " ".join(text.strip().splitlines()[-3:])}
        res.update(parse_log(text))
        res["process_s"] = round(time.time() - t, 1)
        results.append(res)
        print(f"[bench_engine] {row}: {json.dumps({k: v for k, v in res.items() if k != 'workloads'})}", flush=True)
        (out / "engine.json").write_text(json.dumps({"header": header, "rows": results}, indent=1))
        (out / "engine.md").write_text(table(results, header, args.workloads))
    (out / "engine.json").write_text(json.dumps({"header": header, "rows": results}, indent=1))
    (out / "engine.md").write_text(table(results, header, args.workloads))
    print((out / "engine.md").read_text())


def merge(paths: list[str], out: str) -> None:
    """One table from the engine.json of several calls (rows measured on one warm machine, one call each)."""
    rows, headers = [], []
    for p in paths:
        d = json.loads(Path(p).read_text())
        headers.append(d["header"])
        rows += d["rows"]
    names = [w for w in WORKLOADS if any(w in r.get("workloads", {}) for r in rows)]
    Path(out).write_text(table(rows, "\n".join(sorted(set(headers))), names))


if __name__ == "__main__":
    main()
