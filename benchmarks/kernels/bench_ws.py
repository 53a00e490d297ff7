#!/usr/bin/env python
"""Time the warp-specialized Gluon SpliceGEMM form (``foursight.kernels.experimental.gluon_ws``) against cuBLAS
BF16 and the best v3 form, per layer, on a CUDA sm_90 GPU.

For each shape (N x K) and M, one process measures:

* **cuBLAS BF16**: ``torch.nn.functional.linear`` on the BF16 weight;
* **v3**: ``splice_linear`` with the in-product autotuner restricted to the v3 candidates
  (``FOURSIGHT_WS=0``: fragment and dequant forms);
* **Gluon**: ``splice_linear`` with the autotuner restricted to the Gluon tiles (``FOURSIGHT_WS=only``,
  :data:`foursight.kernels.configs.WS_CONFIGS`); every candidate is checked against the reference on
  the device before it is timed, and the rejected ones are listed with their reason.

Every time is :func:`foursight.kernels.tuning.time_gpu` (CUDA-graph replays, L2 flushed before each
call), in microseconds; ratios are cuBLAS time / FourSight time. Speed is never asserted.

Usage (on the GPU machine; the package importable, see ``benchmarks/kernels/device_ws.sh``)::

    python benchmarks/kernels/bench_ws.py --out /tmp/ws                    # 3 8B shapes, M 1..256, W4A4 k=128
    python benchmarks/kernels/bench_ws.py --out /tmp/ws --modes w4a4,w4a16 --budget-s 200
    python benchmarks/kernels/bench_ws.py --out /tmp/dry --dry-run         # no GPU: arguments and provenance

Writes ``bench_ws.json`` and ``bench_ws.md`` into ``--out`` after every cell (a run stopped by its
budget or a timeout keeps what it measured). The JSON records the commit (``FOURSIGHT_COMMIT``, else git), the
sha256 of the kernels folder (the recipe of ``device_v3.sh``), the Triton and torch versions, the
device, and whether Gluon was available.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import triton

import foursight.kernels.api as fk
import foursight.kernels.api as fk_api
import foursight.kernels.experimental.gluon_ws as fk_ws
import foursight.kernels.tuning as fk_tuning
from foursight.layer import quantize_weight

SHAPES_8B = "8192x8192,14336x4096,4096x14336"


def git_commit() -> str:
    """``FOURSIGHT_COMMIT`` when set (a device copy has no git), else ``git rev-parse HEAD``."""
    commit = os.environ.get("FOURSIGHT_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:  # noqa: BLE001 - no git here: say so
        return "unknown"


def kernels_sha256() -> str:
    """sha256 over the kernels folder's ``*.py`` files (name, then bytes, in name order): the folder
    ``foursight.kernels`` was imported from; the same recipe as ``device_v3.sh``'s ``KSHA``."""
    h = hashlib.sha256()
    for f in sorted(Path(fk.__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def provenance() -> dict:
    cuda = torch.cuda.is_available()
    return {"commit": git_commit(), "kernels_sha256": kernels_sha256(), "triton": triton.__version__,
            "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
            "gluon_available": fk_ws.available() if cuda else False,
            "gluon_import_error": fk_ws.GLUON_IMPORT_ERROR,
            "timer": "foursight.kernels.tuning.time_gpu (CUDA-graph replays, L2 flushed before each call)"}


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            n, k = part.lower().split("x")
            out.append((int(n), int(k)))
        except ValueError:
            raise SystemExit(f"--shapes: expected NxK[,NxK...], got {part!r}") from None
    return out


def _with_ws(mode: str, fn):
    """Run ``fn`` with ``FOURSIGHT_WS=mode`` (the candidate lists of :func:`foursight.kernels.api.candidates`; the
    kernels read the switch once, so :func:`foursight.kernels.forms.configure` re-reads it)."""
    old = os.environ.get("FOURSIGHT_WS")
    os.environ["FOURSIGHT_WS"] = mode
    fk_api.configure()
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("FOURSIGHT_WS", None)
        else:
            os.environ["FOURSIGHT_WS"] = old
        fk_api.configure()


def _tuned_form(x, pw, act_quant: bool, ws_mode: str) -> dict:
    """Autotune ``splice_linear`` over the candidates of ``ws_mode`` (a fresh choice: the cached one
    is dropped), then time the chosen form. Returns time (µs), the configuration, the rejected ones."""
    m = x.shape[0]
    key = fk_api.linear_key(fk.datapath_for(m), m, pw, act_quant, False, x.dtype, False)
    fk_tuning.TUNED.pop(key, None)
    fk_tuning.TUNE_LOG.pop(key, None)
    res = {"us": None, "config": None, "rejected": [], "candidates": []}
    try:
        _with_ws(ws_mode, lambda: fk.splice_linear(x, pw, act_quant=act_quant))
        cfg = fk_tuning.TUNED[key]
        res["config"] = str(cfg)
        res["us"] = 1000.0 * fk_tuning.time_gpu(lambda: fk.splice_linear(x, pw, act_quant=act_quant, config=cfg))
    except Exception as e:  # noqa: BLE001 - e.g. no candidate matched: recorded, the grid goes on
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    for c, t, err in fk_tuning.TUNE_LOG.get(key, []):
        res["candidates"].append({"config": str(c), "us": None if t is None else 1000.0 * t, "error": err})
        if t is None:
            res["rejected"].append(f"{c}: {err}")
    fk_tuning.TUNED.pop(key, None)
    return res


def run(args) -> dict:
    res = {"provenance": provenance(), "args": vars(args), "cells": []}
    if args.dry_run:
        res["dry_run"] = True
        return res
    if not torch.cuda.is_available():
        raise SystemExit("bench_ws: needs a CUDA GPU (use --dry-run on a CPU machine)")
    t0 = time.time()
    out_dir = Path(args.out)
    for mode in args.modes:  # W4A4 over every shape first, then W4A16 if the budget allows
        aq = mode == "w4a4"
        for n, k_dim in _parse_shapes(args.shapes):
            if time.time() - t0 > args.budget_s:
                res["stopped"] = f"budget of {args.budget_s} s reached before {mode} {n}x{k_dim}"
                break
            g = torch.Generator(device="cuda").manual_seed(n + k_dim)
            w = torch.randn(n, k_dim, generator=g, device="cuda") * 0.02
            ch = torch.sort(torch.randperm(k_dim, generator=g, device="cuda")[:args.k]).values.to(torch.int32)
            qw = quantize_weight(w, ch)
            pw = fk.prepare_weight(qw)
            w_bf16 = w.bfloat16()
            del w
            for m in args.ms:
                if time.time() - t0 > args.budget_s:
                    res["stopped"] = f"budget of {args.budget_s} s reached at {mode} {n}x{k_dim}, M={m}"
                    break
                x = torch.randn(m, k_dim, generator=g, device="cuda").bfloat16()
                cublas = 1000.0 * fk_tuning.time_gpu(lambda: torch.nn.functional.linear(x, w_bf16))
                v3 = _tuned_form(x, pw, aq, "0")
                ws = _tuned_form(x, pw, aq, "only") if fk_ws.available() else {
                    "us": None, "config": None, "rejected": [], "error": "Gluon form not available"}
                cell = {"N": n, "K": k_dim, "M": m, "k": args.k, "mode": mode, "cublas_us": cublas, "v3": v3, "gluon": ws,
                        "v3_x": cublas / v3["us"] if v3["us"] else None, "gluon_x": cublas / ws["us"] if ws["us"] else None}
                res["cells"].append(cell)
                print(f"[bench_ws] {n}x{k_dim} M={m} {mode} k={args.k}: cuBLAS {cublas:.1f} us, v3 {_f(v3['us'])} us "
                      f"({v3['config']}), Gluon {_f(ws['us'])} us ({ws['config']}); rejected Gluon: {len(ws['rejected'])}",
                      flush=True)
                _write(res, out_dir)  # after every cell: a run stopped by its timeout keeps what it measured
            del pw, qw, w_bf16
            torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    return res


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(res: dict) -> str:
    p = res["provenance"]
    lines = [f"# Warp-specialized Gluon SpliceGEMM vs cuBLAS BF16 and v3 ({p['device']})", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}, torch {p['torch']}; "
             f"Gluon available: {p['gluon_available']}. Times: `tuning.time_gpu` (µs, L2 flushed before each call); "
             "x = cuBLAS time / FourSight time.", ""]
    if res.get("dry_run"):
        lines += ["Dry run: no measurement.", ""]
    lines += ["| N x K | M | mode | k | cuBLAS µs | v3 µs | v3 x | v3 config | Gluon µs | Gluon x | Gluon config | Gluon rejected |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        lines.append(f"| {c['N']}x{c['K']} | {c['M']} | {c['mode']} | {c['k']} | {c['cublas_us']:.1f} | "
                     f"{_f(c['v3']['us'])} | {_x(c['v3_x'])} | `{c['v3']['config']}` | "
                     f"{_f(c['gluon']['us'])} | {_x(c['gluon_x'])} | `{c['gluon']['config']}` | {len(c['gluon']['rejected'])} |")
    rejected = sorted({r for c in res["cells"] for r in c["gluon"]["rejected"]})
    if rejected:
        lines += ["", "Gluon candidates rejected or failed (reason):", ""] + [f"* {r}" for r in rejected[:40]]
    if res.get("stopped"):
        lines += ["", f"Stopped early: {res['stopped']}."]
    return "\n".join(lines) + "\n"


def _write(res: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_ws.json").write_text(json.dumps(res, indent=1, default=str))
    (out_dir / "bench_ws.md").write_text(markdown(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for bench_ws.json and bench_ws.md")
    ap.add_argument("--shapes", default=SHAPES_8B, help=f"NxK list (default the three 8B shapes: {SHAPES_8B})")
    ap.add_argument("--ms", default="1,16,64,128,256", help="token counts M (default 1,16,64,128,256)")
    ap.add_argument("--modes", default="w4a4", help="w4a4 and/or w4a16 (comma-separated; default w4a4)")
    ap.add_argument("--k", type=int, default=128, help="BF16 channels per layer (default 128)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cells after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: check the arguments and write the provenance")
    args = ap.parse_args()
    try:
        args.ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        raise SystemExit(f"--ms: expected integers, got {args.ms!r}") from None
    args.modes = [v.strip() for v in args.modes.split(",") if v.strip()]
    if not args.modes or any(v not in ("w4a4", "w4a16") for v in args.modes):
        raise SystemExit(f"--modes: w4a4 and/or w4a16, got {args.modes}")
    if args.k < 0:
        raise SystemExit("--k: a non-negative channel count")
    _parse_shapes(args.shapes)
    res = run(args)
    _write(res, Path(args.out))
    print(f"[bench_ws] wrote {Path(args.out) / 'bench_ws.json'} and bench_ws.md ({len(res['cells'])} cells)")


if __name__ == "__main__":
    main()
