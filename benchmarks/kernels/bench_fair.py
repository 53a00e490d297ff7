#!/usr/bin/env python
"""Fair yardsticks for the decode step (issue 52 item 0): FP8 as an engine runs it, the linears alone, clocks
with every timing, baseline and candidates in interleaved rounds.

Why: the FP8 row of the earlier benchmarks quantized each activation with six eager kernels
(``baselines.Fp8RowwiseLinear``) while BF16 and FourSight got one-launch fused producers, and every method was
timed in its own block, so a clock or thermal drift between blocks went into the ratios unrecorded. Here:

* **Per layer** (``--ms``; the four linears of the Llama-3.1-8B decoder with the producer each one reads: qkv and
  gate_up the residual add + RMSNorm, down SiLU·mul of gate_up's output, o_proj none), µs per call of each method,
  on rotated weight copies (whose BF16 bytes pass 240 MB, as ``baselines.py``; the pass ends in the read flush):

  - ``bf16``: the BF16 producer (``foursight.kernels.api.rms_norm`` / ``silu_mul``) + cuBLAS; ``bf16-gemm``: cuBLAS alone;
  - ``fp8-fused``: the FP8 producer with its per-token quantization in one launch
    (``foursight.kernels.fp8_producers``; o_proj: one quantizer launch) + ``torch._scaled_mm``; ``fp8-gemm``: the
    GEMM alone on the quantized row; ``fp8-eager``: the BF16 producer, six eager quantization kernels and the GEMM
    (the earlier benchmarks' FP8, for the record);
  - ``w4a4``: FourSight's producer quantizing for its consumer + the GEMM (o_proj: quantizer + GEMM);
    ``w4a4-gemm``: the GEMM alone on the produced input (not for o_proj).

* **Decode** (``--batches``, ``--modes`` of bench_decode.py; default ``bf16,fp8-fused,foursight-w4a4,foursight-w4a4-k0``),
  the 8B-shaped decoder of bench_decode.py with fused producers and ``--attention``: the whole step, and the
  **linears alone** (the 4 linears x 32 layers of one step on static inputs in the form the step gives them; the
  quantization inside a producer is not in it, o_proj's standalone quantizer is; lm_head not counted), each a CUDA
  graph.

Every method of a table is timed in **interleaved rounds** (``common.interleaved_rounds``: each round runs every
method once, in an order rotated by one each round) and reported as min / median / max over ``--rounds``; each
sample is one replay of a graph of ``--reps`` calls (``common.GraphTimer``, the package timer's measurement). The
GPU's SM and memory clocks, temperature, power and throttle reasons (``common.gpu_clocks``) are read after every
round and kept beside the samples. Nothing about speed is asserted.

``--dry-run``: the CPU, the tiny decoder, tiny layer shapes and the Triton interpreter (set here), every method
through the same code with an eager wall-clock timer in place of the graphs: a check of the plumbing, no figure.

Usage::

    python benchmarks/kernels/bench_fair.py --out $OUT                      # H100/H200: layers at M 1/16/64, decode at batch 1/16/64
    python benchmarks/kernels/bench_fair.py --dry-run --out /tmp/fair       # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import baselines  # noqa: E402  (benchmarks/kernels/baselines.py)
import bench_decode as bd  # noqa: E402  (benchmarks/kernels/bench_decode.py)
from common import GraphTimer, gpu_clocks, interleaved_rounds  # noqa: E402  (benchmarks/common.py)

from foursight.channels import relative_error  # noqa: E402

LAYER_METHODS = ("bf16", "bf16-gemm", "fp8-fused", "fp8-gemm", "fp8-eager", "w4a4", "w4a4-gemm")
DEFAULT_MODES = "bf16,fp8-fused,foursight-w4a4,foursight-w4a4-k0"
#: the producer each of the decoder's linears reads
PRODUCER_OF = {"qkv": "rms_norm", "o": None, "gate_up": "rms_norm", "down": "silu_mul"}


class WallTimer:
    """The dry run's stand-in for :class:`common.GraphTimer`: wall-clock ms of one eager ``fn()`` per sample."""

    def __init__(self, fn, reps: int = 1):
        self.fn, self.reps = fn, reps
        fn()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.reps):
            self.fn()
        return 1e3 * (time.perf_counter() - t0) / self.reps


