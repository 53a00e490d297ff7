#!/usr/bin/env python
"""Offline sm_90a SASS of the FP8 baseline's fused producers (``foursight.kernels.fp8_producers``), at the 8B
decoder's decode launches: that they compile with the Triton in use (the device's is 3.6, the CPU venv's 3.9),
their registers, spills and instructions per element, beside the NVFP4 producers' figures of
``sass_offline.py`` (``benchmarks/results/sass_v4_producers/``). Static counts, not a timing.

Cases (as ``fp8_producers.fp8_producer`` launches them at M <= 128 rows): the residual add + RMSNorm + quant at
K = 4096 (before qkv and gate_up), SiLU·mul + quant at K = 14336 (before down; a 16384-wide register row), the
plain quantizer at K = 4096 (o_proj's input); 32 warps each; in the engines' arithmetic (``exact=False``, what the
benchmarks time: ``y · (1/scale)`` and the hardware E4M3 conversion) and in the exact one (an IEEE division per
element).

Usage (the device's Triton beside the venv's, as in ``benchmarks/results/sass_v4_final/README.md``)::

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 .venv/bin/python benchmarks/kernels/sass_fp8_producers.py --out benchmarks/results/sass_fp8_producers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import sass_offline as so  # noqa: E402  (benchmarks/kernels/sass_offline.py)
from common import git_commit, kernels_sha256  # noqa: E402  (benchmarks/common.py)
from sass import instructions, resources, sass_of  # noqa: E402  (benchmarks/kernels/sass.py)

PTRS = {"a_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_out_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*u8",
        "scale_ptr": "*fp32", "eps": "fp32", "e4m3_max": "fp32", "inv_max": "fp32", "amax_floor": "fp32"}
#: (case, KIND, BLOCK_K, warps, HAS_RES)
CASES = (("FP8 add+RMSNorm+quant K=4096 (decode)", 0, 4096, 32, True),
         ("FP8 SiLU·mul+quant K=14336 (decode)", 1, 16384, 32, False),
         ("FP8 plain quant K=4096 (o_proj input)", 2, 4096, 32, False))


def rows() -> list[dict]:
    fn = so._kernel("fp8_producers", "_fp8_producer_kernel")
    out = []
    for (name, kind, block_k, nw, res), exact in [(c, e) for e in (False, True) for c in CASES]:
        name = f"{name}, {'exact' if exact else 'engine'}"
        consts = dict(KIND=kind, HAS_RES=res, WRITE_Y=False, BLOCK_K=block_k, SCALE_RECIP=True, EXACT=exact, HW_CVT=True)
        compiled = so.compile_sm90(fn, PTRS, consts, nw, 1)
        sass = sass_of(compiled)
        per_thread = block_k / (32 * nw)
        total, hot = len(instructions(sass)), so.hot_path(sass)
        out.append({"case": name, "per_element_hot": round(hot / per_thread, 2), "per_element_total": round(total / per_thread, 2),
                    "hot_instructions": hot, "total_instructions": total, "elements_per_thread": per_thread,
                    **resources(compiled, sass)})
        print(f"  {name}: {out[-1]['per_element_hot']} hot, {out[-1]['registers']} registers, "
              f"{out[-1]['spill_instructions']} spills", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/sass_fp8_producers")
    args = ap.parse_args()
    res = {"commit": git_commit(), "kernels_sha256": kernels_sha256(), "triton": triton.__version__,
           "target": "sm_90a (GPUTarget cuda 90)", "command": " ".join(["python"] + sys.argv), "rows": rows()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"triton{triton.__version__}"
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Offline sm_90a SASS of the FP8 baseline's fused producers (Triton {triton.__version__})", "",
             f"Commit `{res['commit'][:12]}`, kernels sha256 `{res['kernels_sha256'][:16]}`; written by "
             f"`benchmarks/kernels/sass_fp8_producers.py` (its docstring: the cases and the command). Static counts, not a timing; "
             "instructions per element on the hot path (up to the first EXIT) and in all.", "",
             "| case | instructions per element, hot path (total) | elements per thread | registers | spills (STL/LDL) | local B | shared B |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['case']} | {r['per_element_hot']} ({r['per_element_total']}) | {r['elements_per_thread']:g} | {r['registers']} | "
                     f"{r['spill_instructions']} | {r['local_bytes']} | {r['shared_bytes']} |")
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
