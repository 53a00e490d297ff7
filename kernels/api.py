"""Python entry points of the FourSight Triton kernels, and the dispatcher between kernel forms.

* :func:`prepare_weight` — the CUDA execution form (:class:`PreparedWeight`) of a
  :class:`foursight.layer.QuantizedWeight`.
* :func:`quantize_activation` — fused NVFP4 activation quantization, bit-exact with
  :func:`foursight.layer.quantize_activation`.
* :func:`splice_gemm` — the GEMM on an already-quantized activation (lower level).
* :func:`splice_linear` — activation quantization + SpliceGEMM; ``act_quant=False`` is W4A16.
* :func:`rms_norm`, :func:`silu_mul` — a linear's producer with the activation quantizer fused into it
  (:mod:`.producers`); :func:`splice_linear` takes their :class:`ProducedInput` for ``x``.

The datapath is chosen by M (:func:`datapath_for`): ``decode`` (M <= :data:`DECODE_MAX_M`),
``mid`` (<= 128) or ``prefill``; within a datapath the autotuner (:mod:`.tuning`) picks a kernel
form and tile among the named configurations of :mod:`.configs`, once per layer shape and M bucket.
Forms: the fragment tile (:mod:`.fragment`), the one-row GEMV (:mod:`.gemv`), the swap-AB tile (:mod:`.swap`), the SS tile
(:mod:`.ss`), dequantize-then-cuBLAS (:mod:`.dequant`). On CPU tensors the kernels run under
``TRITON_INTERPRET=1`` (tests) with a fixed small configuration per datapath.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton

from foursight.layer import QuantizedActivation, QuantizedWeight, channel_mask, check_channels
from foursight.nvfp4 import NVFP4Error, check_k

from . import act_quant as _aq
from .backends import form_module
from .configs import (
    DECODE_CONFIGS,
    FP16_CONFIGS,
    INTERP_CONFIGS,
    MID_CONFIGS,
    PREFILL_CONFIGS,
    DequantConfig,
    FragmentConfig,
    GemvConfig,
    KernelConfig,
    SSConfig,
    STREAM_CONFIGS,
    StreamConfig,
    SwapConfig,
    WS_CONFIGS,
    WSConfig,
)
from .dequant import dequant_linear
from .fragment import QUANT_IN_MAX_M, fragment_launch
from .gemv import gemv_launch
from .producers import RMSNORM, SILU_MUL, ProducedInput, producer_launch, reference_rms_norm, reference_silu_mul
from .prepared import OP_HANDLES, PreparedWeight, linear_operands, prepare_weight, resident_bytes
from .runtime import interpreting, pdl_supported
from .ss import ss_launch
from .swap import swap_launch
from .tuning import TUNE_LOG, TUNED, pick_config

#: M up to this uses the decode datapath; above it ``mid`` (<= 128) and ``prefill``. Set from the
#: H200 measurements (docs/kernels.md).
DECODE_MAX_M: int = 16

__all__ = [
    "DECODE_MAX_M", "TUNED", "TUNE_LOG", "PreparedWeight", "KernelConfig", "GemvConfig", "SwapConfig", "SSConfig",
    "DequantConfig", "FragmentConfig", "ProducedInput", "datapath_for", "prepare_weight", "quantize_activation", "resident_bytes",
    "rms_norm", "silu_mul", "splice_gemm", "splice_linear",
]


#: Why programmatic dependent launch was turned off in this process (a failed PDL build), if it was;
#: the benchmarks record it. Empty: PDL is used wherever :func:`~.runtime.pdl_supported` says so.
PDL_ERRORS: list = []


def datapath_for(m: int) -> str:
    """Datapath name for M rows: ``decode`` (M <= DECODE_MAX_M), ``mid`` (<= 128) or ``prefill``."""
    if m <= DECODE_MAX_M:
        return "decode"
    return "mid" if m <= 128 else "prefill"


# --------------------------------------------------------------------------------------------
# activation quantization
# --------------------------------------------------------------------------------------------


def _check_act(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise NVFP4Error(f"{name}: expected [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise NVFP4Error(f"{name}: unsupported dtype {x.dtype} (bf16, fp16 or fp32)")
    check_k(x.shape[1], name)


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
    _check_act(x, name)
    m, k_dim = x.shape
    ch = check_channels(channels, k_dim, f"{name}.channels").to(x.device)
    mask = channel_mask(ch, k_dim)
    packed, scale, _, gs, xs = _aq.act_quant_launch(x, mask, ch, global_scale, True, False, True)
    if xs is None:
        xs = torch.empty((m, 0), dtype=x.dtype, device=x.device)
    return QuantizedActivation(packed=packed, scale=scale.view(torch.float8_e4m3fn), global_scale=gs, x_bf16=xs)


# --------------------------------------------------------------------------------------------
# dispatch between kernel forms
# --------------------------------------------------------------------------------------------


def candidates(path: str, m: int, form: str, bf16: bool = True) -> list:
    """Configurations the autotuner may time for ``path``. ``form``: "deq" (splice_gemm on the fp16
    q*s), "w4a16" (splice_gemm or splice_linear without activation quantization) or "linear"
    (splice_linear W4A4: the quantization is part of what is timed). BF16 activations take the
    lists of :mod:`.configs` (fragment and dequant forms, which read the one resident weight form);
    fp16 activations and the fp16 ``q*s`` of splice_gemm take :data:`~.configs.FP16_CONFIGS`."""
    if form == "deq" or not bf16:
        return [c for c in FP16_CONFIGS[path] if not (isinstance(c, GemvConfig) and m != 1)]
    cands = {"decode": DECODE_CONFIGS, "mid": MID_CONFIGS, "prefill": PREFILL_CONFIGS}[path]
    # the register-streaming Gluon form (issue 36 item 3), measured slower than the fragment tiles: opt-in
    # (FOURSIGHT_STREAM=1 adds its tiles after the others, =only makes every STREAM_CONFIGS tile the only
    # decode candidates), where Gluon runs on sm_90
    stream = os.environ.get("FOURSIGHT_STREAM", "0")
    if stream != "0" and path == "decode":
        if form_module("gluon_stream").available():
            if stream == "only":
                return list(STREAM_CONFIGS)
            return [*cands, *stream_candidates(m)]
        if stream == "only":
            return []
    ws = os.environ.get("FOURSIGHT_WS", "0")  # the experimental warp-specialized Gluon form: 0 (default), 1, only
    if ws in ("1", "only"):
        gluon_ws = form_module("gluon_ws")  # experimental: imported by name only when asked for

        if ws == "only":
            return list(WS_CONFIGS[path]) if gluon_ws.available() else []
        if path in ("decode", "mid") and gluon_ws.available():
            return [*cands, *WS_CONFIGS[path]]
    return list(cands)


def stream_candidates(m: int) -> list:
    """The register-streaming tiles the autotuner times at M = ``m`` (decode) with ``FOURSIGHT_STREAM=1``:
    those whose token tile is the smallest that holds M (8 or 16 rows)."""
    bm = 8 if m <= 8 else 16
    return [c for c in STREAM_CONFIGS if c.block_m == bm]


def _interp_config(path: str, m: int, bf16: bool = True, form: str = "linear") -> KernelConfig:
    if form == "deq" or not bf16:
        return INTERP_CONFIGS["fp16:gemv"] if m == 1 else INTERP_CONFIGS[f"fp16:{path}"]
    cfg = INTERP_CONFIGS[path]
    return cfg


def _gemm_dispatch(cfg: KernelConfig, x, pw: PreparedWeight, qa, bias, out, xs=None):
    """Run the GEMM of ``cfg``'s form. ``qa`` None (W4A16: A = X) or ``(deq fp16 q*s, gs [M])``."""
    if qa is None:
        a, a_gs, a_quant, dot_bf16 = x, None, False, x.dtype == torch.bfloat16
    else:
        (a, a_gs), a_quant, dot_bf16 = qa, True, False
    if isinstance(cfg, (WSConfig, StreamConfig)):
        return _ws_run(cfg, a, a_gs, x, pw, bias, out, a_quant)
    if isinstance(cfg, FragmentConfig):
        if x.dtype != torch.bfloat16 or a.dtype != torch.bfloat16:
            raise NVFP4Error(f"foursight.kernels: the fragment form takes bf16 activations, got {x.dtype}")
        return fragment_launch(cfg, a.contiguous(), a_gs, x.contiguous(), pw, bias, out, a_quant)
    if isinstance(cfg, SwapConfig):
        return swap_launch(cfg, a, a_gs, x, pw, bias, out, a_quant, dot_bf16)
    if isinstance(cfg, SSConfig):
        return ss_launch(cfg, a, a_gs, x, xs, pw, bias, out, a_quant, dot_bf16)
    if isinstance(cfg, GemvConfig):
        return gemv_launch(cfg, x, a if a_quant else None, a_gs, pw, bias, out)
    if isinstance(cfg, DequantConfig):
        raise ValueError("foursight.kernels: the dequant form quantizes the activation itself; use splice_linear")
    raise ValueError(f"foursight.kernels: unknown configuration {cfg!r}")


