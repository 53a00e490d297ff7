"""GPU time to re-quantize the linears of a Llama-3.1-8B-shaped model, as a weight sync does (issue 37).

Every linear of the 32 decoder layers (q 4096x4096, k/v 1024x4096, o 4096x4096, gate/up 14336x4096,
down 4096x14336: 6.98 G values, 13.0 GiB in BF16; random weights) is re-quantized shard by shard with
the sync's quantizer, :func:`foursight.quant_methods.requantize.quantize_shard` (the Triton kernel of
``foursight.kernels.act_quant`` on CUDA: per-tensor global scale taken on the device, 128 BF16
channels per layer, no host sync). Timed from a ``torch.cuda.synchronize()`` to the next, after a
warm-up sync that compiles the kernels; median of ``--repeats``. Also timed, once, the same with the
PyTorch quantizer on the device (:func:`foursight.layer.quantize_weight`), and checked: the Triton
path equals it bit for bit on one layer's shards.

Needs torch, Triton and FourSight importable (no vLLM). On a bare GPU machine, after
``.venv/bin/python benchmarks/device/prepare.py --profile base`` on the CPU, with its part (``.devcarry/p1``)
carried, the one staging step installs FourSight from the tree first:

    source benchmarks/device/stage.sh --need base && python3 benchmarks/weight_sync/gpu_requant.py --out $OUT

Writes ``$OUT/gpu_requant.json`` (card, commit, torch/Triton versions, times). Target: <= 1 s per sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (name, rows, K) of each linear shard of one Llama-3.1-8B decoder layer
SHARDS = [("q_proj", 4096, 4096), ("k_proj", 1024, 4096), ("v_proj", 1024, 4096), ("o_proj", 4096, 4096),
          ("gate_proj", 14336, 4096), ("up_proj", 14336, 4096), ("down_proj", 4096, 14336)]


COMMAND = "source benchmarks/device/stage.sh --need base && python3 benchmarks/weight_sync/gpu_requant.py --out $OUT"


def _require_foursight() -> None:
    """Stop with the command to run when ``foursight`` (or one of its dependencies) is not importable."""
    try:
        import foursight.quant_methods.requantize  # noqa: F401
    except ImportError as e:
        sys.exit(f"gpu_requant.py: FourSight is not importable ({e}). On the device, stage it first with the one staging "
                 f"step (benchmarks/device/stage.sh, the parts of benchmarks/device/prepare.py --profile base carried): {COMMAND}; "
                 "elsewhere, an interpreter with FourSight installed (a checkout's .venv/bin/python)")


def _commit() -> str:
    if os.environ.get("FOURSIGHT_COMMIT"):
        return os.environ["FOURSIGHT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out_requant"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--channels", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t_start = time.perf_counter()
    _require_foursight()
    import torch
    import triton

    from foursight.layer import quantize_weight
    from foursight.quant_methods.requantize import quantize_shard

    if not torch.cuda.is_available():
        sys.exit("gpu_requant.py needs a CUDA GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(args.layers):
        shards = []
        for name, n, k in SHARDS:
            w = (torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
            ch = torch.sort(torch.randperm(k, device=dev, generator=g)[: args.channels]).values.to(torch.int32)
            shards.append((name, w, ch))
        layers.append(shards)
    values = sum(w.numel() for shards in layers for _, w, _ in shards)

    def sync_all(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for shards in layers:
            for name, w, ch in shards:
                fn(w, ch, name)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def triton_q(w, ch, name):
        return quantize_shard(w, ch, name=name)

    def torch_q(w, ch, name):
        return quantize_weight(w, ch, name=name)

    warm = sync_all(triton_q)  # compiles the kernels (one per K)
    runs = [sync_all(triton_q) for _ in range(args.repeats)]
    torch_run = sync_all(torch_q)

    def same(a, b) -> bool:
        return all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a.tensors(), b.tensors()))

    exact = {name: same(quantize_shard(w, ch, name=name), quantize_weight(w, ch, name=name)) for name, w, ch in layers[0]}
    doc = {
        "what": "re-quantization of every linear shard of a Llama-3.1-8B-shaped model (random BF16 weights) on the GPU, as one "
                "weight sync does; foursight.quant_methods.requantize.quantize_shard (Triton) vs foursight.layer.quantize_weight (PyTorch)",
        "card": torch.cuda.get_device_name(0), "commit": _commit(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "layers": args.layers, "channels": args.channels, "values": values, "bf16_gib": values * 2 / 2**30,
        "triton_sync_s": {"runs": runs, "median": statistics.median(runs), "warmup_with_compile": warm},
        "torch_sync_s": torch_run,
        "bit_identical_to_torch_on_layer0": exact,
        "target_s": 1.0, "met": statistics.median(runs) <= 1.0,
        "script_wall_s": time.perf_counter() - t_start,
        "command": COMMAND,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_requant.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
