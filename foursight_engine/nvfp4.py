"""NVFP4 numerics in plain PyTorch (CPU and GPU).

Conventions (bit-compatible with compressed-tensors' ``nvfp4-pack-quantized`` format):

* Element format E2M1: magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` have codes 0..7,
  the sign is bit 3 (code ``8 | m`` is ``-value(m)``).
* Two codes per byte, the even column in the low nibble, the odd column in the high nibble.
* One E4M3 (``torch.float8_e4m3fn``) block scale per 16 consecutive values along K.
* One FP32 *global scale* ``gs = 448 * 6 / amax`` per tensor (compressed-tensors' convention,
  the reciprocal of ModelOpt's ``weight_scale_2``).
* Block scale ``s = fp8(gs * block_amax / 6)``; element ``q = e2m1(x * gs / s)`` rounded to
  the nearest E2M1 value, ties to even; dequantization is ``x ≈ q * s / gs``.

All functions take and return tensors on the input's device; none of them keeps state.
"""

from __future__ import annotations

import sys

import torch

BLOCK_SIZE: int = 16
FP4_MAX: float = 6.0
FP8_E4M3_MAX: float = 448.0
# Smallest positive E4M3 value (a subnormal, 2**-9).
FP8_E4M3_MIN_POS: float = 2.0**-9
#: compressed-tensors replaces a block scale that is zero in E4M3 by E4M3's eps.
ZERO_SCALE_REPLACEMENT: float = 0.125
_ZERO_SCALE_BYTE: int = 0x20  # 0.125 in E4M3: exponent 4 (bias 7), mantissa 0

#: E2M1 value of each 4-bit code (index = code).
E2M1_VALUES: torch.Tensor = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Decision boundaries between consecutive magnitudes and whether a tie rounds up.
# Ties go to the value with an even mantissa bit: 0.25->0, 0.75->1, 1.25->1, 1.75->2,
# 2.5->2, 3.5->4, 5->4.
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_BOUNDS_LIST: list[float] = _BOUNDS.tolist()
_TIE_UP_LIST: list[bool] = _TIE_UP.tolist()


#: E2M1 values of both codes of each packed byte: row b is (value of b & 15, value of b >> 4).
_BYTE_VALUES: torch.Tensor = torch.stack([E2M1_VALUES[torch.arange(256) & 15], E2M1_VALUES[torch.arange(256) >> 4]], dim=1)
#: :data:`_BYTE_VALUES` with each row's two float32 read as one int64 (a lookup moves both at once).
_BYTE_PAIRS: torch.Tensor = _BYTE_VALUES.contiguous().view(torch.int64).reshape(256)


class NVFP4Error(ValueError):
    """Invalid input for an NVFP4 operation (shape, dtype or non-finite values)."""


def check_k(k: int, name: str = "tensor") -> None:
    """Raise :class:`NVFP4Error` unless ``k`` (the reduction dim) is a positive multiple of 16."""
    if k <= 0 or k % BLOCK_SIZE:
        raise NVFP4Error(f"{name}: K={k} is not a positive multiple of the NVFP4 block size {BLOCK_SIZE}")