def _ws_run(cfg, a, a_gs, x, pw: PreparedWeight, bias, out, a_quant: bool, xs=None):
    """The experimental Gluon forms, warp-specialized (:class:`WSConfig`) or register-streaming
    (:class:`StreamConfig`); under the interpreter their plain-Triton twin."""
    if x.dtype != torch.bfloat16 or a.dtype != torch.bfloat16:
        raise NVFP4Error(f"foursight.kernels: the {cfg.form} form takes bf16 activations, got {x.dtype}")
    interp = interpreting()
    form = form_module(cfg.form, interpreted=interp)
    launch = form.ws_twin_launch if interp else getattr(form, {"gluon_ws": "ws_launch", "gluon_stream": "stream_launch"}[cfg.form])
    return launch(cfg, a.contiguous(), a_gs, x.contiguous(), pw, bias, out, a_quant, xs=xs)


def linear_run(cfg: KernelConfig, x2, pw: PreparedWeight, bias, input_global_scale, act_quant: bool, out):
    """One W4A4/W4A16 linear with configuration ``cfg``: activation quantization (if W4A4) + GEMM."""
    if isinstance(cfg, DequantConfig):
        return dequant_linear(cfg, x2, pw, bias, input_global_scale, act_quant, out)
    if not act_quant:
        return _gemm_dispatch(cfg, x2, pw, None, bias, out)
    frag = isinstance(cfg, (FragmentConfig, WSConfig, StreamConfig))
    if frag and x2.dtype != torch.bfloat16:
        raise NVFP4Error(f"foursight.kernels: the {cfg.form} form takes bf16 activations, got {x2.dtype}")
    fragment = isinstance(cfg, FragmentConfig)
    m = x2.shape[0]
    if fragment and cfg.quant_in and input_global_scale is not None and m <= QUANT_IN_MAX_M:
        # no quantizer launch: every GEMM program quantizes the activation slice it reads
        gs = _aq.static_global_scale(input_global_scale, x2.device)
        xc = x2.contiguous()
        return fragment_launch(cfg, xc, gs, xc, pw, bias, out, True, quant_in=True)
    # X[:, S]: the wgmma forms read it contiguous from the quantizer (its ``write_xs`` copy). For the fragment
    # tiles this measured cheaper than gathering it by channel index in the GEMM, before or after the FP4
    # loop (H100, 8192², M = 16 / 64: the columns +2.1 / +2.0 µs dense against +3.8 / +9.9 µs gathered,
    # the copy +0.4 / +0.1 µs in the quantizer; benchmarks/results/h100-2026-12-06b-v4/columns.json)
    want_xs = isinstance(cfg, (SSConfig, WSConfig, StreamConfig, FragmentConfig)) and pw.num_channels > 0
    pdl = fragment and x2.is_cuda and not PDL_ERRORS and pdl_supported()
    if pdl or fragment:
        x2 = x2.contiguous()  # before the quantizer: nothing may run between it and a PDL-launched GEMM
    deq_dtype = torch.bfloat16 if frag else torch.float16
    _, _, deq, gs, xs = _aq.act_quant_launch(x2, pw.channel_mask, pw.bf16_channels, input_global_scale, False, True, want_xs,
                                             deq_dtype=deq_dtype, launch_deps=pdl,
                                             cols=cfg.q_split if isinstance(cfg, (FragmentConfig, StreamConfig)) else 1)
    if isinstance(cfg, (WSConfig, StreamConfig)):
        return _ws_run(cfg, deq, gs, x2, pw, bias, out, True, xs=xs)
    if fragment:
        if pdl:
            try:
                return fragment_launch(cfg, deq, gs, x2, pw, bias, out, True, pdl=True, xs=xs)
            except Exception as e:  # noqa: BLE001 - a Triton whose PDL build fails: run without it from now on
                PDL_ERRORS.append(f"{type(e).__name__}: {str(e)[:300]}")
        return fragment_launch(cfg, deq, gs, x2, pw, bias, out, True, xs=xs)
    return _gemm_dispatch(cfg, x2, pw, (deq, gs), bias, out, xs=xs)


