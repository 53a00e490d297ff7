#!/usr/bin/env python
"""Comparison points for the FourSight benchmarks (what a skeptic compares a W4A4 kernel with).

Each ``*_call`` function returns a zero-argument callable that runs one linear layer on fixed
tensors, so that a benchmark can capture it in a CUDA graph and time the replays; each layer class
(``Fp8RowwiseLinear``, ``GemliteInt4Linear``) is the ``x2d -> y2d`` form the end-to-end benchmark
(benchmarks/kernels/bench_decode.py) swaps into a decoder.

* :func:`bf16_call` — cuBLAS BF16, ``F.linear(x, w_bf16)``.
* :func:`fp8_rowwise_gemm_call` — FP8 rowwise GEMM alone (what FlashRL users run; activation
  quantized beforehand): E4M3 weight with one fp32 scale per output row, E4M3 activation with one
  fp32 scale per token, ``torch._scaled_mm(..., use_fast_accum=True)`` (cuBLASLt/CUTLASS). The
  quantizers and the GEMM are the package's (:mod:`foursight.fp8`, what ``--rollout-precision fp8``
  runs) with its two timing options: ``check=False`` (no host-syncing NaN check, so the call can be
  captured in a CUDA graph) and ``fast_accum=True``.
* :func:`fp8_rowwise_linear_call` — the same GEMM plus its dynamic per-token activation
  quantization in plain eager PyTorch (row amax, scale, divide, clamp, cast: 6 kernels). Engines
  fuse that quantization into one kernel (vLLM's ``scaled_fp8_quant``) or into the previous op, so
  this variant is an upper bound on FP8's activation-quantization cost; the GEMM-alone variant is
  the lower bound. No ``torch.compile`` is assumed.
* :class:`Fp8FusedLinear` — FP8 as an engine runs it: the same GEMM, the per-token
  quantization fused into the op before the linear (``foursight.kernels.fp8_producers``: residual add + RMSNorm
  + quant, SiLU·mul + quant, as vLLM's fusion passes do) or one standalone launch where there is no such op
  (o_proj, vLLM's ``scaled_fp8_quant``). This is the fair FP8 yardstick (issue 52 item 0): the eager variant
  above gives FP8 six launches per linear that the BF16 and FourSight decoders do not pay.
* :func:`gemlite_int4_call` — GemLite 0.6.0.post2 A16W4: int4 weights, asymmetric (scale + zero)
  per group of 64 along K, bf16 activations, fp32 accumulation, Triton kernels (GEMV / split-K /
  GEMM chosen by M). GemLite's NVFP4 paths do not compile on sm_90 with Triton 3.6, so its int4
  path is the GemLite point. Its tuned configurations ship per GPU (``configs/h100.json``, ...)
  and are picked by a substring match on the device name; "NVIDIA H200" matches no file, so
  :func:`load_gemlite` loads the H100 file with GemLite's own ``gemlite.load_config`` (no edit of
  the installed package). Shapes/batch sizes absent from that file (e.g. M = 64 for GEMM) are
  autotuned by Triton on the first eager call: call once before capturing a graph.

Weights here are ``[N, K]`` (out x in) like ``nn.Linear``; activations ``[M, K]`` bf16.

Self-check / quick timing (CPU: BF16 and, where ``torch._scaled_mm`` runs on CPU, FP8; CUDA: all)::

    python benchmarks/kernels/baselines.py                  # relative errors; on CUDA also µs per call (foursight.kernels.tuning.time_gpu)
    python benchmarks/kernels/baselines.py --shapes 4096x4096,28672x4096 --ms 1,16,256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from foursight.channels import relative_error
from foursight.fp8 import quantize_activation_fp8, quantize_weight_fp8, scaled_mm_rowwise

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import ms_per_call  # noqa: E402  (benchmarks/common.py)

GEMLITE_VERSION = "0.6.0.post2"
GEMLITE_GROUP_SIZE = 64


class BaselineUnavailable(RuntimeError):
    """A baseline cannot run in this environment (missing package, no GPU, unsupported op); the
    message says why, for the benchmark to record and skip."""


# ---------------------------------------------------------------------------------------------
# cuBLAS BF16
# ---------------------------------------------------------------------------------------------


def bf16_call(x: torch.Tensor, w_bf16: torch.Tensor) -> Callable[[], torch.Tensor]:
    """cuBLAS BF16: ``F.linear(x, w_bf16)`` (x [M, K] bf16, w [N, K] bf16) -> [M, N] bf16."""
    return lambda: F.linear(x, w_bf16)


# ---------------------------------------------------------------------------------------------
# FP8 rowwise (E4M3, per-output-row weight scales, per-token activation scales)
# ---------------------------------------------------------------------------------------------


def fp8_rowwise_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 GEMM as engines run it: :func:`foursight.fp8.scaled_mm_rowwise` with fast accumulation;
    xq [M, K] e4m3, x_scale [M, 1], wq [N, K] e4m3, w_scale [N, 1] -> [M, N] bf16."""
    return scaled_mm_rowwise(xq, x_scale, wq, w_scale, fast_accum=True)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token E4M3 quantization, graph-capturable: :func:`foursight.fp8.quantize_activation_fp8`
    without its host-syncing NaN check. x [M, K] -> ``(xq [M, K], x_scale float32 [M, 1])``."""
    return quantize_activation_fp8(x, check=False)


class Fp8RowwiseLinear:
    """FP8 rowwise linear (FlashRL's rollout format): ``y = _scaled_mm(quant(x), Wq)``.

    ``Fp8RowwiseLinear(w_bf16)`` quantizes the weight once (:func:`foursight.fp8.quantize_weight_fp8`);
    ``layer(x2d)`` quantizes the activation per token in eager PyTorch and runs the GEMM.
    """

    def __init__(self, w: torch.Tensor):
        self.wq, self.w_scale = quantize_weight_fp8(w)
        self.out_features, self.in_features = self.wq.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_rowwise_mm(*quantize_act_fp8(x), self.wq, self.w_scale)


def fp8_rowwise_gemm_call(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FP8 rowwise GEMM alone (activation already quantized with :func:`quantize_act_fp8`, weight with
    :func:`foursight.fp8.quantize_weight_fp8`)."""
    return lambda: fp8_rowwise_mm(xq, x_scale, wq, w_scale)


def fp8_rowwise_linear_call(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], torch.Tensor]:
    """FP8 rowwise linear with its dynamic per-token activation quantization in eager PyTorch
    (amax, scale, cast) followed by the ``_scaled_mm`` GEMM; x [M, K] bf16 -> [M, N] bf16."""
    return lambda: fp8_rowwise_mm(*quantize_act_fp8(x), wq, w_scale)