def check_finite(x: torch.Tensor, name: str = "tensor") -> None:
    """Raise :class:`NVFP4Error` naming ``name`` if ``x`` holds NaN or Inf."""
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NVFP4Error(f"{name}: {bad} non-finite value(s) (NaN/Inf) in a tensor of shape {tuple(x.shape)}")


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even) and return its 4-bit code.

    Args:
        x: any shape, float; values are expected in [-6, 6] (larger magnitudes, and NaN, saturate
            to 6: code 7, with the sign bit of ``x``).
    Returns:
        uint8 tensor of the same shape holding codes 0..15 (sign in bit 3).
    """
    return e2m1_codes_f32(x.float().contiguous())


def _bf16_key(b: float) -> int:
    """The upper 16 bits of float32 ``b`` (its bfloat16 truncation, as an int)."""
    return int(torch.tensor([b], dtype=torch.float32).view(torch.int32).item()) >> 16


# The decision boundaries as 16-bit keys (each boundary has at most 2 significant bits, so it is exact
# in its upper 16 bits, and the lowest bit of each key is 0: see e2m1_codes_f32).
_BOUND_KEYS: list[tuple[int, bool]] = [(_bf16_key(b), up) for b, up in zip(_BOUNDS_LIST, _TIE_UP_LIST)]


def e2m1_codes_f32(xf: torch.Tensor) -> torch.Tensor:
    """:func:`e2m1_codes` of a contiguous float32 tensor, read as 16-bit halves.

    The code is the number of decision boundaries below ``|x|``, a tie counting on a tie-up
    boundary. For a non-negative float32 the bit pattern is monotone in the value, so the compare
    can be done on the key ``upper16(|x|) | (lower16(x) != 0)``: every boundary ``b`` is exact in its
    upper 16 bits ``B`` with ``B`` even, hence ``|x| > b`` iff ``key > B`` and ``|x| >= b`` iff
    ``key >= B`` (a sticky bit in bit 0 stands for the dropped low half). The seven compares then
    read int16 instead of float32 and write into one reused bool buffer that is added into the uint8
    result in place: no temporary per boundary (on the CPU each fresh tensor costs page faults).
    The sign (compressed-tensors keeps it on values that round to zero: code 8 is -0) is bit 15 of
    the upper half. Bit-identical to the compare-on-floats form for every finite and infinite value
    (tests/test_nvfp4.py)."""
    shape = xf.shape
    w = xf.reshape(-1).view(torch.int16).view(-1, 2)
    lo, hi = (w[:, 0], w[:, 1]) if sys.byteorder == "little" else (w[:, 1], w[:, 0])
    key = torch.ne(lo, 0).view(torch.uint8).to(torch.int16).bitwise_or_(hi)  # sticky | upper half (with sign)
    sign = torch.lt(key, 0).view(torch.uint8).bitwise_left_shift_(3)  # 0 or 8
    key.bitwise_and_(0x7FFF)
    acc = torch.gt(key, _BOUND_KEYS[0][0]).view(torch.uint8)
    cmp = torch.empty(key.shape, dtype=torch.bool, device=key.device)
    for b, up in _BOUND_KEYS[1:]:
        (torch.ge if up else torch.gt)(key, b, out=cmp)
        acc.add_(cmp.view(torch.uint8))
    return acc.bitwise_or_(sign).view(shape)


def _code_table() -> torch.Tensor:
    """uint8 [65536]: the E2M1 code (after clamping to ±6) of every float32 whose 16-bit key
    (:func:`e2m1_codes_lut`) is the index, computed once by :func:`e2m1_codes_f32` on one
    representative float per key (upper half = key, lower half 0); NaN keys map to 7 | sign."""
    rep = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    codes = e2m1_codes_f32(torch.clamp(rep, -FP4_MAX, FP4_MAX).contiguous())
    nan = torch.isnan(rep)
    codes[nan] = 7 | (torch.signbit(rep[nan]).to(torch.uint8) << 3)
    return codes


#: E2M1 code of each 16-bit key ``upper16(x) | sticky(lower16(x))`` (see :func:`e2m1_codes_lut`).
CODE_TABLE: torch.Tensor = _code_table()


_TABLES_ON: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``, copied there once (a copy per call would cost a GPU a transfer and a sync)."""
    if table.device == device:
        return table
    key = (id(table), device)
    if key not in _TABLES_ON:
        _TABLES_ON[key] = table.to(device)
    return _TABLES_ON[key]