def reference_output(pw: PreparedWeight, x, bias, input_global_scale, act_quant: bool) -> torch.Tensor:
    """fp32 output of :func:`foursight.layer.reference_linear` for the layer ``pw`` was prepared from."""
    from foursight.layer import reference_linear

    packed, scale = pw.packed_form(keep=False)  # a temporary: the layer keeps only the fragment form
    qw = QuantizedWeight(packed, scale.view(torch.float8_e4m3fn), pw.weight_global_scale, pw.bf16_channels, pw.weight_bf16)
    return reference_linear(x, qw, bias=bias, input_global_scale=input_global_scale, act_quant=act_quant,
                            out_dtype=torch.float32)


def _m_bucket(path: str, m: int) -> int:
    if path == "decode":
        return m if m <= 4 else 16
    return min(triton.next_power_of_2(m), 4096)


def linear_key(path: str, m: int, prepared: PreparedWeight, act_quant: bool, static_gs: bool, dtype, has_bias: bool) -> tuple:
    """The autotuner's cache key of a :func:`splice_linear` call (benchmarks read ``TUNED[key]``)."""
    return ("linear", path, _m_bucket(path, m), prepared.out_features, prepared.in_features, prepared.num_channels > 0,
            "linear" if act_quant else "w4a16", static_gs, dtype, has_bias)


