#!/usr/bin/env python
"""Bytes a prepared FourSight layer keeps on the device, for the Llama-3.1-8B shapes, before and
after the one-form change (SpliceGEMM v3), next to BF16 and FP8 rowwise. Computed on the CPU.

* **after** (this code): ``foursight.kernels.api.resident_bytes(prepare_weight(qw))`` — the fragment
  form (int32 code words ``Np·Kp/2`` bytes, block scales ``Np·Kp/16`` E4M3 bytes or ``Np·Kp/8`` bf16
  bits), weight global scales ``4N``, channels ``4k``, mask ``K``, ``W[:, S]`` ``2Nk``
  (``Np``, ``Kp``: N, K rounded up to 64, 256).
* **before** (commit ab03e9d, the fragment-form kernels measured on the H200): the packed copy
  ``N·K/2``, its E4M3 scales ``N·K/16``, the same small tensors, plus the fragment form with bf16
  scale bits that the first decode call built and cached on the layer (``Np·Kp/2 + Np·Kp/8``).
* **BF16**: ``2NK``. **FP8 rowwise** (``torch._scaled_mm``, benchmarks/kernels/baselines.py): ``NK`` + an
  fp32 scale per row ``4N``.

The full-size layers are not built here (the packer's int64 temporaries at 28672 × 4096 exceed this
machine's share of memory): the formula is checked against ``resident_bytes`` of real prepared
layers of every K at a small N (and, with ``--before-pythonpath``, the before formula against the
older package's prepared layer with its cached fragment form), then evaluated at full size.

Usage::

    python benchmarks/kernels/resident_bytes.py --out benchmarks/results/resident_bytes
    python benchmarks/kernels/resident_bytes.py --before-pythonpath /tmp/head_pp   # also check the before formula
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import git_commit  # noqa: E402  (benchmarks/common.py)

K_CHANNELS = 128
#: Llama-3.1-8B's linears (N, K), qkv and gate/up fused as the engines run them, and the three
#: shapes of the per-layer grid (benchmarks/kernels/bench_splice_gemm.py)
SHAPES = {
    "qkv_proj 6144x4096": (6144, 4096),
    "o_proj 4096x4096": (4096, 4096),
    "gate_up_proj 28672x4096": (28672, 4096),
    "down_proj 4096x14336": (4096, 14336),
    "grid 8192x8192": (8192, 8192),
    "grid 14336x4096": (14336, 4096),
    "grid 4096x14336": (4096, 14336),
}
LLAMA_8B_LAYER = ("qkv_proj 6144x4096", "o_proj 4096x4096", "gate_up_proj 28672x4096", "down_proj 4096x14336")
LAYERS = 32


def _pad(v: int, m: int) -> int:
    return -(-v // m) * m


def small_tensors(n: int, k_dim: int, k: int) -> int:
    return 4 * n + 4 * k + k_dim + 2 * n * k


def after_bytes(n: int, k_dim: int, k: int, scale_bf16: bool) -> int:
    np_, kp = _pad(n, 64), _pad(k_dim, 256)
    return np_ * kp // 2 + np_ * kp // 16 * (2 if scale_bf16 else 1) + small_tensors(n, k_dim, k)


def packed_bytes(n: int, k_dim: int, k: int) -> int:
    """The compressed-tensors checkpoint layout: codes ``N·K/2``, E4M3 scales ``N·K/16`` and the small tensors."""
    return n * k_dim // 2 + n * k_dim // 16 + small_tensors(n, k_dim, k)


def before_bytes(n: int, k_dim: int, k: int) -> int:
    np_, kp = _pad(n, 64), _pad(k_dim, 256)
    return packed_bytes(n, k_dim, k) + np_ * kp // 2 + np_ * kp // 8


def bf16_bytes(n: int, k_dim: int) -> int:
    return 2 * n * k_dim


def fp8_bytes(n: int, k_dim: int) -> int:
    return n * k_dim + 4 * n


def _layer(n: int, k_dim: int, k: int):
    from foursight.layer import quantize_weight

    g = torch.Generator().manual_seed(n + k_dim)
    w = torch.randn(n, k_dim, generator=g)
    ch = torch.sort(torch.randperm(k_dim, generator=g)[:k]).values.to(torch.int32)
    return quantize_weight(w, ch)


def check_after(scale_bf16: bool) -> list[dict]:
    import foursight.kernels.api as fk

    rows = []
    for n, k_dim in ((128, 4096), (100, 14336), (64, 8192)):
        pw = fk.prepare_weight(_layer(n, k_dim, K_CHANNELS))
        got, want = fk.resident_bytes(pw), after_bytes(n, k_dim, K_CHANNELS, scale_bf16)
        rows.append({"N": n, "K": k_dim, "resident_bytes": got, "formula": want})
        if got != want:
            raise SystemExit(f"after formula {want} != resident_bytes {got} at {n}x{k_dim}")
    return rows


_BEFORE_PROBE = r"""
import json, sys, torch
sys.path.insert(0, %(here)r)
import resident_bytes as rb
import foursight.kernels as fk
from foursight.kernels.fragment import fragment_of
rows = []
for n, k_dim in ((128, 4096), (100, 14336)):
    pw = fk.prepare_weight(rb._layer(n, k_dim, rb.K_CHANNELS))
    fw = fragment_of(pw)  # what the first decode call builds and caches
    t = [getattr(pw, f) for f in pw.__dataclass_fields__ if isinstance(getattr(pw, f), torch.Tensor)] + [fw.words, fw.scales]
    rows.append({"N": n, "K": k_dim, "measured": sum(x.numel() * x.element_size() for x in t), "formula": rb.before_bytes(n, k_dim, rb.K_CHANNELS)})