def _timer(fn, args, flush: bool = True):
    return WallTimer(fn) if args.dry_run else GraphTimer(fn, reps=args.reps, flush=flush)


def _clocks(args):
    return None if args.dry_run else (lambda: gpu_clocks(torch.cuda.current_device()))


def _clock_summary(clocks: list) -> dict:
    """min / max of the SM and memory clocks over the rounds, and every throttle-reason mask seen."""
    ok = [c for c in clocks if c and "error" not in c]
    if not ok:
        return {"error": clocks[0].get("error") if clocks and clocks[0] else "no clocks read"}
    out = {}
    for key in ("sm_mhz", "mem_mhz", "temp_c", "power_w"):
        v = [c[key] for c in ok if c.get(key) is not None]
        if v:
            out[key] = [min(v), max(v)]
    out["max_sm_mhz"] = ok[0].get("max_sm_mhz")
    out["max_mem_mhz"] = ok[0].get("max_mem_mhz")
    out["throttle_reasons"] = sorted({str(c.get("throttle_reasons")) for c in ok})
    return out


# ---------------------------------------------------------------------------------------------
# per layer
# ---------------------------------------------------------------------------------------------


def layer_methods(name: str, n: int, k: int, m: int, cfg, dev, copies: int, channels: int, seed: int) -> tuple[dict, dict]:
    """``({method: one pass over the copies}, {method: relative error against the fp32 product of the BF16 row})``
    for one linear ``name`` [n, k] at ``m`` rows (the methods: the module docstring)."""
    import foursight.kernels.api as fk  # noqa: PLC0415
    import foursight.kernels.fp8_producers as fp  # noqa: PLC0415
    from foursight.layer import quantize_weight  # noqa: PLC0415

    g = torch.Generator(device=dev).manual_seed(seed + 31 * m + n)
    bf = torch.bfloat16
    prod = PRODUCER_OF[name]
    x = torch.randn(m, 2 * k if prod == "silu_mul" else k, device=dev, dtype=bf, generator=g)
    r = torch.randn(m, k, device=dev, dtype=bf, generator=g) if prod == "rms_norm" else None
    wn = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(bf) if prod == "rms_norm" else None
    eps = cfg.eps
    ws = [(torch.randn(n, k, device=dev, dtype=bf, generator=g) * k**-0.5) for _ in range(copies)]

    def bf16_row():  # the BF16 producer's row (no consumer)
        if prod == "rms_norm":
            return fk.rms_norm(x, wn, eps, residual=r)[0].y
        if prod == "silu_mul":
            return fk.silu_mul(x).y
        return x

    def fp8_in():
        if prod == "rms_norm":
            return fp.rms_norm_fp8(x, wn, eps, residual=r)[0]
        if prod == "silu_mul":
            return fp.silu_mul_fp8(x)
        return fp.quantize_fp8(x)

    fp8w = [baselines.quantize_weight_fp8(w) for w in ws]
    ch = bd._channels(k, channels, seed, 0, name, dev)
    pws = [fk.prepare_weight(quantize_weight(w, ch), name=f"fair.{name}.{i}") for i, w in enumerate(ws)]

    def w4a4_in(pw):
        if prod == "rms_norm":
            return fk.rms_norm(x, wn, eps, residual=r, consumer=pw)[0]
        if prod == "silu_mul":
            return fk.silu_mul(x, consumer=pw)
        return x  # o_proj: splice_linear quantizes

    y0 = bf16_row()
    fp8_0 = fp8_in()
    w4_0 = [w4a4_in(pw) for pw in pws]
    out = {
        "bf16": lambda: [F.linear(bf16_row(), w) for w in ws],
        "bf16-gemm": lambda: [F.linear(y0, w) for w in ws],
        "fp8-fused": lambda: [baselines.fp8_rowwise_mm(p.q, p.scale, wq, sw) for (wq, sw) in fp8w for p in (fp8_in(),)],
        "fp8-gemm": lambda: [baselines.fp8_rowwise_mm(fp8_0.q, fp8_0.scale, wq, sw) for (wq, sw) in fp8w],
        "fp8-eager": lambda: [baselines.fp8_rowwise_mm(*baselines.quantize_act_fp8(bf16_row()), wq, sw) for (wq, sw) in fp8w],
        "w4a4": lambda: [fk.splice_linear(w4a4_in(pw), pw) for pw in pws],
    }
    if prod is not None:
        out["w4a4-gemm"] = lambda: [fk.splice_linear(p, pw) for p, pw in zip(w4_0, pws)]
    # what each method computes, against the fp32 product of its row (one copy): a wrong wiring shows here
    ref = F.linear(y0.float(), ws[0].float())
    out_check = {
        "bf16": relative_error(F.linear(y0, ws[0]), ref),
        "fp8-fused": relative_error(baselines.fp8_rowwise_mm(fp8_0.q, fp8_0.scale, *fp8w[0]), ref),
        "fp8-eager": relative_error(baselines.fp8_rowwise_mm(*baselines.quantize_act_fp8(y0), *fp8w[0]), ref),
        "w4a4": relative_error(fk.splice_linear(w4a4_in(pws[0]), pws[0]), ref),
    }
    return out, out_check


