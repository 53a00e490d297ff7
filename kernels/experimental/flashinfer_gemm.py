"""The FlashInfer backend's operands: a FourSight layer as FlashInfer's ``mm_nvfp4_svdquant`` takes it.

FlashInfer (>= 0.7, PR 3858 for sm_100/sm_103, PR 4420 for sm_120/sm_121) computes
``out = α · (A_fp4 · B_fp4ᵀ + D · L1ᵀ) (+ bias)``: a block-scaled NVFP4 GEMM with a rank-r BF16 term
added into the same accumulator, r a positive multiple of 32. SpliceGEMM is that with

* ``A`` = the activation's NVFP4 codes with the S columns zeroed (``[M, K/2]`` uint8, even column in
  the low nibble: compressed-tensors' order is FlashInfer's) and its E4M3 block scales;
* ``B`` = the checkpoint's ``weight_packed`` (S nibbles forced to 0) and ``weight_scale``, unchanged
  but for the scale layout;
* ``D`` = ``X[:, S]`` and ``L1`` = ``W[:, S] / α``, both padded from k to r = max(32, ⌈k/32⌉·32)
  columns with exact zeros (under tensor parallelism each rank pads its own local k);
* ``α = 1 / (gs_a · gs_w)``: one scalar, so the activation scale must be the static per-layer one
  (dynamic per-row scales are refused, naming ``--activation-scale static``). A fused layer whose
  shards kept their own weight scales (q/k/v, gate/up: ``weight_global_scale`` [N]) runs as one call
  per run of equal scales, into its own columns.

Block scales go in FlashInfer's 128x4 swizzled layout (:func:`swizzle_sf_128x4`: rows padded to 128,
scale columns to 4; byte ``(r, c)`` of tile ``(r // 128, c // 4)`` at ``(r % 32)·16 + (r % 128 // 32)·4
+ c % 4``, tiles row-block major).

Numerics: the FP4 part is the reference's up to fp32 accumulation order; the BF16 term carries one
extra bf16 rounding, that of ``W[:, S]·gs_a·gs_w`` (``L1``, made once per layer on the first call),
a relative 2^-9 per weight column of S; the output is bf16. The activation is quantized by
FourSight's own kernel (:mod:`.act_quant`, bit-exact with :func:`foursight.layer.quantize_activation`,
which also zeroes S and gathers ``X[:, S]`` in the same pass), not by FlashInfer's ``fp4_quantize``,
whose rounding is not the checkpoint's; its scale bytes are then swizzled.

Everything here but the call itself runs on any device (the tests run it on the CPU against an
independent emulation of FlashInfer's documented contract); ``flashinfer`` is imported only by
:func:`flashinfer_linear`. **Nothing of it has run on a Blackwell GPU.**
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foursight.layer import QuantizedWeight, quantize_activation
from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error

from .dot_scaled import NativeWeight, prepare_native_weight

#: FlashInfer's rank granularity for the BF16 term (``SVDQUANT_LORA_RANK_GRANULARITY``).
RANK_STEP: int = 32
#: ``mm_nvfp4_svdquant`` needs N and K divisible by this.
DIM_STEP: int = 32
SF_TILE_ROWS: int = 128
SF_TILE_COLS: int = 4
#: A fused layer with more runs of distinct weight scales than this is refused (one call per run).
MAX_SEGMENTS: int = 8
STATIC_HINT = ("re-quantize with `foursight quantize --activation-scale static` (FlashInfer's α is one scalar), "
               "or serve this checkpoint with FOURSIGHT_KERNEL_BACKEND=dot_scaled or triton")


def padded_rank(k: int) -> int:
    """The rank r FlashInfer gets for k BF16 channels: the next multiple of 32, at least 32."""
    return max(RANK_STEP, -(-k // RANK_STEP) * RANK_STEP)


def pad_columns(t: torch.Tensor, r: int) -> torch.Tensor:
    """``t`` [R, k] as a contiguous [R, r] tensor whose columns k..r-1 are exact zeros."""
    rows, k = t.shape
    if k > r:
        raise NVFP4Error(f"pad_columns: {k} columns do not fit in rank {r}")
    out = torch.zeros((rows, r), dtype=t.dtype, device=t.device)
    out[:, :k] = t
    return out


def swizzle_sf_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Block-scale bytes [R, C] (uint8 or float8_e4m3fn) -> flat uint8 in the 128x4 swizzled layout
    (``pad128(R) · pad4(C)`` bytes; the padding bytes are 0)."""
    if sf.dim() != 2:
        raise NVFP4Error(f"swizzle_sf_128x4: expected [rows, cols] scale bytes, got shape {tuple(sf.shape)}")
    rows, cols = sf.shape
    pr = -(-rows // SF_TILE_ROWS) * SF_TILE_ROWS
    pc = -(-cols // SF_TILE_COLS) * SF_TILE_COLS
    padded = torch.zeros((pr, pc), dtype=torch.uint8, device=sf.device)
    padded[:rows, :cols] = sf.view(torch.uint8)
    # rows r = 128·t + 32·hi + lo, cols c = 4·cb + ci  ->  [t][cb][lo][hi][ci]
    tiles = padded.reshape(pr // SF_TILE_ROWS, 4, 32, pc // SF_TILE_COLS, SF_TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1).contiguous()


def unswizzle_sf_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_sf_128x4`: flat uint8 -> [rows, cols]."""
    pr = -(-rows // SF_TILE_ROWS) * SF_TILE_ROWS
    pc = -(-cols // SF_TILE_COLS) * SF_TILE_COLS
    tiles = flat.view(torch.uint8).reshape(-1)[: pr * pc].reshape(pr // SF_TILE_ROWS, pc // SF_TILE_COLS, 32, 4, SF_TILE_COLS)
    return tiles.permute(0, 3, 2, 1, 4).reshape(pr, pc)[:rows, :cols].contiguous()


@dataclass
class FlashInferSegment:
    """Rows ``[start, stop)`` of a layer that share one weight global scale: one FlashInfer call."""

    start: int
    stop: int
    b: torch.Tensor  # uint8 [n, K/2]
    b_sf: torch.Tensor  # uint8, 128x4 swizzled [n, K/16]
    weight_global_scale: torch.Tensor  # float32 [1]
    w_s: torch.Tensor  # bf16 [n, r] = W[:, S] padded with zero columns


@dataclass
class FlashInferWeight:
    """A layer in FlashInfer's layout (:func:`prepare_flashinfer_weight`)."""

    name: str
    prepared: NativeWeight
    rank: int
    segments: list[FlashInferSegment]
    #: per segment (α, L1) once the static activation scale is known (first call; no host sync)
    _scaled: list | None = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return self.prepared.out_features

    @property
    def in_features(self) -> int:
        return self.prepared.in_features


def _segments(gs: torch.Tensor) -> list[tuple[int, int]]:
    """Runs ``[start, stop)`` of equal values in a per-row scale vector."""
    g = gs.detach().float().cpu()
    cuts = [0] + [i for i in range(1, g.numel()) if g[i] != g[i - 1]] + [g.numel()]
    return list(zip(cuts[:-1], cuts[1:]))


def prepare_flashinfer_weight(qw: QuantizedWeight, name: str = "layer") -> FlashInferWeight:
    """FlashInfer's execution form of ``qw`` (the checkpoint tensors are not modified)."""
    pw = prepare_native_weight(qw, name)
    k_dim = pw.in_features
    if k_dim % DIM_STEP:
        raise NVFP4Error(f"{name}: in_features {k_dim} is not a multiple of {DIM_STEP}, which FlashInfer's "
                         "mm_nvfp4_svdquant needs; use FOURSIGHT_KERNEL_BACKEND=dot_scaled or triton")
    runs = _segments(pw.weight_global_scale)
    if len(runs) > MAX_SEGMENTS:
        raise NVFP4Error(f"{name}.weight_global_scale: {len(runs)} runs of distinct per-row scales (at most "
                         f"{MAX_SEGMENTS}: one FlashInfer call each); FlashInfer's α is one scalar per call")
    r = padded_rank(pw.num_channels)
    segs = []
    for s, e in runs:
        if (e - s) % DIM_STEP:
            raise NVFP4Error(f"{name}: rows [{s}, {e}) share one weight scale but {e - s} is not a multiple of "
                             f"{DIM_STEP}, which FlashInfer's mm_nvfp4_svdquant needs")
        segs.append(FlashInferSegment(
            start=s, stop=e,
            b=pw.weight_packed[s:e].contiguous(),
            b_sf=swizzle_sf_128x4(pw.weight_scale[s:e]),
            weight_global_scale=pw.weight_global_scale[s:s + 1].clone(),
            w_s=pad_columns(pw.weight_bf16[s:e], r),
        ))
    return FlashInferWeight(name, pw, r, segs)


@dataclass
class FlashInferOperands:
    """One call's operands: the shared A, its scales and D, and per segment (α, L1)."""

    a: torch.Tensor  # uint8 [M, K/2]
    a_sf: torch.Tensor  # uint8, 128x4 swizzled [M, K/16]
    d: torch.Tensor  # bf16 [M, r]
    scaled: list  # per segment: (alpha float32 [1], l1 bf16 [n, r])


def flashinfer_operands(fw: FlashInferWeight, x2: torch.Tensor, input_global_scale: torch.Tensor | None,
                        act_quant: bool = True) -> FlashInferOperands:
    """The operands of ``mm_nvfp4_svdquant`` for ``x2`` [M, K] (any device: CUDA quantizes with the
    Triton kernel, CPU with the reference; both give the same bytes)."""
    if not act_quant:
        raise NVFP4Error(f"{fw.name}: the FlashInfer backend runs W4A4 only (mm_nvfp4_svdquant has no BF16-activation "
                         "mode); serve W4A16 checkpoints with FOURSIGHT_KERNEL_BACKEND=triton")
    if input_global_scale is None:
        raise NVFP4Error(f"{fw.name}: dynamic per-row activation scales cannot run on the FlashInfer backend; "
                         + STATIC_HINT)
    if x2.dtype != torch.bfloat16:
        raise NVFP4Error(f"{fw.name}: the FlashInfer backend takes bf16 activations (mm_nvfp4_svdquant writes bf16), "
                         f"got {x2.dtype}")
    pw = fw.prepared
    igs = input_global_scale.float().reshape(-1)[:1].to(x2.device)
    if x2.is_cuda:
        from .. import act_quant as _aq

        packed, scale, _, _, xs = _aq.act_quant_launch(x2, pw.channel_mask, pw.bf16_channels, igs, True, False, True)
    else:
        qa = quantize_activation(x2, pw.bf16_channels, igs)
        packed, scale, xs = qa.packed, qa.scale, qa.x_bf16
    if xs is None:
        xs = x2.new_empty((x2.shape[0], 0))
    if fw._scaled is None:
        fw._scaled = []
        for seg in fw.segments:
            prod = igs * seg.weight_global_scale.to(igs.device)  # gs_a · gs_w
            fw._scaled.append(((1.0 / prod).float().reshape(1), (seg.w_s.float() * prod).to(torch.bfloat16).contiguous()))
    return FlashInferOperands(a=packed, a_sf=swizzle_sf_128x4(scale.view(torch.uint8).reshape(-1, pw.in_features // BLOCK_SIZE)),
                              d=pad_columns(xs.to(torch.bfloat16), fw.rank), scaled=fw._scaled)


def flashinfer_linear(fw: FlashInferWeight, x: torch.Tensor, bias: torch.Tensor | None,
                      input_global_scale: torch.Tensor | None, act_quant: bool = True, mm=None) -> torch.Tensor:
    """The layer through ``flashinfer.gemm.mm_nvfp4_svdquant`` (or ``mm``, the same contract).
    ``x`` [..., K] bf16 -> [..., N] bf16."""
    k_dim = fw.in_features
    if x.shape[-1] != k_dim:
        raise NVFP4Error(f"{fw.name}: input last dim {x.shape[-1]} != in_features {k_dim}")
    if bias is not None and tuple(bias.shape) != (fw.out_features,):
        raise NVFP4Error(f"{fw.name}.bias: expected [{fw.out_features}], got {tuple(bias.shape)}")
    if mm is None:
        from flashinfer.gemm import mm_nvfp4_svdquant as mm
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_dim)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, fw.out_features))
    ops = flashinfer_operands(fw, x2.contiguous(), input_global_scale, act_quant)
    bias16 = bias.to(torch.bfloat16) if bias is not None else None
    outs = []
    for seg, (alpha, l1) in zip(fw.segments, ops.scaled):
        b = bias16[seg.start:seg.stop].contiguous() if bias16 is not None else None
        outs.append(mm(ops.a, seg.b, ops.a_sf, seg.b_sf, alpha, ops.d, l1, bias=b))
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return y.reshape(*lead, fw.out_features)


class FlashInferBackend:
    """The linear adapter of the experimental ``flashinfer`` backend (``foursight.dispatch.LinearBackend``;
    ``FOURSIGHT_KERNEL_BACKEND=flashinfer``): W4A4 with the static per-layer activation scale, bf16; dynamic
    per-row scales are refused at the first call with a message naming ``--activation-scale static``."""

    name = "flashinfer"

    def supports(self, qw: QuantizedWeight) -> bool:
        return qw.weight_packed.is_cuda

    def prepare(self, qw: QuantizedWeight, name: str, channels_checked: bool = False) -> FlashInferWeight:
        return prepare_flashinfer_weight(qw, name)

    def forward(self, state, x, bias, input_global_scale, act_quant):
        return flashinfer_linear(state, x, bias, input_global_scale, act_quant)


#: what ``foursight.kernels.backends.load_backend("flashinfer")`` returns
BACKEND = FlashInferBackend()