# --------------------------------------------------------------------------------------------
# producers with the quantizer fused (issue 36 item 2)
# --------------------------------------------------------------------------------------------


def _fuses(consumer, m: int, x: torch.Tensor) -> bool:
    """Whether a producer quantizes for ``consumer`` in its own launch: CUDA or the interpreter, outside
    torch.compile's trace, and a datapath whose tiles read the quantizer's operands (decode and mid; at
    prefill the autotuner also times forms that quantize for themselves, so the producer writes the row)."""
    return (consumer is not None and not torch.compiler.is_compiling() and datapath_for(m) != "prefill"
            and (x.is_cuda or interpreting()))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    consumer: PreparedWeight | None = None,
    input_global_scale: torch.Tensor | None = None,
) -> tuple:
    """RMSNorm of ``x + residual`` in one launch; with ``consumer`` also the NVFP4 activation of that linear.

    Args:
        x: [M, K] bf16 (unit stride along K).
        weight: [K] bf16 RMSNorm weight.
        residual: optional [M, K] bf16 added before the norm (engines' fused add-norm).
        consumer: the prepared linear that reads the output; its BF16 channels and ``input_global_scale``
            (None: dynamic per row) decide the quantization.
    Returns:
        ``(ProducedInput, x + residual)`` (the sum None without ``residual``). Pass the first to
        :func:`splice_linear` of ``consumer`` (or of a layer with the same channel set); its quantized operands
        are bit-identical to :func:`quantize_activation` of its bf16 row.
    """
    _check_producer_in(x, "x")
    m, k_dim = x.shape
    if weight.shape != (k_dim,):
        raise NVFP4Error(f"weight: expected [{k_dim}], got shape {tuple(weight.shape)}")
    if residual is not None:
        _check_producer_in(residual, "residual", x.shape)
    return _produce(RMSNORM, x, k_dim, consumer, input_global_scale, weight=weight, residual=residual, eps=eps)