print("BEFORE " + json.dumps(rows))
"""


def check_before(pythonpath: str) -> list[dict]:
    code = _BEFORE_PROBE % {"here": os.path.dirname(os.path.abspath(__file__))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": pythonpath}, cwd="/")
    for line in r.stdout.splitlines():
        if line.startswith("BEFORE "):
            rows = json.loads(line[7:])
            for row in rows:
                if row["measured"] != row["formula"]:
                    raise SystemExit(f"before formula differs: {row}")
            return rows
    raise SystemExit(f"before check failed: {r.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/resident_bytes")
    ap.add_argument("--before-pythonpath", default=None, help="PYTHONPATH of the older package, to check the before formula")
    args = ap.parse_args()
    from foursight.kernels.fragment_layout import SCALES_AS_BF16

    checks = {"after": check_after(SCALES_AS_BF16)}
    if args.before_pythonpath:
        checks["before"] = check_before(args.before_pythonpath)
    rows = []
    for name, (n, k_dim) in SHAPES.items():
        rows.append({"layer": name, "N": n, "K": k_dim, "k": K_CHANNELS, "bf16": bf16_bytes(n, k_dim), "fp8_rowwise": fp8_bytes(n, k_dim),
                     "before": before_bytes(n, k_dim, K_CHANNELS), "after": after_bytes(n, k_dim, K_CHANNELS, SCALES_AS_BF16)})
    model = {key: LAYERS * sum(r[key] for r in rows if r["layer"] in LLAMA_8B_LAYER) for key in ("bf16", "fp8_rowwise", "before", "after")}
    res = {"commit": git_commit(), "scales_as_bf16": SCALES_AS_BF16, "channels_per_linear": K_CHANNELS, "layers": rows,
           "llama_8b_linears_32_layers": model, "checks": checks}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "resident_bytes.json"), "w") as f:
        json.dump(res, f, indent=1)
    mib = 2**20
    lines = ["# Resident bytes per prepared layer (computed on the CPU)", "",
             f"Commit `{res['commit'][:12]}`; k = {K_CHANNELS} BF16 channels per linear; written by "
             "`python benchmarks/kernels/resident_bytes.py` (its docstring gives the formulas and how they are checked "
             "against `foursight.kernels.api.resident_bytes`). Before = commit ab03e9d (packed copy + cached fragment form).", "",
             "| layer (N×K) | BF16 MiB | FP8 rowwise MiB | FourSight before MiB | FourSight after MiB | after / BF16 | after / FP8 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['bf16'] / mib:.1f} | {r['fp8_rowwise'] / mib:.1f} | {r['before'] / mib:.1f} | "
                     f"{r['after'] / mib:.1f} | {r['after'] / r['bf16']:.3f} | {r['after'] / r['fp8_rowwise']:.3f} |")
    gib = 2**30
    lines += ["", f"Llama-3.1-8B linears, 32 layers: BF16 {model['bf16'] / gib:.2f} GiB, FP8 rowwise {model['fp8_rowwise'] / gib:.2f} GiB, "
              f"FourSight before {model['before'] / gib:.2f} GiB, after {model['after'] / gib:.2f} GiB "
              f"({model['after'] / model['bf16']:.3f}x BF16). The vLLM/SGLang plugin releases "
              "the checkpoint codes and block scales this form rebuilds (issue 36 item 6; benchmarks/kernels/engine_bytes.py "
              "measures the engine), except where the engine offloads weights to the CPU."]
    with open(os.path.join(args.out, "resident_bytes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
