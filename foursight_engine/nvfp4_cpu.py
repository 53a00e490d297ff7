"""A fused NVFP4 weight quantizer for the CPU: the weight sync's re-quantization in two native passes.

:func:`foursight.layer.quantize_weight` in eager PyTorch runs a dozen passes over each shard (float32 copy,
S columns zeroed, amax, block maxima, scales, division, the code key, the table lookup, packing), each a
separate tensor operation with its own allocation and dispatch. On the CPU an RL weight sync of SmolLM2-135M
ran about 13x the tensor operations of a BF16 sync (docs/weight-sync.md, "Cost"). This module does the
same arithmetic in two passes of a small C routine per block of rows, compiled once per machine with the
system's C compiler and called through :mod:`ctypes` (no PyTorch headers: compiling takes about a second):

1. ``fs_block_amax``: per 16-block ``max |x|`` of a BF16 ``[R, K]`` weight with the BF16 channels (S columns)
   read as zero, from the BF16 bit patterns (for finite values the order of ``x & 0x7FFF`` is the order of
   ``|x|``: a maximum rounds nothing); it also reports whether any value (S columns included) is NaN or Inf;
2. the per-tensor global scales from those maxima, in PyTorch (:func:`foursight.nvfp4.global_scale_from_amax`,
   a few scalars);
3. ``fs_encode``: per block the E4M3 scale ``fp8(clamp(gs * (amax / 6), max=448))`` (a zero byte becomes 0.125),
   the divisor ``scale / gs``, and per value ``x / divisor``, its E2M1 code through the same 65,536-entry table
   as :func:`foursight.nvfp4.e2m1_codes_lut` (the float32's upper 16 bits with a sticky bit for the lower 16),
   two codes per byte.

Every float operation is the one PyTorch runs, in the same order, in IEEE float32 (compiled without fast-math
and without FMA contraction), and the E4M3 rounding is PyTorch's own (``c10::detail::fp8e4m3fn_from_fp32_value``,
copied below), so the result is bit-identical to the eager quantizer (tests/test_nvfp4_cpu.py: edge values,
random weights and SmolLM2's real weights, both entry points). A weight with a NaN or Inf is handed to the
eager quantizer, which names it in its error.

The rows are split over ``torch.get_num_threads()`` Python threads (a :mod:`ctypes` call releases the GIL).
Used by :mod:`foursight.quant_methods.requantize` for BF16 CPU weights only; CUDA keeps its Triton kernel.
:func:`dequantize_rows` is the inverse in one pass (``fs_decode``: code value times ``scale / gs``), which
:func:`foursight.nvfp4.dequantize_nvfp4` takes on the CPU: the CPU execution form of every layer a sync
re-quantized is its dequantized weight, rebuilt in the same sync.
Set ``FOURSIGHT_NATIVE_CPU_QUANT=0`` to use the eager quantizer; when no compiler is found or the build fails
the eager quantizer is used too, with one warning naming why.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from foursight.cache import cache_dir
from foursight.nvfp4 import BLOCK_SIZE, CODE_TABLE, E2M1_VALUES, dequantize_nvfp4 as eager_dequantize_nvfp4, global_scale_from_amax

_E2M1 = E2M1_VALUES.contiguous()

logger = logging.getLogger(__name__)

#: ``0`` turns the native quantizer off (the eager PyTorch one runs); anything else, or unset, leaves it on
ENV_NATIVE_CPU_QUANT = "FOURSIGHT_NATIVE_CPU_QUANT"

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* PyTorch's float -> float8_e4m3fn (c10::detail::fp8e4m3fn_from_fp32_value, torch/headeronly/util/Float8_e4m3fn.h,
   BSD-3-Clause): round to nearest even, saturating at 448 */
static inline uint8_t e4m3(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20, denorm_mask = UINT32_C(141) << 23;
    uint32_t f_bits = bits(f);
    uint8_t result;
    const uint32_t sign = f_bits & UINT32_C(0x80000000);
    f_bits ^= sign;
    if (f_bits >= fp8_max) {
        result = f_bits > UINT32_C(0x7F800000) ? 0x7f : 0x7e;
    } else if (f_bits < (UINT32_C(121) << 23)) {
        f_bits = bits(f32(f_bits) + f32(denorm_mask));
        result = (uint8_t)(f_bits - denorm_mask);
    } else {
        uint8_t mant_odd = (f_bits >> 20) & 1;
        f_bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF;
        f_bits += mant_odd;
        result = (uint8_t)(f_bits >> 20);
        if (result == 0x7f) result = 0x7e;
    }
    return result | (uint8_t)(sign >> 24);
}

/* e4m3 of n floats (what tests/test_nvfp4_cpu.py compares with PyTorch's cast on every 16-bit key) */
void fs_e4m3_bytes(const float *x, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; ++i) out[i] = e4m3(x[i]);
}

/* float8_e4m3fn byte -> float (exact; 0x7F and 0xFF are NaN) */
static inline float e4m3_value(uint8_t b) {
    uint32_t e = (b >> 3) & 15, m = b & 7;
    if ((b & 0x7F) == 0x7F) return f32(UINT32_C(0x7FC00000) | ((uint32_t)(b & 0x80) << 24));
    float v = e ? f32(((e + 120) << 23) | (m << 20)) : (float)m * f32(UINT32_C(118) << 23); /* m * 2^-9 */
    return (b & 0x80) ? -v : v;
}

/* rows [r0, r1) of a BF16 [R, K] weight (row stride ld, in elements); keep[k] is 0xFFFF, or 0 for an S column.
   amax[r, b] (float32 [R, K/16]) = max |x| over block b of row r with the S columns as zero, for finite x.
   Returns 1 when every value (S columns included) is finite, else 0. */
int fs_block_amax(const uint16_t *x, int64_t ld, int64_t r0, int64_t r1, int64_t K, const uint16_t *keep, float *amax) {
    int finite = 1;
    const int64_t nb = K / 16;
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t *row = x + r * ld;
        uint16_t bad = 0;
        for (int64_t b = 0; b < nb; ++b) {
            uint16_t m = 0;
            for (int j = 0; j < 16; ++j) {
                uint16_t v = row[b * 16 + j];
                uint16_t a = v & keep[b * 16 + j] & 0x7FFF;
                m = a > m ? a : m;
                bad |= (uint16_t)((v & 0x7F80) == 0x7F80);
            }
            amax[r * nb + b] = f32((uint32_t)m << 16);
        }
        if (bad) finite = 0;
    }
    return finite;
}

/* rows [r0, r1): packed[r, K/2] codes and scale[r, K/16] E4M3 bytes from the block amax and the row's
   global scale gs[r] (the arithmetic of foursight.nvfp4.quantize_nvfp4, in its order); an S column is read
   as +0.0, as index_fill_ writes it. The keys of a block are computed in one loop the compiler vectorizes
   (the division included), the table lookups in a second one. */
void fs_encode(const uint16_t *x, int64_t ld, int64_t r0, int64_t r1, int64_t K, const uint16_t *keep,
               const float *amax, const float *gs, const uint8_t *table, uint8_t *packed, uint8_t *scale) {
    const int64_t nb = K / 16;
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t *row = x + r * ld;
        const float g = gs[r];
        for (int64_t b = 0; b < nb; ++b) {
            float s = g * (amax[r * nb + b] / 6.0f);
            s = s > 448.0f ? 448.0f : (s < -448.0f ? -448.0f : s);
            uint8_t sb = e4m3(s);
            if ((sb & 0x7F) == 0) sb = 0x20;
            scale[r * nb + b] = sb;
            const float eff = e4m3_value(sb) / g;
            const uint16_t *xb = row + b * 16, *kb = keep + b * 16;
            uint32_t key[16];
            for (int h = 0; h < 16; h += 8) {  /* GCC vector extensions: 8 lanes of IEEE float32 division */
                v8u u;
                v8f f;
                for (int j = 0; j < 8; ++j) u[j] = (uint32_t)(xb[h + j] & kb[h + j]) << 16;
                memcpy(&f, &u, sizeof f);
                f = f / eff;
                memcpy(&u, &f, sizeof u);
                u = ((((u & 0xFFFFu) + 0xFFFFu) | u) >> 16) & 0xFFFFu;
                memcpy(key + h, &u, sizeof u);
            }
            uint8_t *out = packed + r * (K / 2) + b * 8;
            for (int j = 0; j < 8; ++j) out[j] = (uint8_t)(table[key[2 * j]] | (table[key[2 * j + 1]] << 4));
        }
    }
}

/* rows [r0, r1) of packed codes [R, K/2] with E4M3 scales [R, K/16] and the row's global scale gs[r]:
   out[r, k] (float32 [R, K]) = value(code) * (scale / gs), the arithmetic of foursight.nvfp4.dequantize_nvfp4 */
void fs_decode(const uint8_t *packed, int64_t r0, int64_t r1, int64_t K, const uint8_t *scale, const float *gs,
               const float *values, float *out) {
    const int64_t nb = K / 16;
    for (int64_t r = r0; r < r1; ++r) {
        const float g = gs[r];
        for (int64_t b = 0; b < nb; ++b) {
            const float eff = e4m3_value(scale[r * nb + b]) / g;
            const uint8_t *in = packed + r * (K / 2) + b * 8;
            float *o = out + r * K + b * 16;
            for (int j = 0; j < 8; ++j) {
                o[2 * j] = values[in[j] & 15] * eff;
                o[2 * j + 1] = values[in[j] >> 4] * eff;
            }
        }
    }
}
"""

