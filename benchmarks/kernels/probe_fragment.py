#!/usr/bin/env python
"""Where the fragment form's decode time goes (GPU only): time the pieces of a W4A4 call and the
variants that change one thing at a time, and write them to JSON.

* the activation quantization alone at small M, per ``num_warps`` (outputs must be bit-identical
  across warps: the kernel's numerics do not depend on the launch width);
* the fragment GEMM alone (W4A16, A = X) per tile and variant: as shipped (the wave-filling split
  plan), capped at 128 registers (``max_regs``), the previous split rule, 4 stages; k = 0 against
  k = 128; each output checked against the PyTorch reference, with the split plan used;
* the default W4A4 ``splice_linear`` (autotuned) beside them.

``--ncu NAME`` instead runs one variant eagerly a few times, for Nsight Compute
(``ncu -k regex:_fragment_gemm_kernel ... python benchmarks/kernels/probe_fragment.py --ncu base``).

Usage: python benchmarks/kernels/probe_fragment.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import foursight.kernels.api as fk
from foursight.channels import relative_error
from foursight.kernels import act_quant as aq
from foursight.kernels.api import reference_output
from foursight.kernels.configs import FragmentConfig
from foursight.kernels import fragment as frag
from foursight.kernels.fragment_layout import fragment_of
from foursight.kernels.split_k import split_plan
from foursight.kernels.fragment import fragment_launch
from foursight.kernels.tuning import time_gpu
from foursight.layer import quantize_weight

SHAPES = ((8192, 8192), (14336, 4096), (4096, 14336))
TILES = {  # M -> tiles, in priority order (the budget may end the probe)
    16: (FragmentConfig(16, 64, 256, 3), FragmentConfig(16, 128, 256, 3)),
    1: (FragmentConfig(16, 128, 256, 3),),
    64: (FragmentConfig(64, 64, 128, 3),),
}
#: variants run on every shape (the others on the first shape only)
EVERY_SHAPE = ("base", "maxreg128", "old_split")
VARIANTS = {  # name -> FragmentConfig fields (``split_k: "old"`` = the previous automatic rule)
    "base": {},
    "maxreg128": {"max_regs": 128},
    "old_split": {"split_k": "old"},
    "old_split_maxreg128": {"split_k": "old", "max_regs": 128},
    "stages4_maxreg128": {"num_stages": 4, "max_regs": 128},
}


def old_split(m: int, n: int, k_dim: int, cfg) -> int:
    """The split count of the previous automatic rule (about 4 programs per SM, rounded up)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    target = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    steps = -(-(-(-k_dim // 256) * 2) // (cfg.block_k // 128))
    return 1 if 2 * tiles >= target else min(-(-target // tiles), steps)


def plan_of(cfg, m: int, pw) -> dict:
    """Resident programs and the split plan the launch used (after a launch of ``cfg``)."""
    slots = [v for k, v in frag.RESIDENT_SLOTS.items() if k[1][0] == str(cfg)]
    kcp = fragment_of(pw).words.shape[1] // 16
    sl = slots[0] if slots else 0
    plan = split_plan(m, pw.out_features, kcp, pw.num_channels, cfg.block_m, cfg.block_n, cfg.block_k // 128,
                            cfg.split_k, sl or 1)
    return {"slots": sl, "splits": plan[0]}


def layer(n: int, k: int, kk: int, g: torch.Generator):
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    ch = torch.sort(torch.randperm(k, generator=g, device="cuda")[:kk]).values.to(torch.int32)
    return fk.prepare_weight(quantize_weight(w, ch))


def probe_act_quant(g, rows: list, quick: bool) -> None:
    for k_dim in (8192,) if quick else (4096, 8192, 14336):
        pw = layer(64, k_dim, 128, g)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k_dim, generator=g, device="cuda").to(torch.bfloat16)
            first = None
            for nw in (None, 8, 32):  # None: the shipped policy
                def run():
                    return aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, False,
                                               deq_dtype=torch.bfloat16, num_warps=nw)
                try:
                    _, _, deq, gs, _ = run()
                    same = True
                    if first is None:
                        first = (deq.clone(), gs.clone())
                    else:
                        same = bool(torch.equal(deq, first[0]) and torch.equal(gs, first[1]))
                    t = time_gpu(run)
                    rows.append({"probe": "act_quant", "K": k_dim, "M": m, "num_warps": nw or "policy", "us": t * 1e3,
                                 "bit_identical_to_first": same})
                except Exception as e:  # noqa: BLE001 - a launch width the compiler refuses is a result
                    rows.append({"probe": "act_quant", "K": k_dim, "M": m, "num_warps": nw or "policy", "error": repr(e)[:300]})
                print(rows[-1], flush=True)


def probe_gemm(g, rows: list, quick: bool, budget_s: float) -> None:
    t0 = time.time()
    for n, k_dim in SHAPES[:1] if quick else SHAPES:
        layers = {kk: layer(n, k_dim, kk, g) for kk in (0, 128)}
        for m, tiles in TILES.items():
            x = torch.randn(m, k_dim, generator=g, device="cuda").to(torch.bfloat16)
            refs = {kk: reference_output(pw, x, None, None, False) for kk, pw in layers.items()}
            _, _, deq, gs, _ = aq.act_quant_launch(x, layers[128].channel_mask, layers[128].bf16_channels, None, False,
                                                   True, False, deq_dtype=torch.bfloat16)
            for tile in tiles:
                for vname, mods in VARIANTS.items():
                    if (n, k_dim) != SHAPES[0] and vname not in EVERY_SHAPE:
                        continue
                    if time.time() - t0 > budget_s:
                        rows.append({"probe": "gemm", "not_run": f"{n}x{k_dim} M={m} {tile} {vname}: budget"})
                        continue
                    for kk in (0, 128) if vname == "base" else (128,):
                        pw = layers[kk]
                        if mods.get("split_k") == "old":
                            mods = {**mods, "split_k": old_split(m, n, k_dim, tile)}
                        cfg = dataclasses.replace(tile, **mods)
                        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                        row = {"probe": "gemm", "shape": f"{n}x{k_dim}", "M": m, "k": kk, "tile": str(tile),
                               "variant": vname, "config": str(cfg)}
                        try:
                            fragment_launch(cfg, x, None, x, pw, None, out, False)
                            row["rel_err"] = relative_error(out, refs[kk])
                            row["w4a16_us"] = time_gpu(lambda: fragment_launch(cfg, x, None, x, pw, None, out, False)) * 1e3
                            row.update(plan_of(cfg, m, pw))
                            if kk == 128 and vname in ("base", "maxreg128"):
                                row["w4a4_gemm_us"] = time_gpu(lambda: fragment_launch(cfg, deq, gs, x, pw, None, out, True)) * 1e3
                        except Exception as e:  # noqa: BLE001
                            row["error"] = repr(e)[:300]
                        rows.append(row)
                        print(row, flush=True)
            for kk, pw in layers.items():  # the whole W4A4 call (quantization + GEMM) with the first tile
                cfg = tiles[0]
                y = fk.splice_linear(x, pw, config=cfg)
                t = time_gpu(lambda: fk.splice_linear(x, pw, config=cfg))
                rows.append({"probe": "splice_linear", "shape": f"{n}x{k_dim}", "M": m, "k": kk, "mode": "w4a4",
                             "us": t * 1e3, "config": str(cfg),
                             "rel_err": relative_error(y, reference_output(pw, x, None, None, True))})
                print(rows[-1], flush=True)
            bw = torch.randn(n, k_dim, generator=g, device="cuda").to(torch.bfloat16)
            rows.append({"probe": "cublas", "shape": f"{n}x{k_dim}", "M": m, "us": time_gpu(lambda: x @ bw.t()) * 1e3})
            print(rows[-1], flush=True)


def ncu_target(name: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    pw = layer(8192, 8192, 128, g)
    x = torch.randn(16, 8192, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.empty(16, 8192, dtype=torch.bfloat16, device="cuda")
    mods = VARIANTS[name]
    if mods.get("split_k") == "old":
        mods = {**mods, "split_k": old_split(16, 8192, 8192, FragmentConfig(16, 64, 256, 3))}
    cfg = dataclasses.replace(FragmentConfig(16, 64, 256, 3), **mods)
    for _ in range(4):
        fragment_launch(cfg, x, None, x, pw, None, out, False)
    aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, False, deq_dtype=torch.bfloat16)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/probe_fragment")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--ncu", default=None, help="run one variant for Nsight Compute and exit")
    args = ap.parse_args()
    if args.ncu:
        ncu_target(args.ncu)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    rows: list = []
    probe_act_quant(g, rows, args.quick)
    probe_gemm(g, rows, args.quick, args.budget_s)
    (out / "probe_fragment.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