def silu_mul(
    gate_up: torch.Tensor,
    consumer: PreparedWeight | None = None,
    input_global_scale: torch.Tensor | None = None,
) -> ProducedInput:
    """``silu(g) · u`` of ``gate_up = [g | u]`` [M, 2K] in one launch; with ``consumer`` (the down
    projection) also its NVFP4 activation (see :func:`rms_norm`)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise NVFP4Error(f"gate_up: expected [M, 2K], got shape {tuple(gate_up.shape)}")
    _check_producer_in(gate_up, "gate_up")
    return _produce(SILU_MUL, gate_up, gate_up.shape[1] // 2, consumer, input_global_scale)[0]


def _produce(kind: int, x: torch.Tensor, k_dim: int, consumer, input_global_scale, weight=None, residual=None,
             eps: float = 1e-6) -> tuple:
    """The producers' one road: quantize for ``consumer`` in the producer's launch where :func:`_fuses` says so,
    else write the row; under torch.compile or off CUDA (without the interpreter) the PyTorch reference.
    Returns ``(ProducedInput, x + residual or None)``."""
    quant = _fuses(consumer, x.shape[0], x)
    if quant:
        _check_consumer(consumer, k_dim)
    if torch.compiler.is_compiling() or not (x.is_cuda or interpreting()):
        if kind == RMSNORM:
            y, s = reference_rms_norm(x, weight, eps, residual)
            return ProducedInput(y), s
        return ProducedInput(reference_silu_mul(x)), None
    y, s, deq, gs, xs = producer_launch(kind, x, k_dim, weight=weight, residual=residual, eps=eps,
                                        mask=consumer.channel_mask if quant else None,
                                        channels=consumer.bf16_channels if quant else None,
                                        global_scale=input_global_scale, quant=quant, write_y=not quant)
    return ProducedInput(y, deq, gs, xs, consumer if quant else None, input_global_scale is not None), s


def _check_producer_in(t: torch.Tensor, name: str, shape: tuple | None = None) -> None:
    if t.dim() != 2 or (shape is not None and tuple(t.shape) != tuple(shape)):
        raise NVFP4Error(f"{name}: expected {list(shape) if shape else '[M, K]'}, got shape {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise NVFP4Error(f"{name}: the fused producers take bf16, got {t.dtype}")
    if t.shape[1] and t.stride(1) != 1:
        raise NVFP4Error(f"{name}: needs unit stride along its last dimension, got strides {tuple(t.stride())}")


def _check_consumer(consumer: PreparedWeight, k_dim: int) -> None:
    if not isinstance(consumer, PreparedWeight):
        raise NVFP4Error(f"consumer: expected a PreparedWeight, got {type(consumer).__name__}")
    if consumer.in_features != k_dim:
        raise NVFP4Error(f"consumer: in_features {consumer.in_features} != the producer's width {k_dim}")


def _same_channels(a: PreparedWeight, b: PreparedWeight) -> bool:
    """Whether an activation quantized for ``a`` is the one ``b`` reads (the same BF16 channel set)."""
    if a is b or a.bf16_channels is b.bf16_channels:
        return True
    if a.in_features != b.in_features or a.num_channels != b.num_channels:
        return False
    if _capturing():
        return False  # comparing the index tensors would synchronize inside a CUDA-graph capture
    return bool(torch.equal(a.bf16_channels, b.bf16_channels))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _produced_linear(p: ProducedInput, prepared: PreparedWeight, bias, input_global_scale, act_quant: bool, path, config):
    """:func:`splice_linear` on a producer's quantized operands: the GEMM alone, autotuned among the fragment
    tiles (the forms that read ``q · s``, its global scales and the dense ``X[:, S]``)."""
    if not act_quant:
        raise NVFP4Error("x: a ProducedInput quantized for a consumer is W4A4 input; call the producer without "
                         "a consumer for W4A16 (act_quant=False)")
    if not _same_channels(p.consumer, prepared):
        raise NVFP4Error("x: the ProducedInput was quantized for a layer with another BF16 channel set "
                         f"({p.consumer.num_channels} channels of {p.consumer.in_features}) than this one "
                         f"({prepared.num_channels} of {prepared.in_features})")
    if (input_global_scale is not None) != p.static_gs:
        raise NVFP4Error("input_global_scale: the producer quantized with "
                         f"{'a static' if p.static_gs else 'the dynamic'} scale; pass the same to splice_linear")
    if bias is not None and bias.shape != (prepared.out_features,):
        raise NVFP4Error(f"layer.bias: expected [{prepared.out_features}], got {tuple(bias.shape)}")
    deq, gs = p.deq, p.gs
    m = deq.shape[0]
    out = torch.empty((m, prepared.out_features), dtype=torch.bfloat16, device=deq.device)
    if m == 0:
        return out
    path = path or datapath_for(m)
    xs = p.xs if prepared.num_channels > 0 else None
    key = ("produced", path, _m_bucket(path, m), prepared.out_features, prepared.in_features, prepared.num_channels > 0,
           p.static_gs, bias is not None)

    def run(cfg):
        fragment_launch(cfg, deq, gs, deq, prepared, bias, out, True, xs=xs)

    cands, seen = [], set()
    for c in candidates(path, m, "linear", True):
        if isinstance(c, FragmentConfig) and not c.quant_in:
            c = dataclasses.replace(c, q_split=1)  # the quantizer's split: nothing to split here
            if c not in seen:
                seen.add(c)
                cands.append(c)
    interp = _interp_config(path, m)
    if not isinstance(interp, FragmentConfig):
        interp = next(iter(cands))
    reference = (lambda: reference_output(prepared, p.y, bias, input_global_scale, True)) if p.y is not None else None
    cfg = config or pick_config(key, run, cands, interp, out, reference)
    run(cfg)
    return out


# --------------------------------------------------------------------------------------------
# GEMM entry points
# --------------------------------------------------------------------------------------------


def splice_gemm(
    x: torch.Tensor,
    prepared: PreparedWeight,
    qa: tuple | None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """SpliceGEMM on prepared operands.

    Args:
        x: [M, K] bf16/fp16 activations (the BF16 segment gathers ``x[:, S]`` from it; in W4A16
            mode it is also the A operand).
        prepared: :class:`PreparedWeight`.
        qa: None for W4A16, else ``(deq, gs)``: the dequantized activation without its global scale
            (fp16 [M, K] = q*s, as the activation-quantization kernel writes it) and the per-row
            global scales (fp32 [M]).
        bias: optional [N].
        out_dtype: default x.dtype.
        path: force ``decode`` / ``mid`` / ``prefill`` (benchmarks); default by M.
        config: force a configuration (:mod:`foursight.kernels.configs`; tests, benchmarks);
            default: autotuned on CUDA, a fixed small tile in the interpreter.
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
        if len(qa) != 2 or qa[0].dtype != torch.float16:
            raise NVFP4Error("qa: expected (deq fp16 [M, K] = q*s, global_scale fp32 [M])")
        form = "deq"
    key = ("gemm", path, _m_bucket(path, m), n, prepared.in_features, prepared.num_channels > 0, form, x.dtype,
           bias is not None, out.dtype)

    def run(cfg):
        _gemm_dispatch(cfg, x, prepared, qa, bias, out)

    bf16 = x.dtype == torch.bfloat16
    cands = [c for c in candidates(path, m, form, bf16) if not isinstance(c, DequantConfig)]
    reference = (lambda: reference_output(prepared, x, bias, None, False)) if qa is None else None
    interp = _interp_config(path, m, bf16, form)
    if isinstance(interp, DequantConfig):
        interp = INTERP_CONFIGS["mid"]
    cfg = config or pick_config(key, run, cands, interp, out, reference)
    run(cfg)
    return out


