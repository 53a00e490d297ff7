"""Summarize a checkpoint's per-layer error table (foursight_layers.json) by layer type, as Markdown.

Usage: python benchmarks/fidelity/layer_table.py out/smollm2-foursight [--top 8]
"""

from __future__ import annotations

import argparse
import json
import statistics as st
from pathlib import Path


def summarize(rows: list[dict], top: int = 8) -> str:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["name"].rsplit(".", 1)[-1], []).append(r)
    out = ["| layer type | layers | k | mean NVFP4 rel. err | mean FourSight rel. err | mean reduction | min reduction | median outlier var share |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for t, rs in by.items():
        ks = sorted({r["k"] for r in rs})
        out.append(f"| {t} | {len(rs)} | {'/'.join(map(str, ks))} | {st.mean(r['err_nvfp4'] for r in rs):.4f} | "
                   f"{st.mean(r['err_foursight'] for r in rs):.4f} | {st.mean(r['reduction'] for r in rs):+.1%} | "
                   f"{min(r['reduction'] for r in rs):+.1%} | {st.median(r['outlier_share'] for r in rs):.1%} |")
    out += ["", f"The {top} layers whose selected channels hold the largest share of the input variance:", "",
            "| layer | k | outlier var share | NVFP4 rel. err | FourSight rel. err | reduction |", "|---|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["outlier_share"])[:top]:
        out.append(f"| {r['name']} | {r['k']} | {r['outlier_share']:.1%} | {r['err_nvfp4']:.4f} | {r['err_foursight']:.4f} | {r['reduction']:+.1%} |")
    better = sum(r["err_foursight"] < r["err_nvfp4"] for r in rows)
    out += ["", f"FourSight has the lower error on {better} of {len(rows)} layers."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    print(summarize(json.loads((a.ckpt / "foursight_layers.json").read_text()), a.top))


if __name__ == "__main__":
    main()