def run_layers(args, cfg, dev, res, out_dir, t_start) -> None:
    wanted = [v.strip() for v in args.linears.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in PRODUCER_OF]
    if unknown:
        raise SystemExit(f"bench_fair: --linears {unknown} not among {', '.join(PRODUCER_OF)}")
    shapes = {name: nk for name, nk in cfg.linear_shapes().items() if name in wanted}
    ms = [int(v) for v in args.ms.split(",") if v.strip()]
    for name, (n, k) in shapes.items():
        for m in ms:
            key = f"{name}/M={m}"
            if time.time() - t_start > args.budget_s:
                res["layers"][key] = {"skipped": f"time budget of {args.budget_s:.0f}s reached"}
                continue
            copies = 1 if args.dry_run else max(1, min(16, math.ceil(240 * 2**20 / (n * k * 2))))
            row = {"N": n, "K": k, "M": m, "producer": PRODUCER_OF[name], "copies": copies}
            try:
                fns, row["rel_err_vs_fp32"] = layer_methods(name, n, k, m, cfg, dev, copies, args.channels, args.seed)
                timers = {meth: _timer(fn, args) for meth, fn in fns.items()}
                rr = interleaved_rounds(timers, args.rounds, _clocks(args))
                row["us_per_call"] = {meth: {kk: (1e3 * v / copies if kk != "n" else v) for kk, v in st.items()}
                                      for meth, st in rr["stats"].items()}
                row["order"], row["clocks"] = rr["order"], rr["clocks"]
                row["clock_summary"] = _clock_summary(rr["clocks"]) if rr["clocks"] else None
                med = {meth: st["median"] for meth, st in row["us_per_call"].items()}
                print(f"[bench_fair] {key}: " + ", ".join(f"{meth} {v:.1f}" for meth, v in med.items()) + " µs (median)", flush=True)
            except Exception as e:  # noqa: BLE001 - recorded, the next cell runs
                row["error"] = bd._err(e)
                print(f"[bench_fair] {key}: {row['error']}", flush=True)
            res["layers"][key] = row
            bd._free(dev)
            _write(res, out_dir)


# ---------------------------------------------------------------------------------------------
# decode: the whole step and the linears alone
# ---------------------------------------------------------------------------------------------


def linears_only(model, lins: list, b: int, seed: int):
    """A callable running one decode step's linears (4 per layer) on static inputs of batch ``b`` in the form the
    step gives them (the producers run once here, not in the timed call)."""
    c, dev, bf = model.cfg, model.dev, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed + 13)
    inputs = []
    for w, L in zip(model.weights, lins):
        x = torch.randn(b, c.hidden, device=dev, dtype=bf, generator=g)
        d = torch.randn(b, c.hidden, device=dev, dtype=bf, generator=g)
        h_qkv = model._add_norm(x, d, w["attn_norm"], L["qkv"])[1]
        o_in = torch.randn(b, c.q_dim, device=dev, dtype=bf, generator=g)
        h_gu = model._add_norm(x, d, w["mlp_norm"], L["gate_up"])[1]
        d_in = model.down_input(L["down"], torch.randn(b, 2 * c.intermediate, device=dev, dtype=bf, generator=g))
        inputs.append((h_qkv, o_in, h_gu, d_in))

    def fn():
        for L, (a, o, gu, dn) in zip(lins, inputs):
            L["qkv"](a)
            L["o"](o)
            L["gate_up"](gu)
            y = L["down"](dn)
        return y

    return fn


