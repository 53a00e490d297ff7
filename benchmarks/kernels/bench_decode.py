#!/usr/bin/env python
"""End-to-end decode and prefill speed of a Llama-3.1-8B-shaped decoder with swappable linears.

The model is built in code from the Llama-3.1-8B configuration (32 layers, hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, head dim 128, vocab 128256, RMSNorm, RoPE theta 500000
without Llama-3.1's long-context frequency scaling, SwiGLU) with random weights (nothing is
downloaded). As engines do, q/k/v are one linear [6144, 4096] and gate/up one linear
[28672, 4096], so a layer has 4 linears (qkv, o, gate_up, down); the embedding and the lm_head
stay BF16 in every mode. Modes (``--modes``):

* ``bf16`` — cuBLAS (``F.linear``).
* ``foursight-w4a4`` — FourSight NVFP4 weights + k = 128 BF16 channels per linear, chosen at random
  per layer (one set per input: q/k/v share one, gate/up share one, being one fused linear),
  built with ``foursight.layer.quantize_weight`` + ``foursight.kernels.api.prepare_weight`` and run
  with ``foursight.kernels.api.splice_linear(x, pw, act_quant=True)``.
* ``foursight-w4a16`` — the same checkpoint with ``act_quant=False`` (activations stay BF16).
* ``foursight-w4a4-k0`` — plain NVFP4 W4A4 (k = 0, the same weights): the reference of issue 36's
  "k = 128 within 2.3 % of k = 0" target.
* ``fp8`` — FP8 rowwise (E4M3 weights with per-row scales, per-token dynamic activation
  quantization in eager PyTorch, six kernels a linear, ``torch._scaled_mm``): benchmarks/kernels/baselines.py.
  Not FP8 as an engine runs it (issue 52 item 0): kept for comparison with the runs before 2026-12-08.
* ``fp8-fused`` — the same FP8 GEMM with the per-token quantization fused into the producers (residual add +
  RMSNorm + quant before qkv and gate_up, SiLU·mul + quant before down; o_proj's input quantized in one launch),
  ``baselines.Fp8FusedLinear`` on ``foursight.kernels.fp8_producers``: the fair FP8 yardstick, the producers
  fused as BF16's and FourSight's are.
* ``gemlite-a16w4`` (optional, not in the default list) — GemLite 0.6.0.post2 int4, group 64,
  BF16 activations: benchmarks/kernels/baselines.py (needs the gemlite package).

Producers (``--producers``): the residual add + RMSNorm before qkv and gate_up and SiLU·mul before down run
as FourSight's one-launch producers (``fused``, the default, in every mode alike: an engine fuses the add
into the norm), which in the W4A4 modes also quantize their row for the linear that reads it (issue 36
item 2: no standalone quantizer launch for three of a layer's four linears); ``torch`` keeps the eager
PyTorch ops and the quantizer inside each linear, as every run before 2026-12-07.

Decode: for each batch B (``--batches``), one decode step with a ``--context``-token context
already in a static BF16 KV cache (preallocated for the largest batch, filled with random values;
no prefill is run for it) — embedding, 32 layers (RMSNorm, fused qkv, RoPE by position tensors,
KV-cache write at the positions by index, ``scaled_dot_product_attention(enable_gqa=True)`` over
the context + 1 positions, o, RMSNorm, gate_up, SiLU·mul, down, residuals), final norm, lm_head —
is timed by the package's timer (:func:`foursight.kernels.tuning.time_gpu`: the step captured in a
CUDA graph with static inputs, replayed with the L2 flushed before each step, median of ``--reps``
rounds); tokens/s = B / step time. Every batch size is run eagerly first (FourSight's and
GemLite's autotuners time kernels on that call, which a capture must not do). Prefill: one
``--prefill-tokens``-token sequence (batch 1, causal SDPA, logits of the last token only; its
K/V are not written into the decode cache), timed the same way (``--prefill-reps`` rounds). On the
CPU, or where the capture fails, the time is the wall clock of eager runs, and the result says so.
The results of 2026-12-05 and before were timed with CUDA events around graph replays (no flush).

Correctness, cheaply, in the same run: the final-norm hidden state and the logits of one eager
decode step at the smallest batch are compared with the BF16 model's on the same inputs (relative
Frobenius error, top-1 agreement of the logits, finiteness), and every captured graph's output
with the eager step's (``graph_vs_eager_rel``). Nothing about speed is asserted.

Every failure of one mode / batch / prefill is recorded in the JSON and skipped. Results are
written after every batch and mode (``bench_decode.json`` and ``bench_decode.md`` in ``--out``);
``--budget-s`` stops starting new work after that many seconds; ``--append`` keeps the results of
modes (and batches) this run does not redo from an earlier ``bench_decode.json`` in ``--out``.

Usage::

    python benchmarks/kernels/bench_decode.py                                  # H200: all 4 modes, B = 1,16,64,256
    python benchmarks/kernels/bench_decode.py --modes bf16,gemlite-a16w4 --append
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_decode.py --tiny --device cpu \\
        --modes bf16,foursight-w4a4,foursight-w4a16 --batches 1,2 --context 32 --out /tmp/bd   # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import baselines  # noqa: E402  (benchmarks/kernels/baselines.py)
from common import git_commit, gpu_clocks, kernels_sha256  # noqa: E402  (benchmarks/common.py)

from foursight.channels import relative_error  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ALL_MODES = ("bf16", "foursight-w4a4", "foursight-w4a16", "foursight-w4a4-k0", "fp8", "fp8-fused", "gemlite-a16w4")
DEFAULT_MODES = "bf16,foursight-w4a4,foursight-w4a16,fp8"
#: how the decoder runs each linear's producer (the residual add + RMSNorm, SiLU·mul), the same for every mode
PRODUCERS = ("fused", "torch")
#: the decode step's attention (``--attention``): ``sdpa`` lets PyTorch choose the kernel (cuDNN's on the H100, a
#: prefill kernel run at one query row); ``flash`` forces SDPA's FlashAttention backend; ``flex`` is FlexAttention
#: compiled by torch.compile (its split-KV decode kernel on CUDA; eager on the CPU), the engine-like option
ATTENTION = ("sdpa", "flash", "flex")
PRODUCERS_HELP = ("fused (default): FourSight's one-launch producers (foursight.kernels.api.rms_norm with the residual "
                  "add, silu_mul) in every mode, which in the W4A4 modes also quantize for the next linear; torch: eager "
                  "PyTorch (x + delta, F.rms_norm, F.silu(g) * u) and the standalone quantizer inside each W4A4 linear "
                  "(the runs before 2026-12-07)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    rope_theta: float = 500000.0
    eps: float = 1e-5

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict:
        """[N, K] of the four linears of a layer."""
        return {
            "qkv": (self.q_dim + 2 * self.kv_dim, self.hidden),
            "o": (self.hidden, self.q_dim),
            "gate_up": (2 * self.intermediate, self.hidden),
            "down": (self.hidden, self.intermediate),
        }


LLAMA_3_1_8B = ModelConfig(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, layers=32)
TINY = ModelConfig(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=1000, layers=2)


def _err(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {str(e)[:600]}{where}"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _nbytes(obj) -> int:
    """Bytes of the tensors held (directly or in dataclass / object attributes, one level deep)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, torch.nn.Module):
        return sum(t.numel() * t.element_size() for t in list(obj.parameters()) + list(obj.buffers()))
    total = 0
    fields = vars(obj).values() if hasattr(obj, "__dict__") else ()
    for v in fields:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, torch.nn.Module):
            total += _nbytes(v)
    return total


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