def splice_linear(
    x: torch.Tensor,
    prepared: PreparedWeight,
    bias: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    act_quant: bool = True,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """FourSight linear: fused activation quantization + SpliceGEMM.

    Args:
        x: [..., K] bf16 or fp16 (fp32 is accepted in W4A4 mode only), or a :class:`ProducedInput` of
            :func:`rms_norm` / :func:`silu_mul` (quantized for this layer's channel set: then only the GEMM runs).
        prepared: from :func:`prepare_weight`.
        bias: optional [N].
        input_global_scale: static activation global scale (float32 scalar/[1]) or None (dynamic,
            per row).
        act_quant: True = W4A4; False = W4A16 (activations stay in x's dtype).
        path: force a datapath (benchmarks/tests); default: by M (:func:`datapath_for`).
        config: force a configuration (see :func:`splice_gemm`).
    Returns:
        [..., N] in x's dtype; equals :func:`foursight.layer.reference_linear` up to fp32
        accumulation order (the dequantize-then-cuBLAS form: up to the bf16 rounding of its
        operands, see :mod:`foursight.kernels.dequant`).
    """
    if isinstance(x, ProducedInput):
        if x.consumer is not None:
            return _produced_linear(x, prepared, bias, input_global_scale, act_quant, path, config)
        if x.y is None:
            raise NVFP4Error("x: a ProducedInput with neither a row nor a consumer's operands")
        x = x.y
    if torch.compiler.is_compiling() and not COMPILE_OP_ERRORS:
        # under torch.compile (vLLM compiles the model with fullgraph=True) the call is one opaque
        # custom op: the autotuner, the launches and their Python control flow stay out of the trace
        return torch.ops.foursight.splice_linear(x, prepared.op_handle, bias, input_global_scale, act_quant)
    lead, x2, out = linear_operands(x, prepared, bias, "layer")
    _check_act(x2, "input")
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, prepared.out_features)
    if not act_quant and x2.dtype not in (torch.bfloat16, torch.float16):
        raise NVFP4Error(f"input: W4A16 mode needs bf16 or fp16 activations, got {x2.dtype}")
    path = path or datapath_for(m)
    key = linear_key(path, m, prepared, act_quant, input_global_scale is not None, x2.dtype, bias is not None)

    def run(cfg):
        linear_run(cfg, x2, prepared, bias, input_global_scale, act_quant, out)

    def reference():
        return reference_output(prepared, x2, bias, input_global_scale, act_quant)

    bf16 = x2.dtype == torch.bfloat16
    cands = candidates(path, m, "linear" if act_quant else "w4a16", bf16)
    cfg = config or pick_config(key, run, cands, _interp_config(path, m, bf16), out, reference)
    run(cfg)
    return out.reshape(*lead, prepared.out_features)


# --------------------------------------------------------------------------------------------
# torch.compile: the linear as one custom op
# --------------------------------------------------------------------------------------------

def _splice_linear_op(x, handle, bias, input_global_scale, act_quant):
    return splice_linear(x, OP_HANDLES[handle], bias=bias, input_global_scale=input_global_scale, act_quant=act_quant)


def _splice_linear_fake(x, handle, bias, input_global_scale, act_quant):
    return x.new_empty((*x.shape[:-1], OP_HANDLES[handle].out_features))


#: why ``foursight::splice_linear`` could not be registered (then torch.compile traces into
#: :func:`splice_linear` itself, with graph breaks); empty when it is registered
COMPILE_OP_ERRORS: list = []
try:  # the schema is written out: nothing depends on this torch's annotation inference
    _op = torch.library.custom_op("foursight::splice_linear", _splice_linear_op, mutates_args=(),
                                  schema="(Tensor x, int handle, Tensor? bias, Tensor? input_global_scale, bool act_quant) -> Tensor")
    _op.register_fake(_splice_linear_fake)
except Exception as e:  # noqa: BLE001 - an older torch: the kernels work without the op
    COMPILE_OP_ERRORS.append(f"{type(e).__name__}: {e}")