def run_decode(args, cfg, dev, res, out_dir, t_start) -> None:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    batches = sorted({int(v) for v in args.batches.split(",") if v.strip()})
    model = bd.Decoder(cfg, dev, max(batches), args.context, args.context + 1, seed=args.seed, producers="fused",
                       attention=args.attention)
    # the attention asked for, else the next one that runs here (recorded): a failed compile must not cost the table
    c = cfg
    for att in [args.attention] + [a for a in ("flash", "sdpa") if a != args.attention]:
        model.attention, model._flex = att, None
        try:
            q = torch.randn(1, c.heads, 1, c.head_dim, device=dev, dtype=torch.bfloat16)
            kv = torch.randn(1, c.kv_heads, args.context + 1, c.head_dim, device=dev, dtype=torch.bfloat16)
            model.attend(q, kv, kv)
            bd._sync(dev)
            break
        except Exception as e:  # noqa: BLE001
            res["decode"].setdefault("attention_errors", {})[att] = bd._err(e)
            print(f"[bench_fair] attention {att}: {bd._err(e)}", flush=True)
    res["decode"]["attention"] = model.attention
    bargs = types.SimpleNamespace(channels=args.channels, seed=args.seed)
    built, cache = {}, {}
    for mode in modes:
        try:
            built[mode] = bd.build_linears(mode, model, bargs, cache)[0]
            res["decode"]["modes"][mode] = {"status": "built"}
        except Exception as e:  # noqa: BLE001
            res["decode"]["modes"][mode] = {"status": "error", "error": bd._err(e)}
            print(f"[bench_fair] decode {mode}: {bd._err(e)}", flush=True)
    for b in batches:
        if time.time() - t_start > args.budget_s:
            res["decode"]["batches"][str(b)] = {"skipped": f"time budget of {args.budget_s:.0f}s reached"}
            continue
        row = {"batch": b}
        steps, lin = {}, {}
        logits_of = {}
        for mode, lins in built.items():
            try:
                model.linears = lins
                logits = model.decode_step(b)[1].float()  # eager first: autotuners run here, never inside a capture
                bd._sync(dev)
                logits_of[mode] = logits.clone()
                steps[mode] = _timer(lambda lins=lins: (setattr(model, "linears", lins), model.decode_step(b))[1], args)
                lf = linears_only(model, lins, b, args.seed)
                lf()
                lin[mode] = _timer(lf, args)
            except Exception as e:  # noqa: BLE001
                row.setdefault("errors", {})[mode] = bd._err(e)
                print(f"[bench_fair] decode B={b} {mode}: {row['errors'][mode]}", flush=True)
        model.linears = None
        if "bf16" in logits_of:
            row["check_logits_rel_vs_bf16"] = {mm: relative_error(v, logits_of["bf16"]) for mm, v in logits_of.items()}
        if "fp8" in logits_of and "fp8-fused" in logits_of:
            # the same codes by two roads (eager quantizer, fused producer): differences only from the RMSNorm's sum order
            row["check_fp8_fused_vs_eager_rel"] = relative_error(logits_of["fp8-fused"], logits_of["fp8"])
        del logits_of
        for part, timers in (("step", steps), ("linears", lin)):
            if not timers:
                continue
            rr = interleaved_rounds(timers, args.rounds, _clocks(args))
            row[part] = {"ms": rr["stats"], "order": rr["order"], "clocks": rr["clocks"],
                         "clock_summary": _clock_summary(rr["clocks"]) if rr["clocks"] else None}
        if "step" in row:
            row["tokens_per_s_median"] = {mode: b / (st["median"] * 1e-3) for mode, st in row["step"]["ms"].items()}
            print(f"[bench_fair] decode B={b}: step " + ", ".join(f"{mm} {st['median']:.3f}" for mm, st in row["step"]["ms"].items())
                  + " ms; linears " + ", ".join(f"{mm} {st['median']:.3f}" for mm, st in row.get("linears", {}).get("ms", {}).items())
                  + " ms (median)", flush=True)
        res["decode"]["batches"][str(b)] = row
        del steps, lin
        bd._free(dev)
        _write(res, out_dir)
    built.clear()
    cache.clear()


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def _write(res: dict, out_dir: Path) -> None:
    (out_dir / "bench_fair.json").write_text(json.dumps(res, indent=1))
    (out_dir / "bench_fair.md").write_text(markdown(res))


