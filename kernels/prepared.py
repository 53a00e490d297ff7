"""The CUDA execution form of a compensated layer (:class:`PreparedWeight`), the bytes it keeps on
the device (:func:`resident_bytes`), and the checks every execution form starts from
(:func:`checked_tensors`, :func:`linear_operands`).

The checkpoint on disk does not change (compressed-tensors compatible); only this in-memory form
does. **One weight form is resident:** the FP4 part is kept only in the fragment execution form
(:mod:`.fragment_layout`: codes re-laid for the wgmma register operand, block scales beside them), with
the FP4 codes of the BF16 channels S forced to 0; the decode/mid GEMM (:mod:`.fragment`) and the
prefill dequantization (:mod:`.dequant`) both read it. Beside it: the weight global scale
broadcast to one per output row, the S column indices and mask, and ``W[:, S]`` in bf16. The
compressed-tensors packed layout (``weight_packed``/``weight_scale``) is rebuilt from the fragment
form only on demand (:func:`~.fragment_layout.unfragment`): by the fp16-activation forms, which then cache
it (and :func:`resident_bytes` counts it), and as a temporary by the autotuner's reference check.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from foursight.layer import QuantizedWeight, channel_mask, check_channels, reference_linear
from foursight.nvfp4 import BLOCK_SIZE, NVFP4Error, check_k

from .fragment_layout import FragmentWeight, fragment_weight, unfragment


#: every live prepared layer by its ``op_handle`` (weak: a dropped layer leaves)
OP_HANDLES: "weakref.WeakValueDictionary[int, PreparedWeight]" = weakref.WeakValueDictionary()
_HANDLE_COUNTER = itertools.count(1)


@dataclass
class PreparedWeight:
    """CUDA execution form of one compensated linear layer.

    Attributes:
        fragment: the FP4 part in the fragment execution form (:class:`~.fragment_layout.FragmentWeight`;
            the nibbles of the S columns forced to 0, so the W4A16 mode can feed X with its S
            columns unzeroed). The only copy of the FP4 weight the default paths keep.
        weight_global_scale: float32 [N] (the [1] per-tensor scale broadcast, or the per-row one).
        bf16_channels: int32 [k] sorted.
        channel_mask: uint8 [K], 1 at the S columns.
        weight_bf16: bfloat16 [N, k] contiguous.
        out_features, in_features: N, K.
        uniform_global_scale: every output row has the same weight global scale (a per-tensor
            scale); the dequantize-then-cuBLAS datapath then folds it into the activation operand.
    """

    fragment: FragmentWeight
    weight_global_scale: torch.Tensor
    bf16_channels: torch.Tensor
    channel_mask: torch.Tensor
    weight_bf16: torch.Tensor
    out_features: int
    in_features: int
    uniform_global_scale: bool = False
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        # the number torch.compile's graphs name this layer by (:func:`.api.splice_linear` under compilation
        # is the custom op ``foursight::splice_linear``, which takes tensors and numbers, not this object);
        # given here, eagerly, because a registration during tracing would only happen after the trace
        self.op_handle = next(_HANDLE_COUNTER)
        OP_HANDLES[self.op_handle] = self

    @property
    def num_channels(self) -> int:
        return int(self.bf16_channels.numel())

    def packed_form(self, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed uint8 [N, K/2], E4M3 scale bytes uint8 [N, K/16])`` rebuilt from the fragment
        form; ``keep`` caches them on the layer (a second resident form: only the fp16-activation
        forms ask for that)."""
        pk = self._cache.get("packed")
        if pk is None:
            pk = unfragment(self.fragment)
            if keep:
                self._cache["packed"] = pk
        return pk

    def checkpoint_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's checkpoint FP4 codes and block scales rebuilt from the fragment form, not kept:
        ``(packed uint8 [N, K/2], E4M3 scale bytes uint8 [N, K/16])``. Byte for byte the checkpoint's
        wherever an execution form reads it; the bytes no form reads come back as 0 (the S columns'
        nibbles, the codes of a block whose scale is 0, a -0 scale), which is how FourSight's quantizer
        writes them. So an engine plugin may free its own copy of these two tensors after preparing the
        layer and rebuild it from here before a weight update writes into it
        (:func:`foursight.kernels.backends.rebuilds_checkpoint`, ``quant_methods/plan.py``)."""
        return self.packed_form(keep=False)

    @property
    def weight_packed(self) -> torch.Tensor:
        """uint8 [N, K/2], S nibbles 0 (built on first use and kept: see :meth:`packed_form`)."""
        return self.packed_form()[0]

    @property
    def weight_scale(self) -> torch.Tensor:
        """uint8 [N, K/16] E4M3 bytes (built on first use and kept: see :meth:`packed_form`)."""
        return self.packed_form()[1]


def _tensors_of(obj, seen: set) -> int:
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.data_ptr())
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensors_of(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensors_of(o, seen) for o in obj.values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensors_of(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0


def resident_bytes(prepared: PreparedWeight) -> int:
    """Bytes a prepared layer keeps on its device: every tensor it holds (the fragment form, global
    scales, channel indices and mask, ``W[:, S]``, and whatever its cache holds, e.g. a packed form
    an fp16 kernel asked for), each storage counted once. Shared per-device buffers (split-K
    counters, workspaces, the prefill scratch) are not per layer and not counted here."""
    return _tensors_of(prepared, set())


def zero_channel_nibbles(packed: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
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


class CheckedTensors(NamedTuple):
    """The tensors of a :class:`~foursight.layer.QuantizedWeight`, checked, in the form every
    execution form starts from (:func:`checked_tensors`)."""

    packed: torch.Tensor  #: uint8 [N, K/2], a contiguous copy with the S columns' nibbles 0
    scale: torch.Tensor  #: uint8 [N, K/16] E4M3 bytes, contiguous (may share the checkpoint's storage)
    global_scale: torch.Tensor  #: float32 [N], a new tensor (a per-tensor [1] scale broadcast)
    uniform_global_scale: bool  #: every row has the same weight global scale
    channels: torch.Tensor  #: int32 [k] sorted, on the weight's device
    channel_mask: torch.Tensor  #: uint8 [K], 1 at the S columns
    weight_bf16: torch.Tensor  #: bfloat16 [N, k] contiguous


def checked_tensors(qw: QuantizedWeight, name: str = "layer", channels_checked: bool = False) -> CheckedTensors:
    """Check ``qw``'s shapes and dtypes (an :class:`NVFP4Error` naming the tensor) and return its
    tensors as :class:`CheckedTensors` (``qw`` is not modified). ``channels_checked``: the channel set
    is a layer's own, validated when the layer was built (sorted int32, in range, distinct), so its
    check, three reads to the host on a GPU, is skipped (a weight sync re-preparing every layer)."""
    wp, ws, wgs, ch, wb = qw.tensors()
    if wp.dtype != torch.uint8 or wp.dim() != 2:
        raise NVFP4Error(f"{name}.weight_packed: expected uint8 [N, K/2], got {wp.dtype} {tuple(wp.shape)}")
    n, k_dim = wp.shape[0], wp.shape[1] * 2
    check_k(k_dim, f"{name}.weight_packed")
    if ws.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(ws.shape) != (n, k_dim // BLOCK_SIZE):
        raise NVFP4Error(f"{name}.weight_scale: expected float8_e4m3fn [{n}, {k_dim // BLOCK_SIZE}], got {ws.dtype} {tuple(ws.shape)}")
    g = wgs.float().reshape(-1)
    if g.numel() not in (1, n):
        raise NVFP4Error(f"{name}.weight_global_scale: expected [1] or [{n}], got {tuple(wgs.shape)}")
    ch32 = (ch.to(device=wp.device, dtype=torch.int32) if channels_checked
            else check_channels(ch, k_dim, f"{name}.bf16_channels").to(wp.device))
    if tuple(wb.shape) != (n, ch32.numel()):
        raise NVFP4Error(f"{name}.weight_bf16: expected [{n}, {ch32.numel()}], got {tuple(wb.shape)}")
    return CheckedTensors(
        packed=zero_channel_nibbles(wp.contiguous(), ch32),
        scale=ws.contiguous().view(torch.uint8),
        global_scale=(g.expand(n) if g.numel() == 1 else g).contiguous().clone(),
        uniform_global_scale=bool(g.numel() == 1 or bool((g == g[0]).all())),
        channels=ch32.contiguous(),
        channel_mask=channel_mask(ch32, k_dim),
        weight_bf16=wb.to(torch.bfloat16).contiguous(),
    )


def prepare_weight(qw: QuantizedWeight, name: str = "layer", channels_checked: bool = False) -> PreparedWeight:
    """Build the execution form of ``qw`` (idempotent; ``qw`` is not modified).

    Raises :class:`NVFP4Error` naming the tensor when a shape or dtype is wrong. ``channels_checked``:
    see :func:`checked_tensors`.
    """
    t = checked_tensors(qw, name, channels_checked)
    return PreparedWeight(
        fragment=fragment_weight(t.packed, t.scale),
        weight_global_scale=t.global_scale,
        bf16_channels=t.channels,
        channel_mask=t.channel_mask,
        weight_bf16=t.weight_bf16,
        out_features=qw.out_features,
        in_features=qw.in_features,
        uniform_global_scale=t.uniform_global_scale,
    )


def linear_operands(x: torch.Tensor, pw, bias: torch.Tensor | None, name: str = "layer") -> tuple:
    """``(lead, x2, out)`` of a linear on the execution form ``pw`` (``in_features``/``out_features``):
    ``x`` [..., K] viewed as ``x2`` [M, K], the leading shape, and an empty output [M, N] in x's dtype.
    A last dim other than K or a bias other than [N] raises :class:`NVFP4Error` naming ``name``."""
    k_dim, n = pw.in_features, pw.out_features
    if x.shape[-1] != k_dim:
        raise NVFP4Error(f"{name}: input last dim {x.shape[-1]} != layer in_features {k_dim}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise NVFP4Error(f"{name}.bias: expected [{n}], got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k_dim)
    return x.shape[:-1], x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)


def reference_output(pw: PreparedWeight, x, bias, input_global_scale, act_quant: bool) -> torch.Tensor:
    """fp32 output of :func:`foursight.layer.reference_linear` for the layer ``pw`` was prepared from."""
    packed, scale = pw.packed_form(keep=False)  # a temporary: the layer keeps only the fragment form
    qw = QuantizedWeight(packed, scale.view(torch.float8_e4m3fn), pw.weight_global_scale, pw.bf16_channels, pw.weight_bf16)
    return reference_linear(x, qw, bias=bias, input_global_scale=input_global_scale, act_quant=act_quant,
                            out_dtype=torch.float32)
