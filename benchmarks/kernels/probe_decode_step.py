#!/usr/bin/env python
"""Where a decode step's GPU time goes: kernel time per category, per mode and batch (issue 36).

The per-layer grid and the breakdown time one linear alone; the end-to-end targets are about the
8B-shaped decode step of ``bench_decode.py``. This probe builds that same step (the same ``Decoder``,
the same linears, captured in a CUDA graph after an eager warm-up that runs the autotuners), replays
the graph under ``torch.profiler`` and sums the GPU time of every kernel the replays ran, by
category:

* ``quantizer`` — FourSight's activation quantizer (``_act_quant*``),
* ``foursight_gemm`` — FourSight's GEMM kernels and their split-K reduction (``_fragment*``,
  ``_dequant*``, ``_splice*``, ``_split_reduce*``, …),
* ``cublas`` — cuBLAS / cuBLASLt GEMMs (``nvjet*``, ``*gemm*``, ``cutlass*``, ``sm90_xmma*``),
* ``attention`` — SDPA's kernels (``*flash*``, ``*fmha*``, ``*attention*``),
* ``producer`` — FourSight's fused producers (``_producer_kernel``: the residual add + RMSNorm or SiLU·mul,
  with the activation quantizer in the W4A4 modes; ``--producers fused``),
* ``norm`` — RMSNorm (``*rms*``, ``*norm*``),
* ``other`` — everything else (RoPE, SiLU·mul, residual adds, KV-cache writes, copies, …).

Per (mode, batch) it reports the step time by the package timer (as ``bench_decode``), the summed
kernel time per category per step, the number of kernels per step, and the step time not covered
by kernels (launch gaps and dependencies inside the graph). The replays run back to back without
an L2 flush, so a category's time is a composition, not the timer's figure; compare the rows of one
run. What it answers: how much of k = 128's step over k = 0's is GEMM and how much is not, and what
share of the FourSight step the quantizer holds (the bound on what fusing it into its producer,
issue 36 item 2's option, could save).

Usage (GPU)::

    python benchmarks/kernels/probe_decode_step.py --out /tmp/ds                    # bf16, W4A4 k=128 and k=0; B = 1,16,64
    TRITON_INTERPRET=1 python benchmarks/kernels/probe_decode_step.py --tiny --device cpu --out /tmp/ds   # CPU smoke

On the CPU there are no CUDA kernels: the smoke test runs the eager step under the profiler and
reports the CPU operators' categories instead (it checks the plumbing, not the numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import bench_decode as bd  # noqa: E402  (benchmarks/kernels/bench_decode.py: the model and its linears)
from common import git_commit, kernels_sha256  # noqa: E402  (benchmarks/common.py)

CATEGORIES = ("quantizer", "producer", "foursight_gemm", "cublas", "attention", "norm", "other")

# first match wins, in this order (a quantizer name may also contain "quant"; FourSight's GEMMs start with "_")
_RULES = (
    ("quantizer", re.compile(r"_act_quant", re.I)),
    ("producer", re.compile(r"^_producer_kernel", re.I)),
    ("foursight_gemm", re.compile(r"^_(fragment|dequant|splice|split_reduce|ws_twin)|^dot_scaled_kernel|gluon_ws", re.I)),
    ("cublas", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|xmma_|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
)


def category(kernel_name: str) -> str:
    """The category of one kernel (or operator) name; ``other`` when no rule matches."""
    for cat, rx in _RULES:
        if rx.search(kernel_name):
            return cat
    return "other"


def summarize(events: list[tuple[str, float]], steps: int) -> dict:
    """Per-step totals from ``(name, duration_us)`` kernel events collected over ``steps`` replays."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    per = {c: 0.0 for c in CATEGORIES}
    names: dict[str, list] = {}
    for name, us in events:
        c = category(name)
        per[c] += us
        rec = names.setdefault(name, [c, 0, 0.0])
        rec[1] += 1
        rec[2] += us
    top = sorted(names.items(), key=lambda kv: -kv[1][2])[:12]
    return {
        "us_per_step": {c: per[c] / steps for c in CATEGORIES},
        "kernel_us_per_step": sum(per.values()) / steps,
        "kernels_per_step": len(events) / steps,
        "top_kernels": [{"name": n[:120], "category": c, "per_step": k / steps, "us_per_step": us / steps}
                        for n, (c, k, us) in top],
    }


