#!/usr/bin/env python
"""The BF16 columns of every default fragment tile, X[:, S] gathered (as launched before commit 06f8db5) and
read dense from the quantizer's copy (as launched since), compiled offline for sm_90a as an H100 launch
builds them: :func:`sass_columns.case_row` (benchmarks/kernels/sass_columns.py defines every figure) over
``DECODE_CONFIGS`` (M = 1 and 16), ``MID_CONFIGS`` (M = 64) and ``PREFILL_CONFIGS`` (M = 256), 8192 x 8192,
k = 128, W4A4. Writes ``<out>.json`` and ``<out>.md``. Run from the repository root::

    PYTHONPATH=<triton 3.6 folder> python benchmarks/results/sass_v4_f983f41/columns_every_default.py \\
        benchmarks/results/sass_v4_f983f41/columns_every_default_triton36
"""
import json
import os
import sys
import time

sys.path[:0] = ["benchmarks/kernels", "benchmarks"]
import triton  # noqa: E402

import sass_columns as sc  # noqa: E402
from common import git_commit, kernels_sha256  # noqa: E402
from foursight.kernels import configs  # noqa: E402

MS = {"DECODE_CONFIGS": (1, 16), "MID_CONFIGS": (64,), "PREFILL_CONFIGS": (256,)}


def rows() -> list:
    out, seen = [], set()
    for lst, ms in MS.items():
        for cfg in getattr(configs, lst):
            if type(cfg).__name__ != "FragmentConfig" or str(cfg) in seen:
                continue
            seen.add(str(cfg))
            for m in ms:
                for dense in (False, True):
                    label = f"{lst.split('_')[0].lower()} M={m} {'dense' if dense else 'gathered'}"
                    t = time.time()
                    try:
                        r = sc.case_row(label, m, str(cfg), 128, dense)
                    except Exception as e:  # noqa: BLE001 - a failed compile is a finding
                        r = {"case": label, "M": m, "config": str(cfg), "k": 128, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    r["list"] = lst
                    out.append(r)
                    print(f"{label:24s} {str(cfg):56s} {time.time() - t:.1f}s {r.get('error', '')}", flush=True)
    return out


def _cell(r: dict) -> tuple:
    lv, s = r["launched_variant"], r["sass"]
    return (lv["regs"], lv["stack_bytes"], lv["shared_bytes"] / 1024, lv["per_sm"], s["loads_before_first_async_copy"],
            s["shared_stores_before_first_async_copy"], s["main_loop"]["instructions"], s["tail"]["instructions"])


def write_md(res: dict, path: str) -> None:
    by = {}
    for r in res["cases"]:
        by.setdefault((r["list"], r["config"], r["M"]), {})["dense" if r["case"].endswith("dense") else "gathered"] = r
    lines = [
        "# X[:, S] gathered vs dense, every default fragment tile (sm_90a, offline)", "",
        f"Commit `{res['commit'][:12]}`, kernels sha256 `{res['kernels_sha256'][:16]}`, Triton {res['triton']}, {res['target']}. "
        "Written by `columns_every_default.py` (this folder) through `benchmarks/kernels/sass_columns.py`'s `case_row` "
        "(its docstring defines every figure): 8192 x 8192, k = 128, W4A4, the H100's occupancy rule. "
        "Each cell is gathered → dense. Static counts, not a timing.", "",
        "| list | config | M | regs | spill stack B | shared KiB | programs/SM | loads before the first async copy | "
        "shared stores before it | main loop instr. | tail instr. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (lst, cfg, m), d in by.items():
        g, n = d.get("gathered"), d.get("dense")
        if not g or not n or "error" in g or "error" in n:
            lines.append(f"| {lst} | `{cfg}` | {m} | {(g or {}).get('error', '')} {(n or {}).get('error', '')} |||||||||")
            continue
        cells = []
        for i, (a, b) in enumerate(zip(_cell(g), _cell(n))):
            fa, fb = (f"{a:.1f}", f"{b:.1f}") if i == 2 else (str(a), str(b))
            cells.append(fa if fa == fb else f"{fa} → **{fb}**")
        lines.append(f"| {lst.split('_')[0].lower()} | `{cfg}` | {m} | " + " | ".join(cells) + " |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(stem: str) -> None:
    res = {"commit": os.environ.get("SASS_COMMIT") or git_commit(), "kernels_sha256": kernels_sha256(), "triton": triton.__version__,
           "target": "sm_90a (GPUTarget cuda 90)", "machine": sc.H100, "cases": rows()}
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    write_md(res, stem + ".md")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main(sys.argv[1])