def _cpu_flags() -> set[str]:
    try:
        return set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration, IndexError):
        return set()


#: IEEE float32 throughout (no fast-math, no FMA contraction: the bytes must equal PyTorch's); AVX2 where the CPU
#: has it (part of the cache key, so a library is only loaded where it was built for)
_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-std=c99"] + (["-mavx2"] if "avx2" in _cpu_flags() else [])

_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _build() -> ctypes.CDLL:
    """Compile :data:`_SOURCE` once per machine into the FourSight cache (keyed by the source, the flags and the
    machine), atomically (a temporary file renamed into place: concurrent builders do not see half a library)."""
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, platform.machine(), sys.platform]).encode()).hexdigest()[:16]
    out = cache_dir() / "native" / f"nvfp4_cpu-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src, lib = Path(tmp) / "nvfp4_cpu.c", Path(tmp) / out.name
            src.write_text(_SOURCE)
            r = subprocess.run([cc, *_FLAGS, str(src), "-o", str(lib)], capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
            os.replace(lib, out)
    lib = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fs_block_amax.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.fs_block_amax.restype = ctypes.c_int
    lib.fs_encode.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, p]
    lib.fs_encode.restype = None
    lib.fs_decode.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.fs_decode.restype = None
    lib.fs_e4m3_bytes.argtypes = [p, i64, p]
    lib.fs_e4m3_bytes.restype = None
    return lib