class Decoder:
    """Random-weight Llama-style decoder; ``self.linears[l][name]`` is a callable x2d -> y2d."""

    def __init__(self, cfg: ModelConfig, dev: torch.device, max_batch: int, context: int, max_pos: int, seed: int = 0,
                 producers: str = "fused", attention: str = "sdpa"):
        if producers not in PRODUCERS:
            raise ValueError(f"producers: {producers!r} is not one of {', '.join(PRODUCERS)}")
        if attention not in ATTENTION:
            raise ValueError(f"attention: {attention!r} is not one of {', '.join(ATTENTION)}")
        self.attention = attention
        self._flex = None
        self.cfg, self.dev, self.max_batch, self.context = cfg, dev, max_batch, context
        self.producers = producers
        g = torch.Generator(device=dev).manual_seed(seed)
        bf = torch.bfloat16

        def lin(n, k):
            return torch.randn(n, k, device=dev, dtype=bf, generator=g).mul_(k**-0.5)

        self.embed = torch.randn(cfg.vocab, cfg.hidden, device=dev, dtype=bf, generator=g)
        self.lm_head = lin(cfg.vocab, cfg.hidden)
        self.final_norm = torch.ones(cfg.hidden, device=dev, dtype=bf)
        self.weights = []  # BF16 weights, kept for the whole run
        for _ in range(cfg.layers):
            layer = {name: lin(n, k) for name, (n, k) in cfg.linear_shapes().items()}
            layer["attn_norm"] = torch.ones(cfg.hidden, device=dev, dtype=bf)
            layer["mlp_norm"] = torch.ones(cfg.hidden, device=dev, dtype=bf)
            self.weights.append(layer)
        self.linears = None
        # RoPE tables (rotate-half convention), fp32 [max_pos, head_dim / 2]
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=dev, dtype=torch.float32) / cfg.head_dim))
        ang = torch.arange(max_pos, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()
        # static KV cache [layers][2] x [max_batch, kv_heads, context + 1, head_dim], random context
        t = context + 1
        self.kv = []
        for _ in range(cfg.layers):
            kvl = torch.empty(2, max_batch, cfg.kv_heads, t, cfg.head_dim, device=dev, dtype=bf)
            kvl.normal_(generator=g)
            self.kv.append(kvl)
        # static decode inputs: token ids, positions (= context: the new token's position), batch index
        self.tokens = torch.randint(0, cfg.vocab, (max_batch,), device=dev, generator=g)
        self.positions = torch.full((max_batch,), context, device=dev, dtype=torch.long)
        self.bidx = torch.arange(max_batch, device=dev)

    def weight_bytes_bf16(self) -> int:
        return sum(_nbytes(w) for layer in self.weights for k, w in layer.items() if k in self.cfg.linear_shapes())

    def kv_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.kv)

    # -- building blocks (eager ops; all graph-capturable) -------------------------------------

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.eps)

    def _add_norm(self, x, delta, w, consumer):
        """``(x + delta, RMSNorm(x + delta))`` (no add when ``delta`` is None). ``torch``: two eager ops. ``fused``:
        one launch of FourSight's producer (``foursight.kernels.api.rms_norm``), which also quantizes the
        normed row for ``consumer`` when it is a FourSight W4A4 linear (then the linear gets a ProducedInput)."""
        if self.producers == "torch":
            if delta is not None:
                x = x + delta
            return x, self._norm(x, w)
        fuse = getattr(consumer, "fuse_rms_norm", None)
        if fuse is not None:  # the consumer brings its own fused producer (the FP8 baseline's)
            inp, s = fuse(x, w, self.cfg.eps, delta)
            return (s if delta is not None else x), inp
        import foursight.kernels.api as fk  # noqa: PLC0415

        pw = getattr(consumer, "quantizes_for", None)
        p, s = fk.rms_norm(x, w, self.cfg.eps, residual=delta, consumer=pw)
        return (s if delta is not None else x), (p if pw is not None else p.y)

    @staticmethod
    def _rope(x, cos, sin):
        """x [T, heads, head_dim] bf16; cos/sin [T, 1, head_dim/2] fp32."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def down_input(self, down, gu):
        """What the down linear ``down`` reads, from gate_up's output ``gu``: SiLU·mul as ``--producers`` runs it
        (fused: the consumer's own fused producer if it has one, else FourSight's, quantizing for a W4A4 consumer)."""
        if self.producers == "fused":
            fuse = getattr(down, "fuse_silu_mul", None)
            if fuse is not None:
                return fuse(gu)
            import foursight.kernels.api as fk  # noqa: PLC0415

            pw = getattr(down, "quantizes_for", None)
            p = fk.silu_mul(gu, consumer=pw)
            return p if pw is not None else p.y
        gate, up = gu.split(self.cfg.intermediate, dim=-1)
        return F.silu(gate) * up

    def _mlp(self, lins, x):
        return lins["down"](self.down_input(lins["down"], lins["gate_up"](x)))

    def attend(self, q, k, v):
        """Decode attention, ``q`` [b, heads, 1, hd] over the cache ``k``/``v`` [b, kv_heads, T, hd] (GQA), by ``--attention``."""
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if self.attention == "flash":
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

            self._flex = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
        return self._flex(q, k, v, enable_gqa=True)

    def _split_qkv(self, qkv, t):
        c = self.cfg
        q = qkv[:, : c.q_dim].view(t, c.heads, c.head_dim)
        k = qkv[:, c.q_dim : c.q_dim + c.kv_dim].view(t, c.kv_heads, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim :].view(t, c.kv_heads, c.head_dim)
        return q, k, v

    def decode_step(self, b: int):
        """One decode step for the first ``b`` sequences; returns (final-norm hidden [b, H], logits [b, V])."""
        c = self.cfg
        tok, pos, bi = self.tokens[:b], self.positions[:b], self.bidx[:b]
        x = F.embedding(tok, self.embed)
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        delta = None  # the MLP's output, added to the residual stream by the next norm
        for li in range(c.layers):
            w, lins, kv = self.weights[li], self.linears[li], self.kv[li]
            x, h = self._add_norm(x, delta, w["attn_norm"], lins["qkv"])
            q, k, v = self._split_qkv(lins["qkv"](h), b)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            kc, vc = kv[0], kv[1]
            kc[bi, :, pos] = k  # [b, kv_heads, head_dim] at each sequence's position
            vc[bi, :, pos] = v.to(vc.dtype)
            attn = self.attend(q.unsqueeze(2), kc[:b], vc[:b])  # [b, heads, 1, hd]
            x, h = self._add_norm(x, lins["o"](attn.reshape(b, c.q_dim)), w["mlp_norm"], lins["gate_up"])
            delta = self._mlp(lins, h)
        _, hf = self._add_norm(x, delta, self.final_norm, None)
        return hf, F.linear(hf, self.lm_head)

    def prefill(self, tokens: torch.Tensor):
        """Causal forward of one sequence ``tokens`` [S]; returns the last token's logits [1, V]."""
        c = self.cfg
        s = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[:s][:, None, :], self.sin[:s][:, None, :]
        delta = None
        for li in range(c.layers):
            w, lins = self.weights[li], self.linears[li]
            x, h = self._add_norm(x, delta, w["attn_norm"], lins["qkv"])
            q, k, v = self._split_qkv(lins["qkv"](h), s)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, enable_gqa=True,
            )  # [1, heads, S, hd]
            x, h = self._add_norm(x, lins["o"](attn[0].transpose(0, 1).reshape(s, c.q_dim)), w["mlp_norm"], lins["gate_up"])
            delta = self._mlp(lins, h)
        _, hf = self._add_norm(x[-1:], delta[-1:], self.final_norm, None)
        return F.linear(hf, self.lm_head)