def _profile(fn, dev: torch.device, steps: int) -> tuple[list[tuple[str, float]], str]:
    """Kernel events of ``steps`` calls of ``fn`` (GPU kernels on CUDA, operators on the CPU)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        bd._sync(dev)
    out = []
    for e in prof.events():
        if dev.type == "cuda":
            if str(getattr(e, "device_type", "")).endswith("CUDA") and e.device_time > 0:
                out.append((e.name, float(e.device_time)))
        elif e.cpu_parent is None and e.cpu_time_total > 0:  # top-level CPU operators only
            out.append((e.name, float(e.cpu_time_total)))
    return out, ("CUDA kernels (device_time)" if dev.type == "cuda" else "top-level CPU operators (cpu_time_total)")


def probe(model: bd.Decoder, b: int, args) -> dict:
    dev = model.dev
    model.decode_step(b)  # eager first: the autotuners run here, never inside the capture
    bd._sync(dev)
    row: dict = {"batch": b}
    if dev.type == "cuda":
        from foursight.kernels.tuning import time_gpu  # noqa: PLC0415

        g, _ = bd._capture(lambda: model.decode_step(b), dev)
        row["step_ms_timer"] = time_gpu(lambda: model.decode_step(b), reps=8, rounds=args.reps)
        events, what = _profile(g.replay, dev, args.steps)
        del g
    else:
        events, what = _profile(lambda: model.decode_step(b), dev, args.steps)
    row["profiled"] = what
    row.update(summarize(events, args.steps))
    if "step_ms_timer" in row:
        row["uncovered_us_per_step"] = 1e3 * row["step_ms_timer"] - row["kernel_us_per_step"]
    return row


def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"# Where a decode step's GPU time goes ({env.get('gpu') or 'CPU'}, {env.get('date_utc', '')})", "",
             f"Commit `{res['commit']}`, kernels sha256 `{res['kernels_sha256'][:16]}`; torch {env.get('torch')}, "
             f"triton {env.get('triton')}. Model: {res['model']}; context {res['settings']['context']}; k = "
             f"{res['settings']['channels']} BF16 channels per linear for `foursight-w4a4`. Each row: "
             f"{res['settings']['steps']} graph replays back to back under torch.profiler (no L2 flush between them), "
             "kernel time summed per category and divided by the steps; `step (timer)` is the package timer's step "
             "time (L2 flushed, as bench_decode); `uncovered` = step (timer) minus the kernels' sum.", "",
             "| mode | B | step (timer) µs | kernels µs | uncovered µs | kernels / step | "
             + " | ".join(CATEGORIES) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for mode, rows in res["modes"].items():
        for r in rows:
            if "error" in r:
                lines.append(f"| {mode} | {r.get('batch')} | error: {r['error'][:100]} |")
                continue
            st = r.get("step_ms_timer")
            cells = [mode, str(r["batch"]), f"{1e3 * st:.0f}" if st else "—", f"{r['kernel_us_per_step']:.0f}",
                     f"{r['uncovered_us_per_step']:.0f}" if "uncovered_us_per_step" in r else "—",
                     f"{r['kernels_per_step']:.0f}"] + [f"{r['us_per_step'][c]:.0f}" for c in CATEGORIES]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Largest kernels per step (name, category, launches per step, µs per step):", ""]
    for mode, rows in res["modes"].items():
        for r in rows:
            for t in r.get("top_kernels", [])[:6]:
                lines.append(f"- {mode} B={r['batch']}: `{t['name'][:90]}` ({t['category']}) "
                             f"{t['per_step']:.0f} x, {t['us_per_step']:.0f} µs")
    return "\n".join(lines) + "\n"


def write(res: dict, out: Path) -> None:
    """Both result files; called after every (mode, batch), so a run cut by a time limit keeps what it did."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_step.json").write_text(json.dumps(res, indent=1))
    (out / "decode_step.md").write_text(markdown(res))


def run(args) -> dict:
    dev = torch.device(args.device)
    cfg = bd.TINY if args.tiny else bd.LLAMA_3_1_8B
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    batches = sorted({int(v) for v in args.batches.split(",") if v.strip()})
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    res = {"env": bd.environment(dev), "commit": git_commit(), "kernels_sha256": kernels_sha256(),
           "model": "tiny" if args.tiny else "llama-3.1-8b-shaped (random weights)",
           "settings": {"batches": batches, "modes": modes, "context": args.context, "channels": args.channels,
                        "steps": args.steps, "reps": args.reps, "producers": args.producers}, "modes": {}}
    t0 = time.time()
    model = bd.Decoder(cfg, dev, max(batches), args.context, args.context + 1, seed=args.seed, producers=args.producers)
    cache: dict = {}
    for mode in modes:
        rows = res["modes"].setdefault(mode, [])
        if time.time() - t0 > args.budget_s:
            rows.append({"batch": None, "error": "time budget"})
            continue
        try:
            model.linears, _ = bd.build_linears(mode, model, args, cache)
        except Exception as e:  # noqa: BLE001 - one mode failing leaves the others
            rows.append({"batch": None, "error": bd._err(e)})
            continue
        for b in batches:
            if time.time() - t0 > args.budget_s:
                rows.append({"batch": b, "error": "time budget"})
                break
            try:
                rows.append(probe(model, b, args))
            except Exception as e:  # noqa: BLE001
                rows.append({"batch": b, "error": bd._err(e)})
            print(f"[probe_decode_step] {mode} B={b}: {json.dumps(rows[-1].get('us_per_step', rows[-1].get('error')))}",
                  flush=True)
            write(res, Path(args.out))
        model.linears = None
        bd._free(dev)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/probe_decode_step")
    ap.add_argument("--modes", default="bf16,foursight-w4a4,foursight-w4a4-k0")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=20, help="graph replays profiled per (mode, batch)")
    ap.add_argument("--reps", type=int, default=5, help="rounds of the package timer for the step time")
    ap.add_argument("--context", type=int, default=None, help="default 1024; --tiny 32")
    ap.add_argument("--channels", type=int, default=None, help="default 128; --tiny 32")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="bench_decode's tiny model (CPU smoke test)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--producers", choices=bd.PRODUCERS, default="fused", help=bd.PRODUCERS_HELP)
    ap.add_argument("--budget-s", type=float, default=150.0, help="start no new mode or batch after this many seconds")
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.context = args.context if args.context is not None else (32 if args.tiny else 1024)
    args.channels = args.channels if args.channels is not None else (32 if args.tiny else 128)
    res = run(args)
    write(res, Path(args.out))
    print(markdown(res))


if __name__ == "__main__":
    main()