def _mmm(st: dict | None, scale: float = 1.0, spec: str = ".1f") -> str:
    if not st:
        return "—"
    return f"{st['median'] * scale:{spec}} ({st['min'] * scale:{spec}}–{st['max'] * scale:{spec}})"


def _clk(cs: dict | None) -> str:
    if not cs:
        return "—"
    if "error" in cs:
        return "none read"
    sm, mem = cs.get("sm_mhz"), cs.get("mem_mhz")
    return (f"SM {sm[0]:.0f}–{sm[1]:.0f} / {cs.get('max_sm_mhz') or 0:.0f}, mem {mem[0]:.0f}–{mem[1]:.0f} MHz, "
            f"reasons {', '.join(cs.get('throttle_reasons', []))}") if sm and mem else "incomplete"


def markdown(res: dict) -> str:
    env, st = res["env"], res["settings"]
    dev = env.get("gpu") or f"CPU ({env.get('device')})"
    lines = [f"# Fair yardsticks (issue 52 item 0) on {dev} ({env['date_utc']} UTC)", "",
             f"Command: `{env['command']}`; torch {env['torch']}, triton {env.get('triton')}, kernels sha256 "
             f"{env.get('kernels_sha256')} (git {env.get('git_commit')}{', kernels/ modified' if env.get('kernels_dirty') else ''}).",
             f"Method: {res['method']}", ""]
    if res.get("dry_run"):
        lines += ["**Dry run on the CPU (Triton interpreter, eager wall clock): no figure here is a GPU timing.**", ""]
    if res["layers"]:
        lines += [f"## Per layer: µs per call, median (min–max) over {st['rounds']} interleaved rounds; x = BF16 (producer + cuBLAS) / method", "",
                  "| linear | M | " + " | ".join(LAYER_METHODS) + " | fp8-fused x | w4a4 x | clocks over the rounds |",
                  "|---|---|" + "---|" * (len(LAYER_METHODS) + 3)]
        for key, row in res["layers"].items():
            name, m = key.split("/M=")
            if "us_per_call" not in row:
                lines.append(f"| {name} | {m} | " + " | ".join(["—"] * len(LAYER_METHODS)) + f" | | | {row.get('error') or row.get('skipped')} |")
                continue
            u = row["us_per_call"]
            base = u.get("bf16", {}).get("median")

            def x(meth, u=u, base=base):
                v = u.get(meth, {}).get("median")
                return f"{base / v:.2f}x" if (v and base) else "—"

            lines.append(f"| {name} | {m} | " + " | ".join(_mmm(u.get(meth)) for meth in LAYER_METHODS)
                         + f" | {x('fp8-fused')} | {x('w4a4')} | {_clk(row.get('clock_summary'))} |")
    dec = res["decode"]
    if dec["batches"]:
        modes = list(dec["modes"])
        lines += ["", f"## Decode ({dec.get('attention', st['attention'])} attention): ms per step and for the linears alone, median (min–max) over "
                  f"{st['rounds']} interleaved rounds; x = BF16 / mode", "",
                  "| batch | part | " + " | ".join(modes) + " | " + " | ".join(f"{mm} x" for mm in modes if mm != "bf16") + " | clocks |",
                  "|---|---|" + "---|" * (2 * len(modes))]
        for b, row in dec["batches"].items():
            for part in ("step", "linears"):
                p = row.get(part)
                if not p:
                    continue
                base = p["ms"].get("bf16", {}).get("median")
                xs = [f"{base / p['ms'][mm]['median']:.2f}x" if (base and mm in p["ms"]) else "—" for mm in modes if mm != "bf16"]
                lines.append(f"| {b} | {part} | " + " | ".join(_mmm(p["ms"].get(mm), 1.0, ".3f") for mm in modes) + " | "
                             + " | ".join(xs) + f" | {_clk(p.get('clock_summary'))} |")
            if row.get("errors") or row.get("skipped"):
                lines.append(f"| {b} | errors | {json.dumps(row.get('errors') or row.get('skipped'))[:400]} |")
        lines += ["", "Logits of one eager step against BF16's (relative error): "
                  + "; ".join(f"B={b}: " + ", ".join(f"{mm} {v:.2e}" for mm, v in row.get("check_logits_rel_vs_bf16", {}).items() if v is not None)
                              for b, row in dec["batches"].items() if "check_logits_rel_vs_bf16" in row)]
        errs = [f"- {mm}: {r['error']}" for mm, r in dec["modes"].items() if r.get("error")]
        if errs:
            lines += ["", "Modes that did not build:", ""] + errs
    return "\n".join(lines) + "\n"