# ---------------------------------------------------------------------------------------------
# linear layers per mode
# ---------------------------------------------------------------------------------------------


def _channels(k_dim: int, k: int, seed: int, layer: int, name: str, dev) -> torch.Tensor:
    """k random input channels of one linear, sorted int32 (deterministic in seed/layer/name)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + sum(map(ord, name)))
    return torch.sort(torch.randperm(k_dim, generator=g)[:k]).values.to(torch.int32).to(dev)


def build_foursight(model: Decoder, k: int, seed: int) -> tuple[list, dict, dict]:
    """FourSight prepared weights per layer (the checkpoint both FourSight modes run), its info, and
    the QuantizedWeight of layer 0's linears (for the kernel-vs-reference check)."""
    from foursight.layer import quantize_weight  # noqa: PLC0415  (imported here: a broken kernel build fails this mode only)

    import foursight.kernels.api as fk  # noqa: PLC0415

    out, nbytes, ref = [], 0, {}
    cuda = model.dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(model.dev)
        alloc0 = torch.cuda.memory_allocated(model.dev)
    for li, w in enumerate(model.weights):
        layer = {}
        for name, (n, k_dim) in model.cfg.linear_shapes().items():
            ch = _channels(k_dim, k, seed, li, name, model.dev)
            qw = quantize_weight(w[name], ch)
            pw = fk.prepare_weight(qw, name=f"layers.{li}.{name}")
            if li == 0:
                ref[name] = qw
            del qw
            nbytes += fk.resident_bytes(pw)  # every tensor the prepared layer keeps (its one weight form included)
            layer[name] = pw
        out.append(layer)
    info = {"weight_bytes": nbytes, "weight_bytes_method": "sum of foursight.kernels.api.resident_bytes over the prepared linears",
            "channels_per_linear": k}
    if cuda:
        torch.cuda.synchronize(model.dev)
        # real device memory the prepared linears hold (the layer-0 QuantizedWeights kept for the check included)
        info["device_bytes_allocated"] = torch.cuda.memory_allocated(model.dev) - alloc0
    return out, info, ref


