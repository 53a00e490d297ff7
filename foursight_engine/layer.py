"""The FourSight compensated linear layer: quantization of its parts and the PyTorch reference (the oracle).

A compensated layer with weight ``W`` [N, K] and BF16 channel set ``S`` (k sorted indices) holds

* the NVFP4 encoding of ``W`` with the columns in ``S`` zeroed (so the FP4 part is plain NVFP4),
* ``weight_bf16 = W[:, S]`` in BF16,

and computes ``Y = deq(Q(X with S zeroed)) · deq(Wq)ᵀ + X[:, S] · W[:, S]ᵀ (+ bias)``.

:func:`reference_linear` is the oracle for every kernel and engine adapter. Which code runs a
layer (this reference or the Triton kernels) is chosen once per layer by :mod:`foursight.dispatch`;
this module depends on :mod:`foursight.nvfp4` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

import torch

from foursight.nvfp4 import (
    NVFP4Error,
    block_amax,
    check_k,
    dequantize_nvfp4,
    global_scale_from_amax,
    quantize_nvfp4,
)


class PackedLayerShape:
    """``out_features``, ``in_features`` and ``num_channels`` of a layer form that holds
    ``weight_packed`` (uint8 [N, K/2]) and ``bf16_channels`` ([k]): :class:`QuantizedWeight` and the
    kernels' native form (:class:`foursight.kernels.experimental.dot_scaled.NativeWeight`)."""

    @property
    def out_features(self) -> int:
        return self.weight_packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight_packed.shape[1] * 2

    @property
    def num_channels(self) -> int:
        return int(self.bf16_channels.numel())