def e2m1_codes_lut(xf: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``clamp(xf, -6, 6)`` for a contiguous float32 tensor ``xf``, by one table lookup.

    The key of a float32 is its upper 16 bits (sign, exponent, 7 mantissa bits) with bit 0 set when
    the lower 16 bits are not zero (the sticky bit of :func:`e2m1_codes_f32`). Every decision
    boundary, and the clamp edge 6, is exact in its upper half with bit 0 clear, so all floats of one
    key round to the same code, and :data:`CODE_TABLE` holds it. The key is four int32 passes:
    ``((u & 0xFFFF) + 0xFFFF)`` has bit 16 set iff the lower half is not zero; OR-ed into ``u`` and
    shifted down it is the key (masked to 16 bits: the shift keeps the sign). Bit-identical to
    ``e2m1_codes_f32(clamp(xf, -6, 6))`` for every float32 (tests/test_nvfp4.py checks all 2**16
    keys with both lower halves); no clamp pass and no compare chain."""
    u = xf.view(torch.int32)
    key = (u & 0xFFFF).add_(0xFFFF).bitwise_or_(u).bitwise_right_shift_(16).bitwise_and_(0xFFFF)
    return _on(CODE_TABLE, xf.device).index_select(0, key.reshape(-1)).view(xf.shape)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Map 4-bit codes (uint8, any shape) to their float32 E2M1 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` onto the E2M1 grid (ties to even, saturating at ±6); float32 out, same shape."""
    return e2m1_values(e2m1_codes(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes uint8 [..., K] (K even) into bytes uint8 [..., K/2]; even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4Error(f"pack_fp4: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.uint8)
    if c.is_contiguous() and sys.byteorder == "little" and c.numel():
        return _pack_nibbles(c & 0xF)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def _pack_nibbles(c: torch.Tensor) -> torch.Tensor:
    """:func:`pack_fp4` of contiguous uint8 codes already below 16, on a little-endian host: each
    (even, odd) pair read as one int16 ``even | odd << 8``; ``v | v >> 4`` puts ``even | odd << 4`` in
    its low byte, and the cast to uint8 keeps that byte (integer casts wrap): two passes over half
    as many elements, no strided views."""
    v = c.view(torch.int16)
    return (v | (v >> 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 [..., K/2] -> codes uint8 [..., K]."""
    if packed.dtype != torch.uint8:
        raise NVFP4Error(f"unpack_fp4: expected uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """FP32 global scale ``448 * 6 / amax`` (compressed-tensors' ``generate_gparam``).

    ``amax`` may be a scalar or any shape (e.g. [M, 1] for per-row scales). Where the division
    overflows (amax == 0 or tiny) the scale is 1.0, as in compressed-tensors.
    """
    amax = torch.clamp(amax.float(), min=torch.finfo(torch.float32).tiny)
    gs = (FP8_E4M3_MAX * FP4_MAX) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales of ``x``.

    Args:
        x: [R, K] float, K a multiple of 16.
        global_scale: float32 scalar or [R, 1].
    Returns:
        float8_e4m3fn [R, K/16]: ``fp8(clamp(gs * block_amax / 6, max=448))``; a scale that is
        zero after the cast becomes 0.125 (E4M3's eps), as compressed-tensors does, so that no
        division by zero can occur.
    """
    r, k = x.shape
    check_k(k)
    amax = x.float().abs().reshape(r, k // BLOCK_SIZE, BLOCK_SIZE).amax(-1)
    return scales_from_block_amax(amax, global_scale)


def scales_from_block_amax(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales from block amax [R, K/16] (float32) and a global scale (scalar or [R, 1])."""
    s = global_scale.float() * (amax / FP4_MAX)
    s8 = torch.clamp(s, min=-FP8_E4M3_MAX, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    # a scale that is zero (or -0) in E4M3 becomes 0.125 (byte 0x20), on the bytes: one fp8 cast
    b = s8.view(torch.uint8)
    b.masked_fill_((b & 0x7F) == 0, _ZERO_SCALE_BYTE)
    return s8


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor, name: str = "tensor", also_finite: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [R, K] to NVFP4 with a given global scale.

    Args:
        x: [R, K] float (bf16/fp16/fp32), finite, K a multiple of 16.
        global_scale: float32 scalar (per tensor) or [R, 1] (per row).
        name: used in error messages.
        also_finite: another tensor that must be finite too (a FourSight layer's BF16 columns), checked
            in the same single read to the host as ``x`` (on a GPU each read is a synchronisation); if
            it is not, its error is raised first.
    Returns:
        ``(packed, scale)``: uint8 [R, K/2] and float8_e4m3fn [R, K/16].
    """
    if x.dim() != 2:
        raise NVFP4Error(f"{name}: expected a 2-D tensor [R, K], got shape {tuple(x.shape)}")
    r, k = x.shape
    check_k(k, name)
    gs = global_scale.float().to(x.device)
    # float32 once (a no-op for a contiguous float32 input): every pass below reads float32
    xb = x.float().contiguous().reshape(r, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = block_amax(xb)
    ok = torch.isfinite(amax).all()  # amax propagates NaN/Inf: one pass checks both
    if also_finite is not None and also_finite.numel():
        ok = ok & torch.isfinite(also_finite).all()
    if r and not bool(ok):
        if also_finite is not None:
            check_finite(also_finite, name)
        check_finite(x, name)
    scale = scales_from_block_amax(amax, gs)
    # x * gs / s computed as x / (s / gs), the order compressed-tensors uses; one division per element
    # against the block's divisor broadcast (no [R, K] copy of it); the clamp to ±6 is in the code table
    eff = (scale.float() / gs).unsqueeze(-1)
    scaled = torch.div(xb, eff).reshape(r, k)
    codes = e2m1_codes_lut(scaled)
    return (_pack_nibbles(codes) if sys.byteorder == "little" else pack_fp4(codes)), scale


def block_amax(xb: torch.Tensor) -> torch.Tensor:
    """float32 ``max |x|`` over the last dim of ``xb`` (e.g. [R, K/16, 16] blocks, [N, K] rows, or a
    whole 1-D tensor); NaN and Inf propagate as with ``abs().amax()`` (exact: a maximum rounds nothing).

    The form is the fastest one found on the CPU for each shape: 16-wide blocks by ``abs`` and a
    max-pool of width 16 (a reduction over a 16-wide last dim is the slowest form); a 1-D tensor by one
    ``aminmax`` pass with no dim, ``max(max x, -min x)`` (with ``dim=-1`` it takes the slow form);
    rows by ``abs().amax(-1)``."""
    if xb.dim() == 1:
        if not xb.numel():
            return torch.zeros((), dtype=torch.float32, device=xb.device)
        lo, hi = torch.aminmax(xb)
        return torch.maximum(hi.float(), lo.float().neg_())
    if xb.shape[-1] == BLOCK_SIZE and xb.numel():
        lead = xb.shape[:-1]
        a = xb.float().abs().reshape(-1, 1, lead[-1] * BLOCK_SIZE)
        return torch.nn.functional.max_pool1d(a, BLOCK_SIZE, BLOCK_SIZE).reshape(lead)
    return xb.float().abs().amax(-1)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize NVFP4: ``q * (s / gs)`` (the operation order of compressed-tensors).

    Args:
        packed: uint8 [R, K/2].
        scale: float8_e4m3fn [R, K/16].
        global_scale: float32 scalar, [R, 1] or [R] (one per row).
        dtype: output dtype.
    Returns:
        [R, K] tensor of ``dtype`` (computed in float32).
    """
    r, kh = packed.shape
    # both values of a byte from one 256-entry table, read as one int64 per byte (an index_select
    # over half as many elements as codes, int32 indices), times the block's divisor broadcast over
    # its 16 values in place: no [R, K] index or scale copy
    pairs = _on(_BYTE_PAIRS, packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    q = pairs.view(torch.float32).reshape(r, kh * 2 // BLOCK_SIZE, BLOCK_SIZE)
    gs = global_scale.float().to(packed.device)
    if gs.dim() == 1:
        gs = gs.unsqueeze(1)
    eff = (scale.float() / gs).unsqueeze(-1)
    return q.mul_(eff).reshape(r, kh * 2).to(dtype)