def kernel_check(prepared0: dict, ref: dict, act_quant: bool, ms: list, dev, seed: int) -> dict:
    """Relative error of ``splice_linear`` vs ``foursight.layer.reference_linear`` (the PyTorch
    oracle of the same checkpoint) for layer 0's linears at the given M: separates kernel bugs from
    quantization error (the kernel tests accept < 5e-3)."""
    import foursight.kernels.api as fk  # noqa: PLC0415
    from foursight.layer import reference_linear  # noqa: PLC0415

    g = torch.Generator(device=dev).manual_seed(seed + 11)
    out = {}
    for name, qw in ref.items():
        pw = prepared0[name]
        for m in ms:
            x = torch.randn(m, pw.in_features, device=dev, generator=g).to(torch.bfloat16)
            y = fk.splice_linear(x, pw, act_quant=act_quant).float()
            yr = reference_linear(x, qw, act_quant=act_quant, out_dtype=torch.float32)
            out[f"{name}/M={m}"] = relative_error(y, yr)
    return out


class FourSightLinear:
    """One FourSight linear of the decoder: ``splice_linear`` on a bf16 row or on a fused producer's
    ``ProducedInput``; ``quantizes_for`` (W4A4 only) is the prepared weight a producer quantizes for."""

    def __init__(self, pw, act_quant: bool):
        self.pw, self.act_quant = pw, act_quant
        self.quantizes_for = pw if act_quant else None

    def __call__(self, x):
        import foursight.kernels.api as fk  # noqa: PLC0415

        return fk.splice_linear(x, self.pw, bias=None, input_global_scale=None, act_quant=self.act_quant)


def foursight_linears(prepared: list, act_quant: bool) -> list:
    return [{name: FourSightLinear(pw, act_quant) for name, pw in layer.items()} for layer in prepared]


def build_linears(mode: str, model: Decoder, args, cache: dict) -> tuple[list, dict]:
    """(linears per layer, info) for ``mode``; ``cache`` keeps the FourSight checkpoint between its two modes."""
    names = list(model.cfg.linear_shapes())
    if mode == "bf16":
        return [{n: (lambda x, w=layer[n]: F.linear(x, w)) for n in names} for layer in model.weights], {
            "weight_bytes": model.weight_bytes_bf16()}
    if mode in ("foursight-w4a4", "foursight-w4a16"):
        if "foursight" not in cache:
            t0 = time.time()
            prepared, info, ref = build_foursight(model, args.channels, args.seed)
            info["quantize_s"] = time.time() - t0
            cache["foursight"], cache["foursight_ref"] = (prepared, info), ref
        prepared, info = cache["foursight"]
        return foursight_linears(prepared, act_quant=(mode == "foursight-w4a4")), dict(info)
    if mode == "foursight-w4a4-k0":  # plain NVFP4 (no BF16 channels): the paper's bound is k = 128 within 2.3 % of this
        t0 = time.time()
        prepared, info, _ = build_foursight(model, 0, args.seed)
        info["quantize_s"] = time.time() - t0
        return foursight_linears(prepared, act_quant=True), dict(info)
    if mode in ("fp8", "fp8-fused"):
        reason = baselines.fp8_available(model.dev)
        if reason:
            raise baselines.BaselineUnavailable(reason)
        cls = baselines.Fp8FusedLinear if mode == "fp8-fused" else baselines.Fp8RowwiseLinear
        layers = [{n: cls(layer[n]) for n in names} for layer in model.weights]
        quant = ("per-token E4M3 fused into the producers (foursight.kernels.fp8_producers; o_proj: one launch)"
                 if mode == "fp8-fused" else "per-token E4M3 in eager PyTorch (6 kernels)")
        return layers, {"weight_bytes": sum(_nbytes(L) for layer in layers for L in layer.values()),
                        "activation_quant": quant + ", torch._scaled_mm use_fast_accum=True"}
    if mode == "gemlite-a16w4":
        baselines.load_gemlite()
        layers = [{n: baselines.GemliteInt4Linear(layer[n]) for n in names} for layer in model.weights]
        return layers, {"weight_bytes": sum(_nbytes(L.layer) for layer in layers for L in layer.values()),
                        "gemlite": dict(baselines.GEMLITE_INFO), "group_size": baselines.GEMLITE_GROUP_SIZE}
    raise ValueError(f"unknown mode {mode!r} (known: {', '.join(ALL_MODES)})")


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