@dataclass
class QuantizedWeight(PackedLayerShape):
    """The tensors of one compensated linear layer (one checkpoint module).

    Attributes:
        weight_packed: uint8 [N, K/2], NVFP4 codes of ``W`` with the ``S`` columns zeroed.
        weight_scale: float8_e4m3fn [N, K/16].
        weight_global_scale: float32 [1] (per tensor) or [N] (one per output row, e.g. after
            fusing shards that each had their own per-tensor scale).
        bf16_channels: int32 [k], sorted, unique, in [0, K).
        weight_bf16: bfloat16 [N, k] = ``W[:, S]``.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor
    bf16_channels: torch.Tensor
    weight_bf16: torch.Tensor

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight_packed, self.weight_scale, self.weight_global_scale, self.bf16_channels, self.weight_bf16)


def check_channels(channels: torch.Tensor, k_dim: int, name: str = "layer") -> torch.Tensor:
    """Validate a channel set and return it as sorted int32 [k].

    Raises :class:`NVFP4Error` if indices are out of range, repeated, or ``k >= K``.
    """
    ch = torch.as_tensor(channels).flatten().to(torch.int64)
    if ch.numel() >= k_dim:
        raise NVFP4Error(f"{name}: {ch.numel()} BF16 channels requested but K={k_dim}; k must be < K")
    if ch.numel():
        if int(ch.min()) < 0 or int(ch.max()) >= k_dim:
            raise NVFP4Error(f"{name}: bf16_channels out of range [0, {k_dim}): min={int(ch.min())} max={int(ch.max())}")
        if torch.unique(ch).numel() != ch.numel():
            raise NVFP4Error(f"{name}: bf16_channels has repeated indices")
    return torch.sort(ch).values.to(torch.int32)


def channel_mask(channels: torch.Tensor, k_dim: int) -> torch.Tensor:
    """uint8 [K] on ``channels``' device: 1 at the columns in ``channels`` (checked by
    :func:`check_channels`), 0 elsewhere (the kernels' column mask of S)."""
    mask = torch.zeros(k_dim, dtype=torch.uint8, device=channels.device)
    if channels.numel():
        mask[channels.long()] = 1
    return mask


def zero_columns(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``x`` [..., K] with the columns in ``channels`` [k] set to zero."""
    out = x.clone()
    if channels.numel():
        out[..., channels.long()] = 0
    return out


def quantize_weight(
    weight: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    name: str = "weight",
    channels_checked: bool = False,
) -> QuantizedWeight:
    """Quantize a linear weight into a FourSight layer.

    Args:
        weight: [N, K] float (bf16 usually), finite, K a multiple of 16.
        channels: int [k] indices of the input channels kept in BF16 (k < K; 0 gives plain NVFP4).
        global_scale: optional float32 [1]; by default ``448*6/amax`` of the weight with the
            ``S`` columns zeroed.
        name: layer name for error messages.
        channels_checked: ``channels`` is a layer's own set, already validated by :func:`check_channels`
            (sorted int32, in range): skip that check, whose three reads to the host cost a GPU sync
            each on every re-quantization of a weight sync.
    Returns:
        A :class:`QuantizedWeight` with ``weight_global_scale`` of shape [1].
    """
    if weight.dim() != 2:
        raise NVFP4Error(f"{name}: expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    n, k_dim = weight.shape
    check_k(k_dim, name)
    ch = (channels.to(device=weight.device, dtype=torch.int32) if channels_checked else check_channels(channels, k_dim, name).to(weight.device))
    idx = ch.long()
    w_bf16 = weight[:, idx].to(torch.bfloat16).contiguous()
    # one float32 copy with the S columns zeroed, shared by the amax and the quantizer (the
    # weight sync's hot path: no separate finiteness pass, no second copy)
    w0 = weight.float() if weight.dtype != torch.float32 else weight.clone()
    if idx.numel():
        w0.index_fill_(1, idx, 0.0)
    gs = global_scale_from_amax(block_amax(w0.reshape(-1))).reshape(1) if global_scale is None else global_scale.float().reshape(1)
    # the S columns' finiteness rides on quantize_nvfp4's one read (its block amax checks the others)
    packed, scale = quantize_nvfp4(w0, gs.to(weight.device), name, also_finite=w_bf16 if idx.numel() else None)
    return QuantizedWeight(
        weight_packed=packed,
        weight_scale=scale,
        weight_global_scale=gs.to(weight.device),
        bf16_channels=ch,
        weight_bf16=w_bf16,
    )


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32, include_bf16: bool = True,
                      dequantize: Callable[..., torch.Tensor] = dequantize_nvfp4) -> torch.Tensor:
    """Dense [N, K] weight of a FourSight layer: dequantized FP4 part, plus the BF16 columns if asked.
    ``dequantize``: the FP4 dequantizer (``foursight.nvfp4_cpu.dequantize_nvfp4``, the native CPU pass, where the
    dispatcher builds the CPU execution form; bit-identical to the default)."""
    w = dequantize(qw.weight_packed, qw.weight_scale, _row_gs(qw.weight_global_scale, qw.out_features), torch.float32)
    if include_bf16 and qw.num_channels:
        w[:, qw.bf16_channels.long()] = qw.weight_bf16.float()
    return w.to(dtype)


def _row_gs(gs: torch.Tensor, rows: int) -> torch.Tensor:
    """Broadcast a global scale of shape [], [1] or [rows] to float32 [rows, 1]."""
    gs = gs.float().reshape(-1)
    if gs.numel() == 1:
        return gs.expand(rows).reshape(rows, 1)
    if gs.numel() != rows:
        raise NVFP4Error(f"global scale has {gs.numel()} entries, expected 1 or {rows}")
    return gs.reshape(rows, 1)


@dataclass
class QuantizedActivation:
    """Activation operand of SpliceGEMM.

    Attributes:
        packed: uint8 [M, K/2] codes of X with the S columns zeroed.
        scale: float8_e4m3fn [M, K/16].
        global_scale: float32 [M] (one per row; all equal when a static scale was given).
        x_bf16: [M, k] = X[:, S] in the input dtype.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    x_bf16: torch.Tensor


def quantize_activation(
    x: torch.Tensor,
    channels: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    name: str = "input",
) -> QuantizedActivation:
    """Quantize activations X [M, K] for SpliceGEMM.

    The S columns are zeroed before any amax is taken. The global scale is the given static
    (calibrated) float32 scalar, or, when ``global_scale`` is None, computed per row as
    ``448*6/rowamax`` (dynamic, batch-invariant: a row's codes do not depend on other rows).

    Args:
        x: [M, K] bf16/fp16/fp32.
        channels: int32 [k] sorted indices.
        global_scale: optional float32 scalar/[1].
    Returns:
        :class:`QuantizedActivation`.
    """
    if x.dim() != 2:
        raise NVFP4Error(f"{name}: expected [M, K], got shape {tuple(x.shape)}")
    m, k_dim = x.shape
    check_k(k_dim, name)
    ch = channels.to(x.device).long()
    x0 = zero_columns(x, ch)
    if global_scale is None:
        gs = global_scale_from_amax(x0.float().abs().amax(dim=1, keepdim=True))  # [M, 1]
    else:
        gs = global_scale.float().reshape(1, 1).to(x.device).expand(m, 1)
    packed, scale = quantize_nvfp4(x0, gs, name)
    return QuantizedActivation(packed=packed, scale=scale, global_scale=gs.reshape(m).contiguous(), x_bf16=x[:, ch].contiguous())


def reference_linear(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
    act_quant: bool = True,
    out_dtype: torch.dtype | None = None,
    w_deq: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch reference of the compensated layer (the oracle for kernels and engines).

    Args:
        x: [..., K] activations (bf16/fp16/fp32).
        qw: the layer's tensors.
        bias: optional [N].
        input_global_scale: static activation global scale, or None for dynamic per-row scales.
        act_quant: True for W4A4; False for W4A16 (activations stay in their dtype).
        out_dtype: output dtype, default ``x.dtype``.
        w_deq: optional cached ``dequantize_weight(qw, float64, include_bf16=False)`` [N, K]
            (what :class:`foursight.dispatch.ReferenceBackend` keeps; float32 is taken too); recomputed when None.
    Returns:
        [..., N], accumulated in float64 (:func:`splice_matmul`: a row's result does not depend on
        the other rows) and cast to ``out_dtype``.
    """
    k_dim = qw.in_features
    if x.shape[-1] != k_dim:
        raise NVFP4Error(f"input: last dim {x.shape[-1]} != layer in_features {k_dim}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k_dim)
    w = dequantize_weight(qw, torch.float32, include_bf16=False) if w_deq is None else w_deq
    xd = dequantized_activation(x2, qw.bf16_channels, input_global_scale, act_quant)
    y = splice_matmul(xd, x2, qw, w, bias)
    return y.to(out_dtype or x.dtype).reshape(*lead, qw.out_features)


def dequantized_activation(
    x: torch.Tensor, channels: torch.Tensor, input_global_scale: torch.Tensor | None = None, act_quant: bool = True
) -> torch.Tensor:
    """The FP4 operand of the layer as float32 [M, K]: ``deq(Q(X with S zeroed))`` (W4A4) or
    ``X with S zeroed`` (W4A16). ``x`` is [M, K]."""
    if act_quant:
        qa = quantize_activation(x, channels, input_global_scale)
        return dequantize_nvfp4(qa.packed, qa.scale, qa.global_scale, torch.float32)
    return zero_columns(x.float(), channels.long())


def splice_matmul(
    xd: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, w_deq: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``xd · w_deqᵀ + X[:, S] · W_bf16ᵀ (+ bias)`` [M, N], accumulated in float64 and returned in float32.

    Float64, so that a row's result does not depend on the other rows of the call: a CPU BLAS
    picks another kernel (another summation order) for a few rows than for many (float32 ``mm``
    on this machine differs in the last bit for M = 1-3, 5-7, 9-11 against M = 1024), and in W4A4
    a last-bit difference can move the next layer's activation across an FP4 rounding boundary.
    An engine that computes only the tokens its prefix cache lacks (SGLang, vLLM) then gave
    other logprobs for the same request cold and cached (0.07-0.10 nats on SmolLM2, issue 53).
    Summed in float64, the orders differ far below float32's precision, so the float32 result
    is the same for every M (``tests/test_layer.py::test_reference_linear_is_batch_invariant``).

    Args:
        xd: float32 [M, K], from :func:`dequantized_activation`.
        x: the original activations [M, K] (for the BF16 channels).
        w_deq: [N, K] float32 or float64, the dequantized FP4 weight (S columns zero); float64
            (the CPU backend's cache) saves the conversion.
    """
    y = xd.double() @ w_deq.double().t()
    ch = qw.bf16_channels.long()
    if ch.numel():
        y = y + x[:, ch].to(torch.bfloat16).double() @ qw.weight_bf16.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.float()

