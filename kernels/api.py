"""Python entry points of the FourSight Triton kernels.

* :func:`prepare_weight` — the CUDA execution form (:class:`PreparedWeight`) of a
  :class:`foursight.layer.QuantizedWeight`.
* :func:`quantize_activation` — fused NVFP4 activation quantization, bit-exact with
  :func:`foursight.layer.quantize_activation`.
* :func:`splice_gemm` — the GEMM on already-quantized operands (lower level).
* :func:`splice_linear` — activation quantization + SpliceGEMM, dispatching the decode or the
  prefill datapath by M; ``act_quant=False`` is the W4A16 mode.

The kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests). On CUDA
the tile configuration is chosen by a small in-process autotuner (median time of each candidate,
cached per datapath / shape / mode); under the interpreter a fixed small configuration is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton

from foursight.layer import QuantizedActivation, QuantizedWeight, check_channels
from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error, check_k

from .act_quant import MAX_ONEPASS_K, _act_quant_kernel
from .splice_gemm import _split_reduce_kernel, _splice_gemm_kernel, _splice_gemm_ss_kernel, _splice_gemv1_kernel, _splice_gemv_kernel

#: M up to this uses the decode datapath (BLOCK_M = 16, narrow N tiles, FP4 activations
#: decoded in registers); above it the prefill datapath. Set from the H200 measurements in
#: benchmarks/results/splice_gemm.md (see docs/kernels.md).
DECODE_MAX_M: int = 16

#: Decode datapath: feed the GEMM the packed FP4 activation (decoded in registers by every program)
#: instead of the exact fp16 ``q*s`` written by the quantization kernel. Off: on the H200 the FP4-A
#: variant cost more ALU time than the extra activation bytes (benchmarks/kernel_notes.md).
DECODE_FP4_A: bool = False


#: Match PyTorch-on-CUDA's ``tensor / 6.0`` (multiplication by fp32(1/6)) in the block scales, so
#: that the kernel is bit-exact with foursight.layer run on the same CUDA device.
DIV6_RECIP_ON_CUDA: bool = True


def _interpreting() -> bool:
    """True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return isinstance(_splice_gemm_kernel, InterpretedFunction)


# --------------------------------------------------------------------------------------------
# prepared weight
# --------------------------------------------------------------------------------------------


@dataclass
class PreparedWeight:
    """CUDA execution form of one compensated linear layer.

    Attributes:
        weight_packed: uint8 [N, K/2] contiguous; the nibbles of the S columns are forced to 0
            (so the W4A16 mode can feed X with its S columns unzeroed).
        weight_scale: uint8 [N, K/16] contiguous, the E4M3 bytes of the block scales.
        weight_global_scale: float32 [N] (the [1] per-tensor scale broadcast, or the per-row one).
        bf16_channels: int32 [k] sorted.
        channel_mask: uint8 [K], 1 at the S columns.
        weight_bf16: bfloat16 [N, k] contiguous.
        out_features, in_features: N, K.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    bf16_channels: torch.Tensor
    channel_mask: torch.Tensor
    weight_bf16: torch.Tensor
    out_features: int
    in_features: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_channels(self) -> int:
        return int(self.bf16_channels.numel())


def _zero_channel_nibbles(packed: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Copy of packed [N, K/2] with the 4-bit codes of ``channels`` set to 0."""
    out = packed.clone()
    if channels.numel():
        ch = channels.long()
        even = ch[ch % 2 == 0] // 2
        odd = ch[ch % 2 == 1] // 2
        if even.numel():
            out[:, even] &= 0xF0
        if odd.numel():
            out[:, odd] &= 0x0F
    return out