#: how a CUDA time was taken (written into every result row)
TIMING = "foursight.kernels.tuning.time_gpu: CUDA-graph replays, L2 flushed before each call, median round"


def _capture(fn, dev):
    """Warm ``fn`` on a side stream, capture it in a CUDA graph; returns (graph, static output)."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize(dev)
    return g, out


def _graph_ms(fn, eager_out: torch.Tensor, dev, rounds: int, reps: int) -> tuple[float, float]:
    """(GPU ms of one ``fn()`` by :func:`foursight.kernels.tuning.time_gpu`, relative error of the output
    of ``fn`` replayed from a CUDA graph against ``eager_out``). ``fn`` returns the tensor to check (or a
    tuple ending with it)."""
    from foursight.kernels.tuning import time_gpu  # noqa: PLC0415

    g, out = _capture(fn, dev)
    g.replay()
    torch.cuda.synchronize(dev)
    rel = relative_error(out[-1] if isinstance(out, tuple) else out, eager_out)
    del g, out
    return time_gpu(fn, reps=reps, rounds=rounds), rel


def _eager_ms(fn, dev, reps: int) -> tuple[float, int]:
    ts = []
    for _ in range(max(1, reps)):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(1e3 * (time.perf_counter() - t0))
    ts.sort()
    return ts[len(ts) // 2], len(ts)


def time_decode(model: Decoder, b: int, args) -> dict:
    dev = model.dev
    t0 = time.time()
    _, eager_logits = model.decode_step(b)  # eager first: autotuners run here, never inside the capture
    eager_logits = eager_logits.clone()
    _sync(dev)
    row = {"batch": b, "warmup_s": time.time() - t0}
    if dev.type == "cuda" and not args.no_graph:
        try:
            ms, row["graph_vs_eager_rel"] = _graph_ms(lambda: model.decode_step(b), eager_logits, dev, args.reps, 8)
            row.update(step_ms=ms, rounds=args.reps, timing=TIMING, clocks_after=gpu_clocks(dev.index or 0))
        except Exception as e:  # noqa: BLE001 - capture failed: an eager number (launch-bound at small B), labelled as such
            row["graph_error"] = _err(e)
            _free(dev)
    if "step_ms" not in row:
        ms, n = _eager_ms(lambda: model.decode_step(b), dev, args.reps if dev.type == "cuda" else args.cpu_reps)
        row.update(step_ms=ms, reps=n, timing=("eager, wall clock" + (" (synchronized)" if dev.type == "cuda" else ""))
                   + (" - CUDA-graph capture failed" if "graph_error" in row else ""))
    row["tokens_per_s"] = b / (row["step_ms"] * 1e-3)
    return row


def time_prefill(model: Decoder, s: int, args) -> dict:
    dev = model.dev
    g_tok = torch.Generator(device=dev).manual_seed(args.seed + 7)
    tokens = torch.randint(0, model.cfg.vocab, (s,), device=dev, generator=g_tok)
    t0 = time.time()
    eager = model.prefill(tokens).clone()
    _sync(dev)
    row = {"tokens": s, "batch": 1, "warmup_s": time.time() - t0}
    reps = args.prefill_reps if dev.type == "cuda" else args.cpu_reps
    if dev.type == "cuda" and not args.no_graph:
        try:
            ms, row["graph_vs_eager_rel"] = _graph_ms(lambda: model.prefill(tokens), eager, dev, reps, 2)
            row.update(ms=ms, rounds=reps, timing=TIMING, clocks_after=gpu_clocks(dev.index or 0))
        except Exception as e:  # noqa: BLE001 - capture failed: time eagerly instead
            row["graph_error"] = _err(e)
            _free(dev)
    if "ms" not in row:
        ms, n = _eager_ms(lambda: model.prefill(tokens), dev, reps)
        row.update(ms=ms, reps=n, timing=("eager, wall clock" + (" (synchronized)" if dev.type == "cuda" else ""))
                   + (" - CUDA-graph capture failed" if "graph_error" in row else ""))
    row["tokens_per_s"] = s / (row["ms"] * 1e-3)
    return row


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------


def environment(dev: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev),
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    try:
        import triton  # noqa: PLC0415

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable ({type(e).__name__})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(dev)), sm_count=p.multi_processor_count,
                   gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    env["kernels_sha256"] = kernels_sha256(REPO / "kernels")[:16]
    try:
        from foursight.kernels.runtime import pdl_supported  # noqa: PLC0415

        env["pdl"] = pdl_supported()
    except Exception:  # noqa: BLE001
        env["pdl"] = None
    try:
        env["git_commit"] = None if git_commit() == "unknown" else git_commit(short=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "kernels"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        env["kernels_dirty"] = bool(dirty) if env["git_commit"] else None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def _tuned_snapshot() -> list | None:
    try:
        import foursight.kernels.api as fk  # noqa: PLC0415

        return [{"key": [str(v) for v in k], "config": str(v)} for k, v in fk.TUNED.items()]
    except Exception:  # noqa: BLE001
        return None


def run(args) -> dict:
    dev = torch.device(args.device)
    cfg = TINY if args.tiny else LLAMA_3_1_8B
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    batches = sorted({int(v) for v in args.batches.split(",") if v.strip()})
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    res = {
        "env": environment(dev),
        "model": dict(dataclasses.asdict(cfg), name="tiny" if args.tiny else "llama-3.1-8b-shaped (random weights)"),
        "settings": {"modes": modes, "batches": batches, "context": args.context, "prefill_tokens": args.prefill_tokens,
                     "channels_per_linear": args.channels, "seed": args.seed, "budget_s": args.budget_s,
                     "producers": args.producers, "attention": args.attention,
                     "cuda_graphs": dev.type == "cuda" and not args.no_graph},
        "method": ("decode: one step (embedding, all layers, final norm, lm_head) captured in a CUDA graph with static "
                   "inputs, timed by foursight.kernels.tuning.time_gpu (L2 flushed before each step), tokens/s = batch / step time; static BF16 KV cache "
                   f"with {args.context} random context positions; prefill: one sequence, batch 1, the same timer; "
                   "lm_head BF16 in every mode; q/k/v and gate/up fused; check: eager decode step at the largest batch <= 64 "
                   "vs the BF16 model (random weights: logit margins are small, so top-1 agreement is a weak signal)"),
        "modes": {},
    }
    prev = None
    if args.append and (out_dir / "bench_decode.json").exists():
        try:
            prev = json.loads((out_dir / "bench_decode.json").read_text())
        except Exception as e:  # noqa: BLE001
            res["append_error"] = _err(e)
    if prev:
        res["earlier_runs"] = [prev.get("env", {})] + prev.get("earlier_runs", [])
        for m, r in prev.get("modes", {}).items():
            res["modes"][m] = dict(r, from_earlier_run=r.get("from_earlier_run") or prev.get("env", {}).get("date_utc"))
    t_start = time.time()

    def over_budget() -> bool:
        return time.time() - t_start > args.budget_s

    print(f"[bench_decode] {res['model']['name']}: {cfg.layers} layers on {dev} ({res['env'].get('gpu')}); modes {modes}, "
          f"batches {batches}, context {args.context}", flush=True)
    max_pos = max(args.context + 1, args.prefill_tokens, 1)
    try:
        model = Decoder(cfg, dev, max(batches), args.context, max_pos, seed=args.seed, producers=args.producers,
                        attention=args.attention)
        _sync(dev)
    except Exception as e:  # noqa: BLE001 - nothing can run
        res["error"] = f"building the model: {_err(e)}"
        _write(res, out_dir)
        return res
    res["model"]["bf16_linear_weight_bytes"] = model.weight_bytes_bf16()
    res["model"]["kv_cache_bytes"] = model.kv_bytes()
    res["model"]["build_s"] = time.time() - t_start
    # BF16 reference of one eager decode step at the largest batch <= 64 (more rows for top-1 agreement)
    b_ref = max([b for b in batches if b <= 64] or batches[:1])
    model.linears = build_linears("bf16", model, args, {})[0]
    ref_h, ref_logits = (t.clone() for t in model.decode_step(b_ref))
    _sync(dev)
    model.linears = None
    print(f"[bench_decode] model built in {res['model']['build_s']:.1f}s "
          f"(linears {model.weight_bytes_bf16() / 2**30:.2f} GiB bf16, KV cache {model.kv_bytes() / 2**30:.2f} GiB)", flush=True)

    cache: dict = {}
    for mode in modes:
        if over_budget():
            if mode not in res["modes"]:  # (with --append, an earlier result of this mode is kept)
                res["modes"][mode] = {"status": "skipped", "reason": f"time budget of {args.budget_s:.0f}s reached"}
            print(f"[bench_decode] {mode}: skipped (budget)", flush=True)
            continue
        if not mode.startswith("foursight") and "foursight" in cache:
            cache.clear()  # free the FourSight checkpoint once its modes are done
            _free(dev)
        prev_mode = res["modes"].get(mode) if args.append else None
        r = {"status": "running", "run_date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "decode": {}}
        if prev_mode and prev_mode.get("decode"):
            r["decode"] = {k: v for k, v in prev_mode["decode"].items() if int(k) not in batches}
        res["modes"][mode] = r
        t_mode = time.time()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            model.linears, info = build_linears(mode, model, args, cache)
            _sync(dev)
            r.update(info)
            r["build_s"] = time.time() - t_mode
        except Exception as e:  # noqa: BLE001 - this mode cannot run; record and go on
            r.update(status="error", error=f"building the {mode} linears: {_err(e)}")
            print(f"[bench_decode] {mode}: {r['error']}", flush=True)
            model.linears = None
            _free(dev)
            _write(res, out_dir)
            continue
        print(f"[bench_decode] {mode}: linears built in {r['build_s']:.1f}s ({r.get('weight_bytes', 0) / 2**30:.2f} GiB)", flush=True)
        # correctness vs BF16 (eager, smallest batch)
        try:
            h, logits = model.decode_step(b_ref)
            _sync(dev)
            r["check"] = {
                "batch": b_ref,
                "hidden_rel_err": relative_error(h, ref_h),
                "logits_rel_err": relative_error(logits, ref_logits),
                "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
                "finite": bool(torch.isfinite(h).all() and torch.isfinite(logits).all()),
            }
            print(f"[bench_decode] {mode}: check {json.dumps(r['check'])}", flush=True)
            del h, logits
        except Exception as e:  # noqa: BLE001
            r["check"] = {"batch": b_ref, "error": _err(e)}
            print(f"[bench_decode] {mode}: check failed: {r['check']['error']}", flush=True)
        if mode.startswith("foursight") and "foursight_ref" in cache:
            try:
                r["kernel_vs_reference_rel"] = kernel_check(cache["foursight"][0][0], cache["foursight_ref"], mode == "foursight-w4a4",
                                                            sorted({batches[0], b_ref}), dev, args.seed)
                print(f"[bench_decode] {mode}: kernel vs reference_linear (layer 0): "
                      f"max rel err {max(r['kernel_vs_reference_rel'].values()):.2e}", flush=True)
            except Exception as e:  # noqa: BLE001
                r["kernel_vs_reference_rel"] = {"error": _err(e)}
                print(f"[bench_decode] {mode}: kernel check failed: {r['kernel_vs_reference_rel']['error']}", flush=True)
        for b in batches:
            if over_budget():
                r["decode"][str(b)] = {"batch": b, "skipped": f"time budget of {args.budget_s:.0f}s reached"}
                continue
            try:
                row = time_decode(model, b, args)
                print(f"[bench_decode] {mode}: decode B={b}: {row['step_ms']:.3f} ms/step, {row['tokens_per_s']:.1f} tok/s "
                      f"(warm-up {row['warmup_s']:.1f}s)", flush=True)
            except Exception as e:  # noqa: BLE001
                row = {"batch": b, "error": _err(e)}
                print(f"[bench_decode] {mode}: decode B={b} failed: {row['error']}", flush=True)
                _free(dev)
            r["decode"][str(b)] = row
            _write(res, out_dir)
        if args.prefill_tokens > 0:
            if over_budget():
                r["prefill"] = {"skipped": f"time budget of {args.budget_s:.0f}s reached"}
            else:
                try:
                    r["prefill"] = time_prefill(model, args.prefill_tokens, args)
                    print(f"[bench_decode] {mode}: prefill {args.prefill_tokens} tokens: {r['prefill']['ms']:.2f} ms "
                          f"({r['prefill']['timing']})", flush=True)
                except Exception as e:  # noqa: BLE001
                    r["prefill"] = {"tokens": args.prefill_tokens, "error": _err(e)}
                    print(f"[bench_decode] {mode}: prefill failed: {r['prefill']['error']}", flush=True)
        if mode.startswith("foursight"):
            r["tuned"] = _tuned_snapshot()
        ok = [v for v in r["decode"].values() if "tokens_per_s" in v]
        r["status"] = "ok" if ok and len(ok) == len(r["decode"]) else ("partial" if ok else "error")
        r["mode_s"] = time.time() - t_mode
        model.linears = None
        _free(dev)
        if dev.type == "cuda":
            r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        _write(res, out_dir)
    res["total_s"] = time.time() - t_start
    return res


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------


def _write(res: dict, out_dir: Path) -> None:
    (out_dir / "bench_decode.json").write_text(json.dumps(res, indent=1))
    (out_dir / "bench_decode.md").write_text(markdown(res))


def _fmt(v, spec=".1f", none="—"):
    return none if v is None else format(v, spec)


def markdown(res: dict) -> str:
    env, m, st = res["env"], res["model"], res["settings"]
    dev = env.get("gpu") or f"CPU ({env.get('device')})"
    lines = [
        f"# End-to-end decode / prefill, {m['name']}, {m['layers']} layers, on {dev} ({env['date_utc']} UTC)",
        "",
        f"Command: `{env['command']}`; torch {env['torch']}, triton {env.get('triton')}, kernels sha256 {env.get('kernels_sha256')}"
        f" (git {env.get('git_commit')}{', kernels/ modified' if env.get('kernels_dirty') else ''}).",
        f"Model: hidden {m['hidden']}, intermediate {m['intermediate']}, {m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, "
        f"vocab {m['vocab']}; BF16 linears {m.get('bf16_linear_weight_bytes', 0) / 2**30:.2f} GiB, "
        f"KV cache {m.get('kv_cache_bytes', 0) / 2**30:.2f} GiB; context {st['context']} tokens; "
        f"FourSight k = {st['channels_per_linear']} BF16 channels per linear.",
        f"Method: {res['method']}.",
        "",
    ]
    if res.get("error"):
        lines += [f"**Run failed:** {res['error']}", ""]
    modes = res["modes"]
    batches = sorted({int(b) for r in modes.values() for b in r.get("decode", {})} | set(st["batches"]))
    bf = modes.get("bf16", {})

    def tps(r, b):
        return r.get("decode", {}).get(str(b), {}).get("tokens_per_s")

    head = "| mode | weights GiB | " + " | ".join(f"B={b} tok/s (x bf16)" for b in batches) + f" | prefill {st['prefill_tokens']} ms (x bf16) |"
    lines += ["Decode tokens/s (x bf16 = tokens/s / BF16's, >1 faster); prefill time of one sequence (x bf16 = BF16 ms / mode ms).", "",
              head, "|" + "---|" * (3 + len(batches))]
    for name, r in modes.items():
        cells = []
        for b in batches:
            v, base = tps(r, b), tps(bf, b)
            d = r.get("decode", {}).get(str(b), {})
            if v is None:
                cells.append("error" if "error" in d else ("skipped" if d.get("skipped") else "—"))
            else:
                cells.append(f"{v:,.1f}" + (f" ({v / base:.2f}x)" if base else ""))
        p, pb = r.get("prefill", {}).get("ms"), bf.get("prefill", {}).get("ms")
        pcell = "—" if p is None else (f"{p:.1f}" + (f" ({pb / p:.2f}x)" if pb else ""))
        if p is None and r.get("prefill", {}).get("error"):
            pcell = "error"
        wb = r.get("weight_bytes")
        wcell = _fmt(wb / 2**30 if wb else None, ".2f" if (wb or 0) >= 2**28 else ".4f")
        tag = name + (" (earlier run)" if r.get("from_earlier_run") else "")
        lines.append(f"| {tag} | {wcell} | " + " | ".join(cells) + f" | {pcell} |")
    lines += ["", "Step time (ms) per batch:", "", "| mode | " + " | ".join(f"B={b}" for b in batches) + " |", "|" + "---|" * (1 + len(batches))]
    for name, r in modes.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(r.get("decode", {}).get(str(b), {}).get("step_ms"), ".3f") for b in batches) + " |")
    lines += ["", "Correctness (one eager decode step vs the BF16 model on the same inputs; graph vs eager = the captured "
              "graph's logits vs the eager step's, worst over batches; kernel vs ref = worst relative error of splice_linear vs "
              "foursight.layer.reference_linear over layer 0's linears, the kernel tests accept < 5e-3):", "",
              "| mode | batch | hidden rel err | logits rel err | top-1 agreement | finite | graph vs eager | kernel vs ref |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in modes.items():
        c = r.get("check", {})
        gv = [d.get("graph_vs_eager_rel") for d in r.get("decode", {}).values() if d.get("graph_vs_eager_rel") is not None]
        kv = r.get("kernel_vs_reference_rel") or {}
        kcell = "error" if "error" in kv else _fmt(max(kv.values()) if kv else None, ".1e")
        if "error" in c:
            lines.append(f"| {name} | {c.get('batch')} | error | | | | | {kcell} |")
        elif c:
            lines.append(f"| {name} | {c['batch']} | {c['hidden_rel_err']:.2e} | {c['logits_rel_err']:.2e} | {c['top1_agreement']:.3f} | "
                         f"{c['finite']} | {_fmt(max(gv) if gv else None, '.1e')} | {kcell} |")
    notes = []
    for name, r in modes.items():
        if r.get("error"):
            notes.append(f"- {name}: {r['error']}")
        if r.get("reason"):
            notes.append(f"- {name}: {r['reason']}")
        if r.get("check", {}).get("error"):
            notes.append(f"- {name} check: {r['check']['error']}")
        if (r.get("kernel_vs_reference_rel") or {}).get("error"):
            notes.append(f"- {name} kernel check: {r['kernel_vs_reference_rel']['error']}")
        for b, d in r.get("decode", {}).items():
            if d.get("error"):
                notes.append(f"- {name} B={b}: {d['error']}")
            if d.get("graph_error"):
                notes.append(f"- {name} B={b}: CUDA-graph capture failed, timed eagerly: {d['graph_error']}")
        p = r.get("prefill", {})
        if p.get("error"):
            notes.append(f"- {name} prefill: {p['error']}")
        if p.get("graph_error"):
            notes.append(f"- {name} prefill graph capture failed (timed eagerly): {p['graph_error']}")
        if r.get("from_earlier_run"):
            notes.append(f"- {name}: results from an earlier run ({r['from_earlier_run']}), kept by --append")
        if r.get("gemlite"):
            notes.append(f"- {name}: gemlite {json.dumps(r['gemlite'])}")
    if notes:
        lines += ["", "Errors, skips and notes:", ""] + notes
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, from {', '.join(ALL_MODES)} (default {DEFAULT_MODES})")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--context", type=int, default=None, help="tokens already in the KV cache (default 1024; --tiny 32)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny 2)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="prefill sequence length (default 4096; --tiny 32; 0 = no prefill)")
    ap.add_argument("--channels", type=int, default=None, help="FourSight BF16 channels per linear (default 128; --tiny 32)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new modes/batches after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 256, intermediate 512, 4/2 heads x 64, vocab 1000 (smoke test)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (eager timing, no CUDA graphs)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--append", action="store_true", help="keep other modes'/batches' results from an earlier bench_decode.json in --out")
    ap.add_argument("--reps", type=int, default=5, help="rounds of the timer per decode batch (CUDA; a round replays 8 steps)")
    ap.add_argument("--prefill-reps", type=int, default=5, help="rounds of the timer for the prefill (CUDA; a round replays 2 runs)")
    ap.add_argument("--cpu-reps", type=int, default=1, help="timed eager runs per measurement on CPU (after the warm-up run)")
    ap.add_argument("--no-graph", action="store_true", help="time eagerly on CUDA too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--producers", choices=PRODUCERS, default="fused", help=PRODUCERS_HELP)
    ap.add_argument("--attention", choices=ATTENTION, default="sdpa",
                    help="decode attention: sdpa (PyTorch's choice; the runs before 2026-12-08), flash (SDPA's FlashAttention "
                         "backend), flex (FlexAttention under torch.compile: an engine-like decode kernel)")
    ap.add_argument("--dry-run", action="store_true", help="no timing: write the result file's environment and arguments only")
    args = ap.parse_args()
    if args.dry_run:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        res = {"dry_run": True, "env": environment(torch.device("cpu")), "args": vars(args), "tuned": _tuned_snapshot()}
        (out / "bench_decode.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.context is None:
        args.context = 32 if args.tiny else 1024
    if args.prefill_tokens is None:
        args.prefill_tokens = 32 if args.tiny else 4096
    if args.channels is None:
        args.channels = 32 if args.tiny else 128
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_decode: --device cuda but no CUDA GPU (use --device cpu --tiny for the smoke test)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and "foursight" in args.modes:
        print("[bench_decode] note: FourSight kernels run on CPU only with TRITON_INTERPRET=1", flush=True)
    res = run(args)
    _write(res, Path(args.out))
    print((Path(args.out) / "bench_decode.md").read_text())


if __name__ == "__main__":
    main()
