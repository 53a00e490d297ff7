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
The forms (fragment, GEMV, swap-AB, SS, dequantize-then-cuBLAS and the experimental Gluon tiles) are the
rows of one table, :mod:`.forms`: a configuration runs its row's launch, and the candidate lists (with the
experimental forms' switches, read once: :func:`configure`) are the table's. On CPU tensors the kernels
run under ``TRITON_INTERPRET=1`` (tests) with a fixed small configuration per datapath.
"""

from __future__ import annotations

import dataclasses

import torch

from foursight.nvfp4 import NVFP4Error

from . import fragment, gemv, ss, swap
from .activation import check_activation, quantize_activation
from .configs import (
    INTERP_CONFIGS,
    STREAM_CONFIGS,
    WS_CONFIGS,
    DequantConfig,
    FragmentConfig,
    GemvConfig,
    KernelConfig,
    SSConfig,
    StreamConfig,
    SwapConfig,
    WSConfig,
    interp_config,
)
from .dequant import dequant_linear
from .forms import (  # noqa: F401 - PDL_ERRORS, configure, linear_run, stream_candidates: the API's names (benchmarks, tests)
    PATHS,
    PDL_ERRORS,
    KernelForm,
    Operands,
    Switch,
    candidates,
    configure,
    form_of,
    gemm_run,
    gluon_launch,
    gluon_rule,
    linear_run,
    register,
    stream_candidates,
)
from .prepared import OP_HANDLES, PreparedWeight, linear_operands, prepare_weight, reference_output, resident_bytes  # noqa: F401
from .producers import (
    RMSNORM,
    SILU_MUL,
    ProducedInput,
    check_producer_input,
    producer_launch,
    reference_rms_norm,
    reference_silu_mul,
    same_channels,
)
from .runtime import interpreting
from .tuning import TUNE_LOG, TUNED, linear_key, m_bucket, pick_config

_EXP = "foursight.kernels.experimental."
#: The kernel forms (:mod:`.forms`): one row each; the experimental ones (with a switch) are consulted for the
#: candidate lists in this order.
FORMS: tuple[KernelForm, ...] = (
    KernelForm("fragment", FragmentConfig, PATHS, fragment.launch, bf16_only=True, reads_xs=True,
               w4a4=fragment.quant_in_linear, pdl=True, produced=True),
    KernelForm("dequant", DequantConfig, ("mid", "prefill"), None, linear=dequant_linear),
    KernelForm("gemv", GemvConfig, ("decode",), gemv.launch, max_m=1),
    KernelForm("swap", SwapConfig, ("decode", "mid"), swap.launch),
    KernelForm("ss", SSConfig, ("mid", "prefill"), ss.launch, reads_xs=True),
    KernelForm("gluon_stream", StreamConfig, ("decode",), gluon_launch("stream_launch"), bf16_only=True, reads_xs=True,
               switch=Switch("FOURSIGHT_STREAM", on=None), rule=gluon_rule("register-streaming"),
               module=_EXP + "gluon_stream", twin=_EXP + "gluon_ws_twin", tiles=lambda path, m: stream_candidates(m),
               only_tiles=lambda path: STREAM_CONFIGS, only_paths=("decode",)),
    KernelForm("gluon_ws", WSConfig, ("decode", "mid"), gluon_launch("ws_launch"), bf16_only=True, reads_xs=True,
               switch=Switch("FOURSIGHT_WS"), rule=gluon_rule("warp-specialized"), module=_EXP + "gluon_ws",
               twin=_EXP + "gluon_ws_twin", tiles=lambda path, m: WS_CONFIGS[path], only_tiles=lambda path: WS_CONFIGS[path]),
)
register(*FORMS)

#: M up to this uses the decode datapath; above it ``mid`` (<= 128) and ``prefill``. Set from the
#: H200 measurements (docs/kernels.md).
DECODE_MAX_M: int = 16

__all__ = [
    "DECODE_MAX_M", "TUNED", "TUNE_LOG", "PreparedWeight", "KernelConfig", "GemvConfig", "SwapConfig", "SSConfig",
    "DequantConfig", "FragmentConfig", "ProducedInput", "datapath_for", "prepare_weight", "quantize_activation", "resident_bytes",
    "rms_norm", "silu_mul", "splice_gemm", "splice_linear",
]


def datapath_for(m: int) -> str:
    """Datapath name for M rows: ``decode`` (M <= DECODE_MAX_M), ``mid`` (<= 128) or ``prefill``."""
    if m <= DECODE_MAX_M:
        return "decode"
    return "mid" if m <= 128 else "prefill"


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
    check_producer_input(x, "x")
    m, k_dim = x.shape
    if weight.shape != (k_dim,):
        raise NVFP4Error(f"weight: expected [{k_dim}], got shape {tuple(weight.shape)}")
    if residual is not None:
        check_producer_input(residual, "residual", x.shape)
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
    check_producer_input(gate_up, "gate_up")
    return _produce(SILU_MUL, gate_up, gate_up.shape[1] // 2, consumer, input_global_scale)[0]


def _produce(kind: int, x: torch.Tensor, k_dim: int, consumer, input_global_scale, weight=None, residual=None,
             eps: float = 1e-6) -> tuple:
    """The producers' one road: quantize for ``consumer`` in the producer's launch where :func:`_fuses` says so,
    else write the row; under torch.compile or off CUDA (without the interpreter) the PyTorch reference.
    Returns ``(ProducedInput, x + residual or None)``."""
    quant = _fuses(consumer, x.shape[0], x)
    if quant:
        check_consumer(consumer, k_dim)
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


def check_consumer(consumer: PreparedWeight, k_dim: int) -> None:
    if not isinstance(consumer, PreparedWeight):
        raise NVFP4Error(f"consumer: expected a PreparedWeight, got {type(consumer).__name__}")
    if consumer.in_features != k_dim:
        raise NVFP4Error(f"consumer: in_features {consumer.in_features} != the producer's width {k_dim}")


def _produced_linear(p: ProducedInput, prepared: PreparedWeight, bias, input_global_scale, act_quant: bool, path, config):
    """:func:`splice_linear` on a producer's quantized operands: the GEMM alone, autotuned among the fragment
    tiles (the forms that read ``q · s``, its global scales and the dense ``X[:, S]``)."""
    if not act_quant:
        raise NVFP4Error("x: a ProducedInput quantized for a consumer is W4A4 input; call the producer without "
                         "a consumer for W4A16 (act_quant=False)")
    if not same_channels(p.consumer, prepared):
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
    key = ("produced", path, m_bucket(path, m), prepared.out_features, prepared.in_features, prepared.num_channels > 0,
           p.static_gs, bias is not None)

    def run(cfg):
        form_of(cfg).launch(cfg, Operands(deq, gs, deq, xs, True), prepared, bias, out)

    cands, seen = [], set()
    for c in candidates(path, m, "linear", True):
        if form_of(c).produced and not c.quant_in:
            c = dataclasses.replace(c, q_split=1)  # the quantizer's split: nothing to split here
            if c not in seen:
                seen.add(c)
                cands.append(c)
    interp = interp_config(path, m)
    if not form_of(interp).produced:
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
    key = ("gemm", path, m_bucket(path, m), n, prepared.in_features, prepared.num_channels > 0, form, x.dtype,
           bias is not None, out.dtype)

    def run(cfg):
        gemm_run(cfg, x, prepared, qa, bias, out)

    bf16 = x.dtype == torch.bfloat16
    cands = [c for c in candidates(path, m, form, bf16) if form_of(c).launch is not None]  # on given operands
    reference = (lambda: reference_output(prepared, x, bias, None, False)) if qa is None else None
    interp = interp_config(path, m, bf16, form)
    if form_of(interp).launch is None:
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
    check_activation(x2, "input")
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
    cfg = config or pick_config(key, run, cands, interp_config(path, m, bf16), out, reference)
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