METHOD = ("per layer: each method's pass over rotated weight copies (BF16 bytes > 240 MB; 1 copy in a dry run), one sample = one "
          "replay of a CUDA graph of --reps passes with the read flush before each, minus the flushes (common.GraphTimer), / copies; "
          "decode: the whole step (embedding, layers with fused producers, final norm, lm_head) and the linears alone (4 a layer, "
          "static inputs in the step's form: producers' quantization excluded, o_proj's quantizer included, lm_head excluded), "
          "each one graph replay of --reps calls per sample; every table's methods in interleaved rounds (common.interleaved_rounds), "
          "clocks (common.gpu_clocks) after each round")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="decode,layers",
                    help="decode, layers or both, run in the order given (default: the decode first, the headline of issue 52)")
    ap.add_argument("--ms", default=None, help="rows per linear in the per-layer part (default 1,16,64; dry run 1)")
    ap.add_argument("--linears", default="qkv,o,gate_up,down", help="the linears of the per-layer part")
    ap.add_argument("--batches", default=None, help="decode batches (default 1,16,64; dry run 1)")
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"decode modes (bench_decode.py's: {', '.join(bd.ALL_MODES)})")
    ap.add_argument("--attention", choices=bd.ATTENTION, default="flex", help="decode attention (bench_decode.py --attention)")
    ap.add_argument("--context", type=int, default=None, help="tokens in the KV cache (default 1024; dry run 32)")
    ap.add_argument("--channels", type=int, default=None, help="FourSight BF16 channels per linear (default 128; dry run 32)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7; dry run 3)")
    ap.add_argument("--reps", type=int, default=8, help="calls per graph replay (one sample)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no new cell after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter, eager timer: the plumbing only")
    args = ap.parse_args()
    dry = args.dry_run
    if args.context is None:
        args.context = 32 if dry else 1024
    if args.channels is None:
        args.channels = 32 if dry else 128
    if args.rounds is None:
        args.rounds = 2 if dry else 7
    if args.ms is None:
        args.ms = "1" if dry else "1,16,64"
    if args.batches is None:
        args.batches = "1" if dry else "1,16,64"
    if dry:
        args.reps = 1
    dev = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        sys.exit("bench_fair: no CUDA GPU (use --dry-run on the CPU)")
    cfg = bd.TINY if dry else bd.LLAMA_3_1_8B
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - {"decode", "layers"}:
        sys.exit(f"bench_fair: --parts takes decode and/or layers, got {args.parts!r}")
    res = {"dry_run": dry, "env": bd.environment(dev), "settings": dict(vars(args)), "method": METHOD,
           "model": dict(vars(cfg), name="tiny" if dry else "llama-3.1-8b-shaped (random weights)"),
           "clocks_before": None if dry else gpu_clocks(torch.cuda.current_device()),
           "layers": {}, "decode": {"modes": {}, "batches": {}}}
    t_start = time.time()
    for part in parts:
        if part == "layers":
            run_layers(args, cfg, dev, res, out_dir, t_start)
            continue
        try:
            run_decode(args, cfg, dev, res, out_dir, t_start)
        except Exception as e:  # noqa: BLE001
            res["decode"]["error"] = bd._err(e)
            print(f"[bench_fair] decode: {res['decode']['error']}", flush=True)
        bd._free(dev)
    res["clocks_after"] = None if dry else gpu_clocks(torch.cuda.current_device())
    res["total_s"] = time.time() - t_start
    _write(res, out_dir)
    print((out_dir / "bench_fair.md").read_text())


if __name__ == "__main__":
    main()