def native_lib() -> ctypes.CDLL | None:
    """The compiled quantizer, or None (turned off by :data:`ENV_NATIVE_CPU_QUANT`, or it could not be built:
    logged once, and the eager quantizer runs)."""
    global _lib, _lib_error
    if os.environ.get(ENV_NATIVE_CPU_QUANT, "1").strip() == "0":
        return None
    if _lib is not None or _lib_error is not None:
        return _lib
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = _build()
            except Exception as e:  # noqa: BLE001 - no compiler, a failed build, an unloadable library
                _lib_error = f"{type(e).__name__}: {e}"
                logger.warning("FourSight: the native CPU NVFP4 quantizer is unavailable (%s); the weight sync uses the "
                               "eager PyTorch quantizer (same results, slower)", _lib_error)
    return _lib


def supports(weight: torch.Tensor) -> bool:
    """Whether :func:`quantize_rows` takes ``weight``: a 2-D BF16 CPU tensor whose rows are contiguous, K a
    positive multiple of 16, and the native library available."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] > 0 and weight.shape[1] % BLOCK_SIZE == 0 and weight.stride(1) == 1
            and native_lib() is not None)


def _run_rows(fn, rows: int) -> list:
    """``fn(r0, r1)`` over ``rows`` split into ``torch.get_num_threads()`` ranges, in parallel threads."""
    global _pool, _pool_size
    n = max(1, min(torch.get_num_threads(), rows // 64 or 1))
    if n == 1:
        return [fn(0, rows)]
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="foursight-nvfp4"), n
        pool = _pool
    step = -(-rows // n)
    return list(pool.map(lambda r0: fn(r0, min(rows, r0 + step)), range(0, rows, step)))


def quantize_rows(weight: torch.Tensor, channels: torch.Tensor, shard_rows: list[int] | None = None,
                  global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """NVFP4 of a BF16 CPU weight ``[N, K]`` (:func:`supports`) with the columns ``channels`` (int [k], the
    layer's validated set) read as zero: ``(packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16], gs float32)``.

    The global scale: ``global_scale`` (float32, one for all rows) when given, else one per shard of
    ``shard_rows`` (consecutive row counts; default one shard), ``448 * 6 / amax`` of the shard's values outside
    the channels; ``gs`` is then float32 [1] for one shard and [N] (per row) for several, as
    :func:`foursight.layer.quantize_weight` and :func:`foursight.quant_methods.requantize.quantize_fused` return
    them. Returns None when a value of ``weight`` is NaN or Inf (the caller's eager quantizer names it)."""
    lib = native_lib()
    n, k = weight.shape
    nb = k // BLOCK_SIZE
    keep = torch.full((k,), -1, dtype=torch.int16)  # 0xFFFF: a column read as it is
    if channels.numel():
        keep.index_fill_(0, channels.long().cpu(), 0)
    amax = torch.empty((n, nb), dtype=torch.float32)
    x, ld, kp, ap = weight.data_ptr(), weight.stride(0), keep.data_ptr(), amax.data_ptr()
    if not all(_run_rows(lambda r0, r1: lib.fs_block_amax(x, ld, r0, r1, k, kp, ap), n)):
        return None
    if global_scale is not None:
        gs = global_scale.float().reshape(1)
        rows_gs = gs.expand(n).contiguous()
    else:
        shard_rows = shard_rows or [n]
        row_max = amax.amax(1) if n else amax.new_zeros(0)
        gs = torch.cat([global_scale_from_amax(a.max() if a.numel() else a.new_zeros(())).reshape(1)
                        for a in torch.split(row_max, shard_rows)])
        rows_gs = torch.repeat_interleave(gs, torch.tensor(shard_rows)).contiguous()
        if len(shard_rows) > 1:
            gs = rows_gs
    packed = torch.empty((n, k // 2), dtype=torch.uint8)
    scale = torch.empty((n, nb), dtype=torch.uint8)
    table = CODE_TABLE
    gp, tp, pp, sp = rows_gs.data_ptr(), table.data_ptr(), packed.data_ptr(), scale.data_ptr()
    _run_rows(lambda r0, r1: lib.fs_encode(x, ld, r0, r1, k, kp, ap, gp, tp, pp, sp), n)
    return packed, scale.view(torch.float8_e4m3fn), gs


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor | None:
    """float32 [R, K] of NVFP4 ``packed`` uint8 [R, K/2] (contiguous, CPU), ``scale`` E4M3 [R, K/16] and a
    global scale of one or R values: ``value(code) * (scale / gs)``, bit for bit what
    :func:`foursight.nvfp4.dequantize_nvfp4` computes (one pass instead of a table gather and a multiply);
    None when the native library is unavailable or the tensors are not of that form (the caller's eager path)."""
    lib = native_lib()
    if lib is None or packed.device.type != "cpu" or packed.dim() != 2 or packed.dtype != torch.uint8:
        return None
    r, kh = packed.shape
    k = kh * 2
    if k % BLOCK_SIZE or tuple(scale.shape) != (r, k // BLOCK_SIZE) or scale.dtype != torch.float8_e4m3fn or scale.device.type != "cpu":
        return None
    gs = global_scale.float().reshape(-1)
    if gs.numel() not in (1, r) or gs.device.type != "cpu":
        return None
    rows_gs = gs.expand(r).contiguous()
    packed, sc = packed.contiguous(), scale.contiguous().view(torch.uint8)
    out = torch.empty((r, k), dtype=torch.float32)
    pp, sp, gp, vp, op = packed.data_ptr(), sc.data_ptr(), rows_gs.data_ptr(), _E2M1.data_ptr(), out.data_ptr()
    if r:
        _run_rows(lambda r0, r1: lib.fs_decode(pp, r0, r1, k, sp, gp, vp, op), r)
    return out


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`foursight.nvfp4.dequantize_nvfp4` in one native pass on the CPU (:func:`dequantize_rows`,
    bit-identical), else the eager one: what the CPU execution form of every re-quantized layer takes
    (``foursight.dispatch``; the numerics below it stay plain PyTorch)."""
    if packed.device.type == "cpu":
        out = dequantize_rows(packed, scale, global_scale)
        if out is not None:
            return out.to(dtype)
    return eager_dequantize_nvfp4(packed, scale, global_scale, dtype)