class Fp8FusedLinear(Fp8RowwiseLinear):
    """FP8 rowwise linear with its activation quantization fused into the producer (what engines run).

    ``layer(inp)`` takes the :class:`foursight.kernels.fp8_producers.Fp8Input` a fused producer left
    (:meth:`fuse_rms_norm`, :meth:`fuse_silu_mul`; the decoder of bench_decode.py calls them in place of its
    own producer) and runs the GEMM alone; given a bf16 row (o_proj's input) it quantizes it in one launch
    (:func:`~foursight.kernels.fp8_producers.quantize_fp8`) first."""

    def __call__(self, x) -> torch.Tensor:
        from foursight.kernels.fp8_producers import Fp8Input, quantize_fp8  # noqa: PLC0415

        inp = x if isinstance(x, Fp8Input) else quantize_fp8(x)
        return fp8_rowwise_mm(inp.q, inp.scale, self.wq, self.w_scale)

    @staticmethod
    def fuse_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
        """``(Fp8Input of RMSNorm(x + residual), x + residual)`` in one launch."""
        from foursight.kernels.fp8_producers import rms_norm_fp8  # noqa: PLC0415

        return rms_norm_fp8(x, weight, eps, residual=residual)

    @staticmethod
    def fuse_silu_mul(gu: torch.Tensor):
        """``Fp8Input`` of SiLU(gate) · up in one launch."""
        from foursight.kernels.fp8_producers import silu_mul_fp8  # noqa: PLC0415

        return silu_mul_fp8(gu)