def prepare_weight(qw: QuantizedWeight, name: str = "layer") -> PreparedWeight:
    """Build the execution form of ``qw`` (idempotent; ``qw`` is not modified).

    Raises :class:`NVFP4Error` naming the tensor when a shape or dtype is wrong.
    """
    wp, ws, wgs, ch, wb = qw.tensors()
    if wp.dtype != torch.uint8 or wp.dim() != 2:
        raise NVFP4Error(f"{name}.weight_packed: expected uint8 [N, K/2], got {wp.dtype} {tuple(wp.shape)}")
    n, kh = wp.shape
    k_dim = kh * 2
    check_k(k_dim, f"{name}.weight_packed")
    if ws.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(ws.shape) != (n, k_dim // BLOCK_SIZE):
        raise NVFP4Error(f"{name}.weight_scale: expected float8_e4m3fn [{n}, {k_dim // BLOCK_SIZE}], got {ws.dtype} {tuple(ws.shape)}")
    g = wgs.float().reshape(-1)
    if g.numel() not in (1, n):
        raise NVFP4Error(f"{name}.weight_global_scale: expected [1] or [{n}], got {tuple(wgs.shape)}")
    ch32 = check_channels(ch, k_dim, f"{name}.bf16_channels").to(wp.device)
    kk = ch32.numel()
    if tuple(wb.shape) != (n, kk):
        raise NVFP4Error(f"{name}.weight_bf16: expected [{n}, {kk}], got {tuple(wb.shape)}")
    mask = torch.zeros(k_dim, dtype=torch.uint8, device=wp.device)
    if kk:
        mask[ch32.long()] = 1
    return PreparedWeight(
        weight_packed=_zero_channel_nibbles(wp.contiguous(), ch32),
        weight_scale=ws.contiguous().view(torch.uint8).clone(),
        weight_global_scale=g.expand(n).contiguous().clone() if g.numel() == 1 else g.contiguous().clone(),
        bf16_channels=ch32.contiguous(),
        channel_mask=mask,
        weight_bf16=wb.to(torch.bfloat16).contiguous(),
        out_features=n,
        in_features=k_dim,
    )


# --------------------------------------------------------------------------------------------
# activation quantization
# --------------------------------------------------------------------------------------------


def _static_global_scale(global_scale: torch.Tensor, device) -> torch.Tensor:
    """The static activation global scale as a float32 [1] tensor on ``device`` (scalar or [1] accepted)."""
    gs = global_scale.reshape(-1).to(device=device, dtype=torch.float32)
    if gs.numel() != 1:
        raise NVFP4Error(f"input_global_scale: expected a scalar or [1], got shape {tuple(global_scale.shape)}")
    return gs


def _act_quant_launch(
    x: torch.Tensor,
    mask: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None,
    write_packed: bool,
    write_deq: bool,
    write_xs: bool,
):
    m, k_dim = x.shape
    kk = channels.numel()
    dev = x.device
    packed = torch.empty((m, k_dim // 2), dtype=torch.uint8, device=dev) if write_packed else None
    scale = torch.empty((m, k_dim // BLOCK_SIZE), dtype=torch.uint8, device=dev) if write_packed else None
    deq = torch.empty((m, k_dim), dtype=torch.float16, device=dev) if write_deq else None
    gs_out = torch.empty((m,), dtype=torch.float32, device=dev)
    xs = torch.empty((m, kk), dtype=x.dtype, device=dev) if write_xs else None
    gs_in = _static_global_scale(global_scale, dev) if global_scale is not None else gs_out
    one_pass = k_dim <= MAX_ONEPASS_K
    block_k = triton.next_power_of_2(k_dim) if one_pass else 4096
    nw = 4 if block_k <= 2048 else (8 if block_k <= 8192 else 16)
    if _interpreting():
        nw = 4
    dummy = gs_out
    if m:
        _act_quant_kernel[(m,)](
            x, x.stride(0), x.stride(1),
            mask, channels if kk else mask, gs_in,
            packed if write_packed else dummy, scale if write_packed else dummy,
            deq if write_deq else dummy, gs_out, xs if write_xs else dummy,
            k_dim, kk,
            BLOCK_K=block_k, ONE_PASS=one_pass, HAS_CH=kk > 0, STATIC_GS=global_scale is not None,
            WRITE_PACKED=write_packed, WRITE_DEQ=write_deq, WRITE_XS=write_xs and kk > 0,
            BLOCK_KS=_block_ks(kk, 256),
            DIV6_RECIP=DIV6_RECIP_ON_CUDA if x.is_cuda else False,
            num_warps=nw,
        )
    return packed, scale, deq, gs_out, xs


def _check_act(x: torch.Tensor, k_dim: int | None, name: str) -> None:
    if x.dim() != 2:
        raise NVFP4Error(f"{name}: expected [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NVFP4Error(f"{name}: unsupported dtype {x.dtype} (bf16, fp16 or fp32)")
    check_k(x.shape[1], name)
    if k_dim is not None and x.shape[1] != k_dim:
        raise NVFP4Error(f"{name}: last dim {x.shape[1]} != layer in_features {k_dim}")


def quantize_activation(
    x: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    name: str = "input",
) -> QuantizedActivation:
    """Triton twin of :func:`foursight.layer.quantize_activation` (bit-exact).

    Args:
        x: [M, K] bf16/fp16/fp32, any strides; finite (not checked here, to avoid a host sync).
        channels: int [k] sorted unique indices of the BF16 channels S.
        global_scale: optional static float32 scalar/[1]; None = dynamic ``448*6/rowamax``.
    Returns:
        QuantizedActivation(packed uint8 [M, K/2], scale float8_e4m3fn [M, K/16],
        global_scale float32 [M], x_bf16 [M, k] in x's dtype).
    """
    _check_act(x, None, name)
    m, k_dim = x.shape
    ch = check_channels(channels, k_dim, f"{name}.channels").to(x.device)
    mask = torch.zeros(k_dim, dtype=torch.uint8, device=x.device)
    if ch.numel():
        mask[ch.long()] = 1
    packed, scale, _, gs, xs = _act_quant_launch(x, mask, ch, global_scale, True, False, True)
    if xs is None:
        xs = torch.empty((m, 0), dtype=x.dtype, device=x.device)
    return QuantizedActivation(packed=packed, scale=scale.view(torch.float8_e4m3fn), global_scale=gs, x_bf16=xs)


# --------------------------------------------------------------------------------------------
# GEMM configuration
# --------------------------------------------------------------------------------------------

# A configuration is a tuple whose first element names the kernel:
#   ("gemv", FUSE, BLOCK_N, BLOCK_K, num_warps, num_stages): _splice_gemv_kernel, M <= GEMV_MAX_M;
#       FUSE = quantize the activation inside the GEMV (W4A4 with M = 1 only; otherwise ignored);
#   ("swap", BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): _splice_gemm_kernel
#       (Yᵀ tile, decoded weight as the register MMA operand); SPLIT_K = 0 means "automatic":
#       split K until the grid has ~4 programs per SM;
#   ("ss", BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): _splice_gemm_ss_kernel (Y tile,
#       both MMA operands in shared memory).
# A tuple without a leading name is a "swap" configuration (the form of earlier versions).

#: The GEMV form serves M up to this many rows (one fp32 FMA per weight and row).
GEMV_MAX_M: int = 4

# ("gemv", FUSE, BN, BK, warps, stages[, ASM]): ASM decodes the nibbles with inline PTX (GPU only).
# M = 1 runs _splice_gemv1_kernel (weight read as 32-bit words); M = 2..GEMV_MAX_M the general
# GEMV kernel, which only takes the small-tile entries (BK <= 256).
DECODE_CONFIGS = [
    ("gemv", False, 8, 1024, 4, 1, True),
    ("gemv", False, 16, 1024, 8, 1, True),
    ("gemv", False, 8, 2048, 8, 1, True),
    ("gemv", False, 16, 512, 4, 1, True),
    ("gemv", False, 4, 2048, 4, 1, True),
    ("gemv", False, 8, 1024, 4, 1),
    ("gemv", True, 8, 1024, 4, 1, True),
    ("gemv", False, 8, 256, 4, 1),
    ("swap", 16, 64, 256, 4, 3, 0),
    ("swap", 16, 32, 256, 4, 3, 0),
    ("swap", 16, 64, 512, 4, 3, 0),
    ("ss", 16, 32, 256, 4, 3, True),
]
MID_CONFIGS = [
    ("swap", 64, 128, 128, 8, 3, 0),
    ("swap", 32, 64, 256, 4, 3, 0),
    ("swap", 64, 64, 128, 4, 4, 0),
    ("ss", 64, 64, 128, 4, 4),
]
# ("ss", BM, BN, BK, warps, stages[, PREFETCH]): PREFETCH loads the next packed weight tile into
# registers before the current decode + MMA
PREFILL_CONFIGS = [
    ("ss", 256, 128, 64, 8, 3, True),
    ("ss", 256, 64, 64, 8, 4, True),
    ("ss", 256, 128, 128, 8, 2, True),
    ("ss", 128, 128, 64, 4, 4),
    ("ss", 128, 64, 64, 4, 4, True),
    ("ss", 64, 128, 64, 4, 4, True),
    ("swap", 128, 128, 64, 8, 3, 0),
]
_INTERP_CONFIGS = {
    "gemv": ("gemv", True, 16, 64, 4, 1),
    "decode": ("swap", 16, 16, 64, 4, 1, 0),
    "mid": ("swap", 32, 32, 32, 4, 1, 1),
    "prefill": ("ss", 32, 32, 32, 4, 1, True),
}

_SM_COUNT: dict = {}


def _programs_target(device: torch.device) -> int:
    """About 4 programs per SM (8 under the interpreter, so that CPU tests exercise split-K)."""
    if _interpreting() or device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return 4 * _SM_COUNT[idx]


def _split_plan(m: int, n: int, k_dim: int, bm: int, bn: int, bk: int, split: int, device) -> tuple[int, int]:
    """(number of K splits, K/16-groups per split). ``split`` 0 = automatic, 1 = no split."""
    kg, g = k_dim // BLOCK_SIZE, bk // BLOCK_SIZE
    steps = triton.cdiv(kg, g)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split == 0:
        target = _programs_target(device)
        split = 1 if 2 * tiles >= target else min(triton.cdiv(target, tiles), steps)
        split = max(1, min(split, (256 * 2**20) // max(1, 4 * m * n)))  # workspace <= 256 MB
    split = max(1, min(split, steps))
    gps = triton.cdiv(steps, split) * g
    return triton.cdiv(kg, gps), gps


#: chosen configuration per key, filled by the autotuner (benchmark writes it out)
TUNED: dict = {}
#: every candidate's median time (ms) per key, as the autotuner measured it (L2 flushed by do_bench)
TUNE_LOG: dict = {}


def datapath_for(m: int) -> str:
    """Datapath name for M rows: ``decode`` (M <= DECODE_MAX_M), ``mid`` (<= 128) or ``prefill``."""
    if m <= DECODE_MAX_M:
        return "decode"
    return "mid" if m <= 128 else "prefill"


def _kind(cfg: tuple) -> str:
    return cfg[0] if isinstance(cfg[0], str) else "swap"


def _swap_cfg(cfg: tuple) -> tuple:
    return tuple(cfg[1:]) if isinstance(cfg[0], str) else tuple(cfg)


def _weight_args(pw: PreparedWeight, bias, packed: torch.Tensor | None = None) -> tuple:
    """The weight-side arguments every SpliceGEMM kernel takes, in their order: channels, packed codes
    (``packed``: another view of them, e.g. int32 words) and stride, scale bytes and stride, weight
    global scales, W_bf16 and stride, bias. Absent tensors are replaced by a never-read dummy."""
    kk = pw.num_channels
    dummy = pw.weight_global_scale
    wp = pw.weight_packed if packed is None else packed
    return (
        pw.bf16_channels if kk else pw.channel_mask,
        wp, wp.stride(0),
        pw.weight_scale, pw.weight_scale.stride(0),
        pw.weight_global_scale,
        pw.weight_bf16 if kk else dummy, pw.weight_bf16.stride(0) if kk else 0,
        bias if bias is not None else dummy,
    )


def _block_ks(kk: int, cap: int) -> int:
    """Width of one BF16-segment step: the next power of two of k, between 16 and ``cap``."""
    return min(cap, max(16, triton.next_power_of_2(max(kk, 1))))


def _gemm_launch(cfg, a, a_s, a_gs, x, pw: PreparedWeight, bias, out, m, a_quant, a_fp4, dot_bf16):
    """Launch the swap-AB kernel (+ the split-K reduction). ``cfg`` = (BM, BN, BK, warps, stages[, split])."""
    bm, bn, bk, nw, ns = cfg[:5]
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    splits, gps = _split_plan(m, n, k_dim, bm, bn, bk, cfg[5] if len(cfg) > 5 else 0, out.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)
    dummy = pw.weight_global_scale
    target = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else out
    compiled = _splice_gemm_kernel[grid](
        a, a.stride(0), a.stride(1) if a.dim() == 2 else 1,
        a_s if a_s is not None else dummy, a_s.stride(0) if a_s is not None else 0,
        a_gs if a_gs is not None else dummy,
        x, x.stride(0), x.stride(1),
        *_weight_args(pw, bias),
        target, out.stride(0), out.stride(1),
        m, n, k_dim, kk, gps,
        A_QUANT=a_quant, A_FP4=a_fp4, DOT_BF16=dot_bf16, HAS_BIAS=bias is not None, HAS_KS=kk > 0, SPLIT=splits > 1,
        EVEN_K=(k_dim % bk == 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_KS=_block_ks(kk, 64),
        GROUP_M=8,
        INTERP=_interpreting(),
        num_warps=nw, num_stages=ns,
    )
    if splits > 1:
        blk = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, blk),)](
            target, bias if bias is not None else dummy, out, out.stride(0), out.stride(1), m, n, splits,
            HAS_BIAS=bias is not None, BLOCK=blk, INTERP=_interpreting(), num_warps=4,
        )
    return compiled


def _ss_launch(cfg, a, a_gs, x, xs, pw: PreparedWeight, bias, out, m, a_quant, dot_bf16):
    """Launch the SS kernel. ``cfg`` = ("ss", BM, BN, BK, warps, stages); ``xs`` = contiguous X[:, S] or None
    (then the BF16 segment gathers the S columns from ``x``)."""
    _, bm, bn, bk, nw, ns = cfg[:6]
    prefetch = bool(cfg[6]) if len(cfg) > 6 else False
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    dummy = pw.weight_global_scale
    src = xs if (xs is not None and kk) else x
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return _splice_gemm_ss_kernel[grid](
        a, a.stride(0), a.stride(1),
        a_gs if a_gs is not None else dummy,
        src, src.stride(0), src.stride(1),
        *_weight_args(pw, bias),
        out, out.stride(0), out.stride(1),
        m, n, k_dim, kk,
        A_QUANT=a_quant, DOT_BF16=dot_bf16, XS_DENSE=xs is not None, HAS_BIAS=bias is not None, HAS_KS=kk > 0,
        EVEN_K=(k_dim % bk == 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        BLOCK_KS=_block_ks(kk, 64),
        GROUP_M=8,
        PREFETCH=prefetch,
        INTERP=_interpreting(),
        num_warps=nw, num_stages=ns,
    )


def _gemv_launch(cfg, a_mode, x, a, a_gs, pw: PreparedWeight, bias, out, m, global_scale=None):
    """Launch the GEMV kernel. ``cfg`` = ("gemv", FUSE, BN, BK, warps, stages); ``a_mode`` 0 (W4A16),
    1 (``a`` = fp16 q*s, ``a_gs`` [M]) or 2 (quantize X here; M must be 1)."""
    _, _fuse, bn, bk, nw, ns = cfg[:6]
    n, k_dim = pw.out_features, pw.in_features
    kk = pw.num_channels
    if m > GEMV_MAX_M:
        raise ValueError(f"foursight.kernels: the GEMV form serves M <= {GEMV_MAX_M}, got M = {m}")
    dummy = pw.weight_global_scale
    gs_in = None
    if a_mode == 2:
        if m != 1:
            raise ValueError("foursight.kernels: the fused GEMV quantizes one row (M = 1)")
        if global_scale is not None:
            gs_in = _static_global_scale(global_scale, x.device)
    grid = (triton.cdiv(n, bn),)
    if m == 1:
        words = pw._cache.get("words")
        if words is None:
            words = pw._cache["words"] = pw.weight_packed.view(torch.int32)
        return _splice_gemv1_kernel[grid](
            x, x.stride(1),
            a if a is not None else dummy,
            a_gs if a_gs is not None else dummy,
            pw.channel_mask, gs_in if gs_in is not None else dummy,
            *_weight_args(pw, bias, packed=words),
            out, out.stride(1),
            n, k_dim, kk,
            A_MODE=a_mode, STATIC_GS=gs_in is not None,
            DIV6_RECIP=DIV6_RECIP_ON_CUDA if x.is_cuda else False,
            HAS_BIAS=bias is not None, HAS_KS=kk > 0,
            BN=bn, BK=bk,
            BLOCK_KS=_block_ks(kk, 256),
            USE_ASM=(len(cfg) > 6 and bool(cfg[6]) and not _interpreting()),
            INTERP=_interpreting(),
            num_warps=nw, num_stages=ns,
        )
    return _splice_gemv_kernel[grid](
        x, x.stride(0), x.stride(1),
        a if a is not None else dummy, a.stride(0) if a is not None else 0,
        a_gs if a_gs is not None else dummy,
        *_weight_args(pw, bias),
        out, out.stride(0), out.stride(1),
        m, n, k_dim, kk,
        A_MODE=a_mode,
        HAS_BIAS=bias is not None, HAS_KS=kk > 0, EVEN_K=(k_dim % bk == 0),
        BM=max(1, triton.next_power_of_2(m)), BN=bn, BK=bk,
        BLOCK_KS=_block_ks(kk, 64),
        INTERP=_interpreting(),
        num_warps=nw, num_stages=ns,
    )


def _candidates(path: str, m: int, qa_form: str) -> list:
    """Configurations the autotuner may time for ``path``. ``qa_form``: "fp4" (packed activation),
    "deq" (fp16 q*s), "w4a16" or "linear" (splice_linear W4A4: quantization is part of the run)."""
    cands = {"decode": DECODE_CONFIGS, "mid": MID_CONFIGS, "prefill": PREFILL_CONFIGS}[path]
    out = []
    for c in cands:
        kind = _kind(c)
        if qa_form == "fp4" and kind != "swap":
            continue
        if kind == "gemv" and (m > GEMV_MAX_M or (c[1] and not (qa_form == "linear" and m == 1)) or (m > 1 and c[3] > 256)):
            continue
        out.append(c)
    return out or [("swap",) + _swap_cfg(cands[-1])]


def _interp_config(path: str, m: int, qa_form: str) -> tuple:
    if path == "decode" and m <= GEMV_MAX_M and qa_form != "fp4":
        return _INTERP_CONFIGS["gemv"]
    if path == "prefill" and qa_form == "fp4":
        return ("swap", 32, 32, 32, 4, 1, 0)
    return _INTERP_CONFIGS[path]


_FLUSH: dict = {}


def _time_gpu(fn, reps: int = 8, rounds: int = 5) -> float:
    """GPU milliseconds of one ``fn()`` with a cold L2, free of Python launch overhead.

    ``fn`` is run once eagerly (compilation), then captured in a CUDA graph as ``reps`` pairs
    (256 MB L2-flushing memset, fn); a second graph holds the memsets alone. The median over
    ``rounds`` replays of (pairs - memsets) / reps is returned. Eager event timing (``do_bench``)
    measured the launch overhead of the small decode kernels instead of their GPU time.
    """
    fn()
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    buf = _FLUSH[dev]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g_run, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
        with torch.cuda.graph(g_run, stream=stream):
            for _ in range(reps):
                buf.zero_()
                fn()
        with torch.cuda.graph(g_flush, stream=stream):
            for _ in range(reps):
                buf.zero_()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        g_run.replay()
        ev[1].record()
        g_flush.replay()
        ev[2].record()
        torch.cuda.synchronize()
        times.append((ev[0].elapsed_time(ev[1]) - ev[1].elapsed_time(ev[2])) / reps)
    times.sort()
    return max(times[len(times) // 2], 1e-6)


def _pick_config(path: str, key: tuple, run, cands: list, interp_cfg: tuple) -> tuple:
    """Return the cached best config for ``key``; on first use time each candidate (CUDA only)."""
    if _interpreting() or not torch.cuda.is_available():
        return interp_cfg
    if key in TUNED:
        return TUNED[key]
    if os.environ.get("FOURSIGHT_KERNELS_AUTOTUNE", "1") == "0" or torch.cuda.is_current_stream_capturing():
        # no timing runs inside a CUDA-graph capture (an engine capturing a batch size it never ran
        # eagerly): take the first candidate, and keep it so eager and graph calls agree
        TUNED[key] = cands[0]
        return cands[0]
    best, best_t = None, float("inf")
    log = TUNE_LOG.setdefault(key, [])
    for cfg in cands:
        try:
            t = _time_gpu(lambda: run(cfg))
        except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
            log.append((cfg, None, f"{type(e).__name__}: {str(e)[:200]}"))
            if os.environ.get("FOURSIGHT_KERNELS_DEBUG"):
                print(f"[foursight.kernels] config {cfg} failed for {key}: {type(e).__name__}: {e}")
            continue
        log.append((cfg, t, None))
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"foursight.kernels: no tile configuration compiled for {key}")
    TUNED[key] = best
    return best


# --------------------------------------------------------------------------------------------
# GEMM entry points
# --------------------------------------------------------------------------------------------


def _gemm_dispatch(cfg, x, pw: PreparedWeight, qa, bias, out, xs=None):
    """Run the GEMM of ``cfg``'s kind on prepared operands (see :func:`splice_gemm` for ``qa``)."""
    m = x.shape[0]
    kind = _kind(cfg)
    if qa is None:
        a, a_s, a_gs, a_quant, a_fp4 = x, None, None, False, False
        dot_bf16 = x.dtype == torch.bfloat16
    else:
        a, a_s, a_gs = qa
        a_quant, a_fp4, dot_bf16 = True, a.dtype == torch.uint8, False
    if kind == "swap":
        return _gemm_launch(_swap_cfg(cfg), a, a_s, a_gs, x, pw, bias, out, m, a_quant, a_fp4, dot_bf16)
    if a_fp4:
        raise ValueError(f"foursight.kernels: the packed FP4 activation form needs a 'swap' configuration, got {cfg}")
    if kind == "ss":
        return _ss_launch(cfg, a, a_gs, x, xs, pw, bias, out, m, a_quant, dot_bf16)
    if kind == "gemv":
        return _gemv_launch(cfg, 1 if a_quant else 0, x, a if a_quant else None, a_gs, pw, bias, out, m)
    raise ValueError(f"foursight.kernels: unknown configuration kind in {cfg}")


def splice_gemm(
    x: torch.Tensor,
    prepared: PreparedWeight,
    qa: tuple | None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    path: str | None = None,
    config: tuple | None = None,
) -> torch.Tensor:
    """SpliceGEMM on prepared operands.

    Args:
        x: [M, K] bf16/fp16 activations (the BF16 segment gathers ``x[:, S]`` from it; in W4A16
            mode it is also the A operand).
        prepared: :class:`PreparedWeight`.
        qa: None for W4A16, else ``(a, a_scale, a_gs)``: either the packed activation (uint8
            [M, K/2], uint8 [M, K/16], fp32 [M]) or the dequantized one (fp16 [M, K] = q*s, None,
            fp32 [M]).
        bias: optional [N].
        out_dtype: default x.dtype.
        path: force ``decode`` / ``mid`` / ``prefill`` (benchmarks); default by M.
        config: force a configuration (see the comment above ``DECODE_CONFIGS``; tests,
            benchmarks); default: autotuned on CUDA, a fixed small tile in the interpreter.
    Returns:
        [M, N] of ``out_dtype``.
    """
    m = x.shape[0]
    n = prepared.out_features
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    path = path or datapath_for(m)
    if qa is None:
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise NVFP4Error(f"input: W4A16 mode needs bf16 or fp16 activations, got {x.dtype}")
        form = "w4a16"
    else:
        form = "fp4" if qa[0].dtype == torch.uint8 else "deq"
    key = ("gemm", path, _m_bucket(path, m), n, prepared.in_features, prepared.num_channels > 0, form, x.dtype,
           bias is not None, out.dtype)

    def run(cfg):
        _gemm_dispatch(cfg, x, prepared, qa, bias, out)

    cfg = config or _pick_config(path, key, run, _candidates(path, m, form), _interp_config(path, m, form))
    run(cfg)
    return out


def _m_bucket(path: str, m: int) -> int:
    if path == "decode":
        return m if m <= GEMV_MAX_M else 16
    return min(triton.next_power_of_2(m), 4096)


def linear_key(path: str, m: int, prepared: PreparedWeight, act_quant: bool, static_gs: bool, dtype, has_bias: bool) -> tuple:
    """The autotuner's cache key of a :func:`splice_linear` call (benchmarks read ``TUNED[key]``)."""
    return ("linear", path, _m_bucket(path, m), prepared.out_features, prepared.in_features, prepared.num_channels > 0,
            "linear" if act_quant else "w4a16", static_gs, dtype, has_bias)


def _linear_run(cfg, x2, pw: PreparedWeight, bias, input_global_scale, act_quant, out):
    """One W4A4/W4A16 linear with configuration ``cfg``: quantization (unless fused) + GEMM."""
    m = x2.shape[0]
    kind = _kind(cfg)
    if not act_quant:
        return _gemm_dispatch(cfg, x2, pw, None, bias, out)
    if kind == "gemv" and cfg[1] and m == 1:
        return _gemv_launch(cfg, 2, x2, None, None, pw, bias, out, m, global_scale=input_global_scale)
    fp4_a = DECODE_FP4_A and kind == "swap" and datapath_for(m) == "decode"
    want_xs = kind == "ss" and pw.num_channels > 0
    packed, scale, deq, gs, xs = _act_quant_launch(
        x2, pw.channel_mask, pw.bf16_channels, input_global_scale, fp4_a, not fp4_a, want_xs
    )
    qa = (packed, scale, gs) if fp4_a else (deq, None, gs)
    return _gemm_dispatch(cfg, x2, pw, qa, bias, out, xs=xs)


def splice_linear(
    x: torch.Tensor,
    prepared: PreparedWeight,
    bias: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    act_quant: bool = True,
    path: str | None = None,
    config: tuple | None = None,
) -> torch.Tensor:
    """FourSight linear: fused activation quantization + SpliceGEMM.

    Args:
        x: [..., K] bf16 or fp16 (fp32 is accepted in W4A4 mode only).
        prepared: from :func:`prepare_weight`.
        bias: optional [N].
        input_global_scale: static activation global scale (float32 scalar/[1]) or None (dynamic,
            per row).
        act_quant: True = W4A4; False = W4A16 (activations stay in x's dtype).
        path: force a datapath (benchmarks/tests); default: decode if M <= DECODE_MAX_M.
        config: force a tile configuration (see :func:`splice_gemm`).
    Returns:
        [..., N] in x's dtype; equals :func:`foursight.layer.reference_linear` up to fp32
        accumulation order.
    """
    k_dim = prepared.in_features
    if x.shape[-1] != k_dim:
        raise NVFP4Error(f"input: last dim {x.shape[-1]} != layer in_features {k_dim}")
    if bias is not None and tuple(bias.shape) != (prepared.out_features,):
        raise NVFP4Error(f"bias: expected [{prepared.out_features}], got {tuple(bias.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_dim)
    _check_act(x2, k_dim, "input")
    m = x2.shape[0]
    out = torch.empty((m, prepared.out_features), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, prepared.out_features)
    if not act_quant and x2.dtype not in (torch.bfloat16, torch.float16):
        raise NVFP4Error(f"input: W4A16 mode needs bf16 or fp16 activations, got {x2.dtype}")
    path = path or datapath_for(m)
    form = "linear" if act_quant else "w4a16"
    key = linear_key(path, m, prepared, act_quant, input_global_scale is not None, x2.dtype, bias is not None)

    def run(cfg):
        _linear_run(cfg, x2, prepared, bias, input_global_scale, act_quant, out)

    cfg = config or _pick_config(path, key, run, _candidates(path, m, form), _interp_config(path, m, form))
    run(cfg)
    return out.reshape(*lead, prepared.out_features)
