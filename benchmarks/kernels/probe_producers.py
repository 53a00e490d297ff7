#!/usr/bin/env python
"""The fused producers alone on a CUDA GPU: what one launch of the residual add + RMSNorm (or SiLU·mul) with the
activation quantizer costs, against the unfused road, and how it depends on the launch's warps.

For each producer at the 8B decoder's widths (add + RMSNorm at K = 4096, SiLU·mul at K = 14336), M (``--ms``) and
k (0 and ``--k`` BF16 channels of the consumer), in one process, µs per call by the package's timer
(:func:`foursight.kernels.tuning.time_gpu`: CUDA-graph replays, the L2 flushed before each call):

* ``torch``: the eager PyTorch producer (``x + r`` and ``F.rms_norm``; ``F.silu(g) * u``);
* ``torch+quant q1`` / ``q8``: that, then the standalone quantizer as ``splice_linear`` launches it for a fragment
  tile (bf16 ``q·s``, the dense ``X[:, S]``; one or 8 programs per row): the unfused W4A4 road;
* ``alone``: :func:`foursight.kernels.producers.producer_launch` without a consumer (the BF16 road), with the
  launcher's own warps and with each of ``--warps``;
* ``fused``: the same with the quantizer in the launch, the launcher's warps and each of ``--warps``.

Usage (GPU)::

    python benchmarks/kernels/probe_producers.py --out $OUT [--ms 1,16,64] [--warps 4,8,16,32]
    python benchmarks/kernels/probe_producers.py --out /tmp/p --dry-run     # CPU: provenance and arguments only

Writes ``producers.json`` and ``producers.md`` (after every row).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import bench_splice_gemm as bsg  # noqa: E402  (benchmarks/kernels/bench_splice_gemm.py)
from common import ms_per_call  # noqa: E402  (benchmarks/common.py)

#: the producers at the 8B decoder's widths: name -> (kind, K, residual)
PRODUCERS = {"add+RMSNorm K=4096": ("rmsnorm", 4096, True), "SiLU·mul K=14336": ("silu_mul", 14336, False)}


def _us(fn) -> float:
    return ms_per_call([fn]) * 1e3


def row_for(name: str, m: int, k: int, warps: list[int]) -> dict:
    import foursight.kernels.act_quant as fk_aq  # noqa: PLC0415
    import foursight.kernels.api as fk  # noqa: PLC0415
    from foursight.kernels.producers import RMSNORM, SILU_MUL, producer_launch  # noqa: PLC0415
    from foursight.layer import quantize_weight  # noqa: PLC0415

    kind, K, residual = PRODUCERS[name]
    dev = torch.device("cuda")
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    r = torch.randn(m, K, device=dev, dtype=torch.bfloat16) if residual else None
    w = torch.ones(K, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * K, device=dev, dtype=torch.bfloat16)
    ch = torch.sort(torch.randperm(K, device=dev)[:k]).values.to(torch.int32)
    pw = fk.prepare_weight(quantize_weight(torch.randn(64, K, device=dev) * 0.02, ch))
    a, kd = (x, RMSNORM) if kind == "rmsnorm" else (gu, SILU_MUL)

    def torch_producer():
        if kind == "rmsnorm":
            return F.rms_norm(x + r, (K,), w, 1e-5)
        g, u = gu.split(K, dim=-1)
        return F.silu(g) * u

    def quantizer(y, cols):
        return fk_aq.act_quant_launch(y, pw.channel_mask, pw.bf16_channels, None, False, True, k > 0,
                                      deq_dtype=torch.bfloat16, cols=cols)

    def producer(quant: bool, nw):
        return producer_launch(kd, a, K, weight=w, residual=r, eps=1e-5, mask=pw.channel_mask if quant else None,
                               channels=pw.bf16_channels if quant else None, quant=quant, write_y=not quant,
                               num_warps=nw)

    row = {"producer": name, "M": m, "k": k, "us": {}}
    us = row["us"]
    us["torch"] = _us(torch_producer)
    for cols in (1, 8):
        us[f"torch+quant q{cols}"] = _us(lambda cols=cols: quantizer(torch_producer(), cols))
    for quant, tag in ((False, "alone"), (True, "fused")):
        us[f"{tag} default"] = _us(lambda quant=quant: producer(quant, None))
        for nw in warps:
            us[f"{tag} {nw}w"] = _us(lambda quant=quant, nw=nw: producer(quant, nw))
    # the default launch's outputs equal the standalone quantizer's on the row (a check, not a timing)
    y = producer(False, None)[0]
    _, _, deq, gs, xs = producer(True, None)
    _, _, deq_r, gs_r, xs_r = quantizer(y, 1)
    row["bit_identical_to_unfused"] = bool(torch.equal(deq, deq_r) and torch.equal(gs, gs_r)
                                           and (k == 0 or torch.equal(xs, xs_r)))
    return row


def markdown(res: dict) -> str:
    p = res["provenance"]
    cols = ["torch", "torch+quant q1", "torch+quant q8", "alone default", "fused default"]
    cols += [f"alone {w}w" for w in res["warps"]] + [f"fused {w}w" for w in res["warps"]]
    lines = [f"# The fused producers alone ({res.get('gpu', '?')}, {res.get('date_utc', '')} UTC)", "",
             f"Commit `{p['commit']}`, kernels sha256 `{p['kernels_sha256'][:16]}`, Triton {p['triton']}. "
             f"Command `{res.get('command', '')}`. µs per call, foursight.kernels.tuning.time_gpu (L2 flushed before "
             "each call). `torch+quant qN`: the eager producer then the standalone quantizer (N programs per row); "
             "`alone`: the one-launch producer without the quantizer; `fused`: with it; `Nw`: N warps forced. "
             "`same bits`: the fused launch's q·s, global scales and X[:, S] equal the standalone quantizer's on the "
             "producer's row.", "",
             "| producer | M | k | " + " | ".join(cols) + " | same bits |",
             "|---|---|---|" + "---|" * len(cols) + "---|"]
    for r in res["rows"]:
        cells = [f"{r['us'][c]:.2f}" if c in r["us"] else "" for c in cols]
        lines.append(f"| {r['producer']} | {r['M']} | {r['k']} | " + " | ".join(cells) + f" | {r['bit_identical_to_unfused']} |")
    if res.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(res['not_run'])}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/producers")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--warps", default="4,8,16,32")
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warps = [int(v) for v in args.warps.split(",") if v.strip()]
    res = {"provenance": bsg.provenance(), "args": vars(args), "command": " ".join(sys.argv), "warps": warps, "rows": []}
    if args.dry_run:
        res["dry_run"] = True
        (out / "producers.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("probe_producers: needs a CUDA GPU")
    res.update(gpu=torch.cuda.get_device_name(0), date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    t0 = time.time()
    for name in PRODUCERS:
        for m in (int(v) for v in args.ms.split(",")):
            for k in sorted({0, args.k}):
                if time.time() - t0 > args.budget_s:
                    res.setdefault("not_run", []).append(f"{name} M={m} k={k}")
                    continue
                row = row_for(name, m, k, warps)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                (out / "producers.json").write_text(json.dumps(res, indent=1))
                (out / "producers.md").write_text(markdown(res))
    (out / "producers.json").write_text(json.dumps(res, indent=1))
    (out / "producers.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