def fp8_available(device: torch.device | str) -> str | None:
    """None when rowwise ``_scaled_mm`` runs on ``device`` here, else the reason (for the record)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return f"FP8 _scaled_mm needs sm_89+, got sm_{''.join(map(str, torch.cuda.get_device_capability(dev)))}"
    try:
        x = torch.randn(16, 32, device=dev, dtype=torch.bfloat16)
        w = torch.randn(32, 32, device=dev, dtype=torch.bfloat16)
        rel = relative_error(Fp8RowwiseLinear(w)(x), F.linear(x.float(), w.float()))
        if not rel < 0.1:
            return f"rowwise _scaled_mm on {dev.type} gives rel err {rel:.2e}"
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"rowwise torch._scaled_mm unavailable on {dev.type}: {type(e).__name__}: {str(e)[:200]}"
    return None


# ---------------------------------------------------------------------------------------------
# GemLite A16W4 (int4, group 64, bf16 activations)
# ---------------------------------------------------------------------------------------------

_GEMLITE = None
GEMLITE_INFO: dict = {}


def load_gemlite():
    """Import GemLite and make its tuned configurations available on this GPU.

    GemLite picks ``configs/<tag>.json`` at import when ``<tag>`` is a substring of the device name
    lower-cased with spaces -> underscores; "nvidia_h200" contains no tag, so on an H200 (and any
    Hopper part without its own file) the ``h100.json`` that ships in the installed package is
    loaded with ``gemlite.load_config`` (merged into GemLite's in-memory cache; nothing on disk
    changes). ``FOURSIGHT_GEMLITE_CONFIG=/path.json`` overrides the file, ``=none`` skips it.
    Raises :class:`BaselineUnavailable` (with the reason) when GemLite cannot be used.
    """
    global _GEMLITE
    if _GEMLITE is not None:
        return _GEMLITE
    if not torch.cuda.is_available():
        raise BaselineUnavailable("GemLite needs a CUDA GPU (it queries the device at import)")
    try:
        import gemlite  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - ImportError, or its import-time device queries failing
        raise BaselineUnavailable(
            f"gemlite is not importable ({type(e).__name__}: {str(e)[:200]}); install the carried wheel: "
            f"python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site"
        ) from e
    GEMLITE_INFO.update(version=getattr(gemlite, "__version__", "?"), file=os.path.dirname(gemlite.__file__))
    if GEMLITE_INFO["version"] != GEMLITE_VERSION:
        GEMLITE_INFO["version_warning"] = f"expected gemlite {GEMLITE_VERSION}, found {GEMLITE_INFO['version']}"
    cfg_dir = os.path.join(os.path.dirname(gemlite.__file__), "configs")
    name = torch.cuda.get_device_properties(0).name.lower().replace(" ", "_")
    tags = sorted((f[:-5] for f in os.listdir(cfg_dir) if f.endswith(".json")), key=len, reverse=True) if os.path.isdir(cfg_dir) else []
    own = next((t for t in tags if t in name), None)
    override = os.environ.get("FOURSIGHT_GEMLITE_CONFIG")
    if override:
        path = None if override.lower() == "none" else override
    elif own is not None:
        path = None  # GemLite loaded its own file at import
        GEMLITE_INFO["config"] = f"{own}.json (GemLite's own choice for '{name}')"
    elif torch.cuda.get_device_capability(0) == (9, 0):
        path = os.path.join(cfg_dir, "h100.json")
    else:
        path = None
        GEMLITE_INFO["config"] = f"none for '{name}' (autotunes on first call)"
    if path is not None:
        ok = gemlite.load_config(path, print_error=True)
        GEMLITE_INFO["config"] = f"{path} loaded={ok}"
        if not ok:
            GEMLITE_INFO["config_warning"] = f"could not load {path}; GemLite autotunes on the first call per shape"
    _GEMLITE = gemlite
    return gemlite


def quantize_int4_asym(w: torch.Tensor, group_size: int = GEMLITE_GROUP_SIZE):
    """Round-to-nearest asymmetric int4 per group of ``group_size`` along K (HQQ's layout, which
    GemLite's ``A16Wn`` takes): ``w ≈ (q - zero) * scale``.

    Returns ``(q uint8 [N, K] in 0..15, scale [N, K/g], zero [N, K/g])``, scale/zero in bf16.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"quantize_int4_asym: K={k} is not a multiple of the group size {group_size}")
    wg = w.float().reshape(n, k // group_size, group_size)
    lo = wg.amin(dim=2, keepdim=True)
    hi = wg.amax(dim=2, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp_min(1e-8)
    zero = -lo / scale
    q = torch.round(wg / scale + zero).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return q, scale.reshape(n, -1).to(torch.bfloat16), zero.reshape(n, -1).to(torch.bfloat16)


class GemliteInt4Linear:
    """GemLite 0.6.0.post2 A16W4 linear: ``GemliteInt4Linear(w_bf16)`` quantizes (RTN, asymmetric,
    group 64) and packs the weight with ``gemlite.helper.A16Wn(dtype=bf16).from_weights``;
    ``layer(x2d)`` runs GemLite's ``forward`` (its auto kernel choice by M). Raises
    :class:`BaselineUnavailable` without GemLite."""

    def __init__(self, w: torch.Tensor, group_size: int = GEMLITE_GROUP_SIZE):
        gemlite = load_gemlite()
        if w.device.type != "cuda":
            raise BaselineUnavailable("GemLite runs on CUDA tensors only")
        from gemlite.helper import A16Wn  # noqa: PLC0415

        q, scale, zero = quantize_int4_asym(w, group_size)
        self.layer = A16Wn(device=w.device, dtype=torch.bfloat16).from_weights(
            W_q=q, scales=scale, zeros=zero, W_nbits=4, group_size=group_size, bias=None, quant_type="INT"
        )
        del q
        self.out_features, self.in_features = w.shape
        self._gemlite = gemlite

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.forward(x)


def gemlite_int4_call(x: torch.Tensor, w_bf16: torch.Tensor, group_size: int = GEMLITE_GROUP_SIZE) -> Callable[[], torch.Tensor]:
    """GemLite A16W4 (int4, asymmetric, group 64, bf16 activations; kernel auto-chosen by M).
    Builds the layer from ``w_bf16`` [N, K] now; the callable runs ``x [M, K] -> [M, N]`` bf16.
    Call it once eagerly before capturing it (Triton autotunes shapes missing from the config file).
    Raises :class:`BaselineUnavailable` when GemLite is not importable or there is no GPU."""
    layer = GemliteInt4Linear(w_bf16, group_size)
    return lambda: layer(x)


# ---------------------------------------------------------------------------------------------
# self-check and quick timing
# ---------------------------------------------------------------------------------------------


def _us(fns: list, device: torch.device) -> float | None:
    """µs per call on CUDA (:func:`common.ms_per_call`: the package's timer over rotated copies); None on
    the CPU, where this script checks relative errors only."""
    return 1e3 * ms_per_call(fns) if device.type == "cuda" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="", help="NxK,... (default: 4096x4096 on CUDA, 256x512 on CPU)")
    ap.add_argument("--ms", default="", help="M values (default: 1,16,256 on CUDA, 1,8 on CPU)")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or ("4096x4096" if cuda else "256x512")).split(",")]
    ms = [int(v) for v in (args.ms or ("1,16,256" if cuda else "1,8")).split(",")]
    fp8_reason = fp8_available(dev)
    rows = []
    torch.manual_seed(0)
    for n, k in shapes:
        w = (torch.randn(n, k, device=dev) * k**-0.5).to(torch.bfloat16)
        wq, sb = quantize_weight_fp8(w) if fp8_reason is None else (None, None)
        gl, gl_err = None, None
        try:
            gl = GemliteInt4Linear(w)
        except Exception as e:  # noqa: BLE001 - recorded, skipped
            gl_err = f"{type(e).__name__}: {str(e)[:300]}"
        # rotate over copies so that the weights streamed per graph replay exceed the L2 (decode)
        r = max(1, min(16, math.ceil(240 * 2**20 / (n * k * 2)))) if cuda else 1
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), w.float())
            row = {"N": n, "K": k, "M": m, "device": dev.type}
            ws = [w] + [w.clone() for _ in range(r - 1)]
            row["bf16_rel_err"] = relative_error(bf16_call(x, w)(), ref)
            row["bf16_us"] = _us([bf16_call(x, wi) for wi in ws], dev)
            del ws
            if fp8_reason is None:
                xq, sa = quantize_act_fp8(x)
                row["fp8_rel_err"] = relative_error(fp8_rowwise_linear_call(x, wq, sb)(), ref)
                pairs = [(wq, sb)] + [(wq.clone(), sb.clone()) for _ in range(r - 1)]
                row["fp8_gemm_us"] = _us([fp8_rowwise_gemm_call(xq, sa, a, b) for a, b in pairs], dev)
                row["fp8_with_quant_us"] = _us([fp8_rowwise_linear_call(x, a, b) for a, b in pairs], dev)
                del pairs
            else:
                row["fp8_skipped"] = fp8_reason
            if gl is not None:
                try:
                    row["gemlite_int4_rel_err"] = relative_error(gl(x), ref)
                    layers = [gl] + [GemliteInt4Linear(w) for _ in range(r - 1)]
                    row["gemlite_int4_us"] = _us([lambda L=L: L(x) for L in layers], dev)
                    del layers
                except Exception as e:  # noqa: BLE001
                    row["gemlite_skipped"] = f"{type(e).__name__}: {str(e)[:300]}"
            else:
                row["gemlite_skipped"] = gl_err
            rows.append(row)
            print(json.dumps({kk: (round(v, 5) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
    if GEMLITE_INFO:
        print("gemlite:", json.dumps(GEMLITE_INFO), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "gemlite": GEMLITE_INFO, "fp8_skipped": fp8_reason}, f, indent=1)
    bad = [r for r in rows if not (r["bf16_rel_err"] < 1e-2 and r.get("fp8_rel_err", 0) < 0.1 and r.get("gemlite_int4_rel_err", 0) < 0.2)]
    if bad:
        sys.exit(f"baselines: unexpected relative errors in {len(bad)} row(s)")


if __name__ == "__main__":
    main()
