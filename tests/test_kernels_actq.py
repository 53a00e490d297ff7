"""Adversarial bit-exactness tests of the fused NVFP4 activation quantization kernel (kernels/act_quant.py).

Run under TRITON_INTERPRET=1 on CPU, like tests/test_kernels.py, against the PyTorch oracle
:func:`foursight.layer.quantize_activation` (packed codes, E4M3 scale bytes, global scales, gathered
channels) and against ``q * s`` for the fp16 ``deq`` output:

* the E2M1 rounding helpers through tiny test kernels: every code, a dense sweep of q in [-7, 7],
  every fp32 value within 64 ulps of each decision point and grid value, +-0, subnormals, huge;
* ``quant_block`` (1-D, used by the fused GEMV) and ``quant_block_2d`` on their own, both
  ``DIV6_RECIP`` settings (True checked against a CPU emulation of PyTorch-on-CUDA's ``/ 6.0``);
* the kernel on inputs built to sit exactly on, and one ulp either side of, the E2M1 decision
  points relative to their block scale; -0.0; zero blocks and rows; a single huge value per row;
  subnormal bf16; the largest finite bf16/fp32; fp16/fp32; K = 16 and K not a power of two;
  the two-pass path; several rows per program (``ROWS``), with M not a multiple of ROWS.
"""

from __future__ import annotations

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import foursight.kernels.api as fk  # noqa: E402
from foursight.kernels.act_quant import act_quant_kernel  # noqa: E402
from foursight.kernels.primitives import (  # noqa: E402
    MAX_ONEPASS_K,
    e2m1_code,
    e2m1_round,
    e2m1_value,
    quant_block,
    quant_block_2d,
)

from foursight.layer import check_channels, quantize_activation
from foursight.nvfp4 import E2M1_VALUES, e2m1_codes, quantize_nvfp4, unpack_fp4

pytestmark = interpreted_only

DECISION_POINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
GRID_VALUES = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _ulps_around(values, n: int) -> torch.Tensor:
    """Every fp32 within ``n`` ulps of each value (and the negatives)."""
    b = torch.tensor(values, dtype=torch.float32).view(torch.int32)
    out = (b[:, None] + torch.arange(-n, n + 1, dtype=torch.int32)[None, :]).reshape(-1).view(torch.float32)
    return torch.cat([out, -out])


# ---------------------------------------------------------------------------------------------
# E2M1 helpers through tiny kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_probe(q_ptr, code_ptr, val_ptr, code2_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    q = tl.load(q_ptr + offs, mask=m, other=0.0)
    code, val = e2m1_round(q)
    tl.store(code_ptr + offs, code, mask=m)
    tl.store(val_ptr + offs, val, mask=m)
    tl.store(code2_ptr + offs, e2m1_code(q), mask=m)


@triton.jit
def _value_probe(code_ptr, val_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(val_ptr + offs, e2m1_value(tl.load(code_ptr + offs)))


def _round(q: torch.Tensor):
    q = q.float().contiguous()
    n = q.numel()
    code = torch.empty(n, dtype=torch.int32)
    val = torch.empty(n, dtype=torch.float32)
    code2 = torch.empty(n, dtype=torch.int32)
    blk = 4096
    _round_probe[(triton.cdiv(n, blk),)](q, code, val, code2, n, BLOCK=blk)
    return code, val, code2


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.float().contiguous().view(torch.int32), b.float().contiguous().view(torch.int32))


def test_e2m1_value_all_16_codes():
    codes = torch.arange(16, dtype=torch.int32)
    val = torch.empty(16, dtype=torch.float32)
    _value_probe[(1,)](codes, val, BLOCK=16)
    assert _same_bits(val, E2M1_VALUES)  # bitwise: -0.0 for code 8


def test_e2m1_round_matches_oracle_dense_and_adversarial():
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754943508222875e-38, -1.1754943508222875e-38])
    huge = torch.tensor([6.0, -6.0, 7.0, -7.0, 1e30, -1e30, 3.4028234663852886e38, -3.4028234663852886e38,
                         float("inf"), float("-inf")])
    q = torch.cat([
        torch.linspace(-7.0, 7.0, 280_001),  # dense sweep (step 5e-5) of [-7, 7]
        _ulps_around(DECISION_POINTS + GRID_VALUES + [0.125], 64),
        torch.randn(20_000, generator=torch.Generator().manual_seed(5)) * 3.0,
        tiny, huge,
    ])
    code, val, code2 = _round(q)
    ref = e2m1_codes(torch.clamp(q, -6.0, 6.0)).to(torch.int32)
    assert torch.equal(code, ref)
    assert torch.equal(code2, ref)
    assert _same_bits(val, E2M1_VALUES[ref.long()])


def test_e2m1_round_every_code_and_ties():
    # the decision points themselves: ties to even, both signs
    q = torch.tensor(DECISION_POINTS + [-t for t in DECISION_POINTS] + GRID_VALUES + [-v for v in GRID_VALUES] + [0.0, -0.0])
    code, val, _ = _round(q)
    expect = [0, 2, 2, 4, 4, 6, 6]  # 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert code[:7].tolist() == expect
    assert code[7:14].tolist() == [c | 8 for c in expect]
    assert code[14:21].tolist() == list(range(1, 8))
    assert code[21:28].tolist() == list(range(9, 16))
    assert code[28:].tolist() == [0, 8]
    assert sorted(set(code.tolist())) == list(range(16))
    assert _same_bits(val, E2M1_VALUES[code.long()])


# ---------------------------------------------------------------------------------------------
# quant_block (1-D) and quant_block_2d on their own
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_probe(x_ptr, gs_ptr, p_ptr, s_ptr, d_ptr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    packed, sbyte, deq = quant_block(tl.load(x_ptr + offs), tl.load(gs_ptr), BLOCK, DIV6_RECIP)
    tl.store(p_ptr + tl.arange(0, BLOCK // 2), packed)
    tl.store(s_ptr + tl.arange(0, BLOCK // 16), sbyte)
    tl.store(d_ptr + offs, deq)


@triton.jit
def _block2d_probe(x_ptr, gs_ptr, p_ptr, s_ptr, d_ptr, R: tl.constexpr, BLOCK: tl.constexpr, DIV6_RECIP: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    packed, sbyte, deq = quant_block_2d(tl.load(x_ptr + r * BLOCK + offs), tl.load(gs_ptr + tl.arange(0, R)), R, BLOCK, DIV6_RECIP)
    tl.store(p_ptr + r * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :], packed)
    tl.store(s_ptr + r * (BLOCK // 16) + tl.arange(0, BLOCK // 16)[None, :], sbyte)
    tl.store(d_ptr + r * BLOCK + offs, deq)


def _cuda_like_reference(x: torch.Tensor, gs: torch.Tensor):
    """The oracle's packed/scale with ``block_amax / 6`` done as PyTorch does it on CUDA
    (``amax * fp32(1/6)``), emulated on CPU; ``x`` [R, K] fp32, ``gs`` [R, 1]."""
    r, k = x.shape
    amax = x.abs().reshape(r, k // 16, 16).amax(-1)
    s = gs * (amax * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    s = torch.clamp(s, max=448.0).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.full_like(s, 0.125), s)
    eff = (s / gs).repeat_interleave(16, dim=1)
    codes = e2m1_codes(torch.clamp(x / eff, -6.0, 6.0))
    packed = (codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)
    return packed, s.to(torch.float8_e4m3fn).view(torch.uint8)


def _deq_ref(packed: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    q = E2M1_VALUES[unpack_fp4(packed).long()]
    return q * scale_u8.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1)


def _block_rows(R: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, K, generator=g) * torch.exp(2 * torch.randn(R, K // 16, 1, generator=g)).repeat(1, 1, 16).reshape(R, K))
    x = x.bfloat16().float()
    x[0, :16] = 0.0  # a zero block
    x[0, 16] = -0.0
    x[-1, 32:48] = 1e-30  # an E4M3-subnormal scale
    return x


@pytest.mark.parametrize("div6_recip", [False, True])
def test_quant_block_1d_and_2d(div6_recip):
    R, K = 4, 256
    x = _block_rows(R, K, 11 + div6_recip)
    gs = torch.tensor([448.0 / 3.0, 37.5, 2688.0 / float(x[2].abs().max()), 1e5], dtype=torch.float32)
    if div6_recip:
        ref_p, ref_s = _cuda_like_reference(x, gs[:, None])
    else:
        ref_p, ref_s8 = quantize_nvfp4(x, gs[:, None])
        ref_s = ref_s8.view(torch.uint8)
    ref_d = _deq_ref(ref_p, ref_s)
    # 1-D helper, one row at a time (the fused GEMV calls it like this on a chunk)
    for i in range(R):
        p = torch.empty(K // 2, dtype=torch.int32)
        s = torch.empty(K // 16, dtype=torch.int32)
        d = torch.empty(K, dtype=torch.float32)
        _block_probe[(1,)](x[i].contiguous(), gs[i:i + 1].contiguous(), p, s, d, BLOCK=K, DIV6_RECIP=div6_recip)
        assert torch.equal(p.to(torch.uint8), ref_p[i])
        assert torch.equal(s.to(torch.uint8), ref_s[i])
        assert _same_bits(d, ref_d[i])
    # 2-D helper, all rows at once
    p = torch.empty(R, K // 2, dtype=torch.int32)
    s = torch.empty(R, K // 16, dtype=torch.int32)
    d = torch.empty(R, K, dtype=torch.float32)
    _block2d_probe[(1,)](x.contiguous(), gs, p, s, d, R=R, BLOCK=K, DIV6_RECIP=div6_recip)
    assert torch.equal(p.to(torch.uint8), ref_p)
    assert torch.equal(s.to(torch.uint8), ref_s)
    assert _same_bits(d, ref_d)


def test_quant_block_div6_recip_decides_the_scale():
    """Blocks whose E4M3 scale differs between ``amax / 6`` (CPU) and ``amax * fp32(1/6)`` (CUDA):
    each DIV6_RECIP setting must follow its own reference."""
    g = torch.Generator().manual_seed(17)
    gs = torch.tensor([1.0], dtype=torch.float32)
    # block amaxes within 64 ulps of 6x an E4M3 rounding midpoint (m + 1/2) * 2^(e-3)
    mids = torch.tensor([(m + 0.5) * 2.0 ** (e - 3) for e in range(-6, 8) for m in range(8, 16)], dtype=torch.float32)
    base = (mids.double() * 6.0).float().view(torch.int32)
    a = (base[:, None] + torch.arange(-64, 65, dtype=torch.int32)).reshape(-1).view(torch.float32)
    s_div = torch.clamp(gs * (a / 6.0), max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    s_rcp = torch.clamp(gs * (a * torch.tensor(1.0 / 6.0, dtype=torch.float32)), max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    hits = a[s_div != s_rcp]
    assert hits.numel() >= 8
    amax = torch.cat([hits, torch.rand(16, generator=g) * 10 + 0.1])[:16]
    x = torch.rand(16, 16, generator=g) * amax[:, None] * 0.99
    x[:, 5] = amax
    x = x.reshape(1, 256)
    for div6_recip in (False, True):
        if div6_recip:
            ref_p, ref_s = _cuda_like_reference(x, gs[:, None])
        else:
            ref_p, ref_s8 = quantize_nvfp4(x, gs[:, None])
            ref_s = ref_s8.view(torch.uint8)
        p = torch.empty(128, dtype=torch.int32)
        s = torch.empty(16, dtype=torch.int32)
        d = torch.empty(256, dtype=torch.float32)
        _block_probe[(1,)](x[0].contiguous(), gs, p, s, d, BLOCK=256, DIV6_RECIP=div6_recip)
        assert torch.equal(s.to(torch.uint8), ref_s[0])
        assert torch.equal(p.to(torch.uint8), ref_p[0])
        assert _same_bits(d, _deq_ref(ref_p, ref_s)[0])


# ---------------------------------------------------------------------------------------------
# the kernel, through a launcher that mirrors kernels/act_quant.py::act_quant_launch (plus ROWS)
# ---------------------------------------------------------------------------------------------


def _launch(x, channels, global_scale=None, rows=1, max_onepass=MAX_ONEPASS_K):
    m, k_dim = x.shape
    ch = check_channels(channels, k_dim)
    kk = ch.numel()
    mask = torch.zeros(k_dim, dtype=torch.uint8)
    if kk:
        mask[ch.long()] = 1
    # poisoned outputs: every element must be written
    packed = torch.full((m, k_dim // 2), 0xAB, dtype=torch.uint8)
    scale = torch.full((m, k_dim // 16), 0xAB, dtype=torch.uint8)
    deq = torch.full((m, k_dim), float("nan"), dtype=torch.float16)
    gs_out = torch.full((m,), float("nan"), dtype=torch.float32)
    xs = torch.full((m, kk), float("nan"), dtype=x.dtype)
    gs_in = global_scale.reshape(-1).float() if global_scale is not None else gs_out
    one_pass = k_dim <= max_onepass
    block_k = triton.next_power_of_2(k_dim) if one_pass else 4096
    extra = {} if rows == 1 else {"M": m, "ROWS": rows}
    act_quant_kernel[(triton.cdiv(m, rows),)](
        x, x.stride(0), x.stride(1),
        mask, ch if kk else mask, gs_in,
        packed, scale, deq, gs_out, xs if kk else gs_out,
        k_dim, kk,
        BLOCK_K=block_k, ONE_PASS=one_pass, HAS_CH=kk > 0, STATIC_GS=global_scale is not None,
        WRITE_PACKED=True, WRITE_DEQ=True, WRITE_XS=kk > 0,
        BLOCK_KS=min(256, max(16, triton.next_power_of_2(max(kk, 1)))),
        DIV6_RECIP=False, num_warps=4, **extra,
    )
    return packed, scale, deq, gs_out, xs


def _check_all(x, channels, global_scale=None, rows=(1,), max_onepass=MAX_ONEPASS_K):
    channels = torch.as_tensor(channels, dtype=torch.int32)
    ref = quantize_activation(x, channels, global_scale)
    ref_d = _deq_ref(ref.packed, ref.scale.view(torch.uint8)).half()
    for r in rows:
        packed, scale, deq, gs, xs = _launch(x, channels, global_scale, r, max_onepass)
        assert torch.equal(packed, ref.packed), f"packed codes differ (ROWS={r})"
        assert torch.equal(scale, ref.scale.view(torch.uint8)), f"E4M3 scale bytes differ (ROWS={r})"
        assert _same_bits(gs, ref.global_scale), f"global scales differ (ROWS={r})"
        assert _same_bits(deq, ref_d), f"deq differs from q*s (ROWS={r})"
        if channels.numel():
            assert xs.dtype == ref.x_bf16.dtype and torch.equal(xs, ref.x_bf16), f"gathered channels differ (ROWS={r})"
    # and the public entry point (foursight.kernels.quantize_activation)
    a = fk.quantize_activation(x, channels, global_scale)
    assert torch.equal(a.packed, ref.packed) and torch.equal(a.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert _same_bits(a.global_scale, ref.global_scale)


def _on_decision_points(K: int, gs: float, seed: int) -> torch.Tensor:
    """fp32 rows whose elements sit exactly on, and 1-3 ulps around, ``T * eff`` for every E2M1
    decision point T of their block (both signs), each block's scale set by its first element."""
    g = torch.Generator().manual_seed(seed)
    nb = K // 16
    # block amax A: s = gs * A / 6 spread over the E4M3 normal range (and a few subnormal scales)
    s_target = torch.exp2(torch.empty(nb).uniform_(-8.0, 8.6, generator=g))
    amax = (s_target * 6.0 / gs).float()
    x = torch.zeros(nb, 16)
    x[:, 0] = amax
    # the oracle's eff for these blocks (same ops as foursight.nvfp4)
    ref_s = quantize_nvfp4(x, torch.tensor([[gs]]))[1].float()
    eff = ref_s / torch.tensor(gs, dtype=torch.float32)  # [1, nb]
    eff = eff.reshape(nb, 1)
    t = torch.tensor(DECISION_POINTS, dtype=torch.float32)[torch.randint(0, 7, (nb, 15), generator=g)]
    base = (t.double() * eff.double()).float()  # RN(T * eff)
    dk = torch.randint(-3, 4, (nb, 15), generator=g, dtype=torch.int32)
    cand = (base.view(torch.int32) + dk).view(torch.float32)
    cand = torch.minimum(cand, amax[:, None])  # keep the block amax (and so the scale) unchanged
    sign = torch.where(torch.rand(nb, 15, generator=g) < 0.5, -1.0, 1.0)
    x[:, 1:] = cand * sign
    return x.reshape(1, K)


def test_kernel_exact_on_and_around_decision_points():
    # static scales: the oracle's eff is known, so elements can be put exactly on T * eff
    rows = []
    for i, gs in enumerate([448.0, 37.5, 1.0, 3.0e4, 0.013]):
        rows.append(_on_decision_points(512, gs, 100 + i))
    for i, gs in enumerate([448.0, 37.5, 1.0, 3.0e4, 0.013]):
        x = rows[i]
        q = x.reshape(-1, 16)
        assert (q != 0).sum() > 400
        _check_all(x, [], torch.tensor([gs]), rows=(1,))
    # the same rows together, dynamic scale (the row amax is one of the block amaxes)
    x = torch.cat(rows)
    _check_all(x, [3, 17, 300], None, rows=(1, 2, 8))


def test_kernel_ties_hit_by_real_bf16_rows():
    """Gaussian bf16 rows with a dynamic scale put ~0.1 % of their elements within a few ulps of a
    decision point (x/amax and 2688/s are short fractions): the exact division must decide them."""
    g = torch.Generator().manual_seed(21)
    K = 1024
    x = (torch.randn(24, K, generator=g) * torch.exp(torch.randn(1, K, generator=g))).bfloat16()
    ref = quantize_activation(x, torch.tensor([], dtype=torch.int32))
    # how many quotients are within 4 ulps of a decision point (the test is meaningful only if some are)
    eff = (ref.scale.float() / ref.global_scale[:, None]).repeat_interleave(16, dim=1)
    q = torch.clamp(x.float() / eff, -6, 6).abs().view(torch.int32)
    tb = torch.tensor(DECISION_POINTS).view(torch.int32)
    near = ((q[..., None] - tb).abs() <= 4).any(-1).sum().item()
    assert near >= 5
    _check_all(x, [1, 2, 500], None, rows=(1, 4))


def test_kernel_signed_zeros_zero_blocks_and_rows():
    x = torch.zeros(6, 64)
    x[0] = -0.0  # an all -0 row: codes 8, gs 1.0
    x[1, :16] = torch.tensor([-0.0, 0.0] * 8)
    x[1, 16:32] = torch.linspace(-2, 2, 16)
    x[1, 20] = -1e-20  # rounds to 0 with its sign kept: code 8
    x[1, 21] = -0.0
    x[2, 32:48] = torch.linspace(-1e-3, 1e-3, 16)  # one non-zero block in a row of zeros
    x[3] = 5.0  # constant row
    x[4, 0] = -6.0  # a single value
    # row 5 stays all +0
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        _check_all(x.to(dt), [], None, rows=(1, 4))
        _check_all(x.to(dt), [0, 20, 63], None, rows=(2,))
        _check_all(x.to(dt), [], torch.tensor([448.0]), rows=(1, 8))


def test_kernel_single_huge_value_and_extremes():
    g = torch.Generator().manual_seed(3)
    bf16_max = torch.finfo(torch.bfloat16).max
    f32_max = torch.finfo(torch.float32).max
    x = torch.randn(6, 96, generator=g)
    x[0, 7] = 3.0e4  # one big value: the other blocks get small, E4M3-subnormal or zero scales
    x[1, 50] = -1e30
    x[2, 3] = bf16_max  # the largest finite bf16: gs = 2688 / max
    x[2, 90] = -bf16_max
    x[3] = -bf16_max
    x[4, :16] = bf16_max
    x[5, ::7] = 1e-30
    for dt in (torch.bfloat16, torch.float32):
        _check_all(x.to(dt), [], None, rows=(1, 2))
        _check_all(x.to(dt), [7, 50], None, rows=(1,))
    xf = x.clone()
    xf[0, 0] = f32_max  # the largest finite fp32
    xf[1, 1] = -f32_max
    _check_all(xf, [], None, rows=(1, 4))
    _check_all(xf, [], torch.tensor([1e-30]), rows=(1,))  # eff huge: q tiny
    _check_all(x, [], torch.tensor([3.0e30]), rows=(1,))  # eff tiny: q saturates


def test_kernel_subnormal_bf16_inputs():
    tiny = torch.finfo(torch.bfloat16).tiny  # 2^-126
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 80, generator=g) * tiny * 0.01  # bf16 subnormals
    x[1] = x[1] * 100.0  # around the normal/subnormal edge
    x[2, :40] = 1e-40  # mixed with zeros
    x[2, 40:] = 0.0
    x[3, 0] = 1.0e-2  # one normal value: the subnormal ones get tiny E4M3 scales relative to it
    x[4, :16] = tiny  # exactly the smallest normal
    xb = x.bfloat16()
    assert (xb.float().abs() < tiny).sum() > 100
    _check_all(xb, [], None, rows=(1, 2))
    _check_all(xb, [5, 6, 79], None, rows=(4,))
    _check_all(xb, [], torch.tensor([2.0**100]), rows=(1,))  # a static scale that brings them up


@pytest.mark.parametrize("K", [16, 48, 80, 208, 1040])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_shapes_and_dtypes(K, dtype):
    g = torch.Generator().manual_seed(K)
    M = 5
    x = (torch.randn(M, K, generator=g) * torch.exp(torch.randn(1, K, generator=g))).to(dtype)
    ch = torch.sort(torch.randperm(K, generator=g)[: K // 8]).values.to(torch.int32)
    _check_all(x, ch, None, rows=(1, 2, 4))
    _check_all(x, [], torch.tensor([37.5]), rows=(1, 8))


def test_kernel_non_contiguous_input():
    g = torch.Generator().manual_seed(4)
    base = (torch.randn(160, 9, generator=g) * 3).bfloat16()
    x = base.t()  # [9, 160], stride (1, 9)
    _check_all(x, [2, 100], None, rows=(1, 4))


def test_kernel_two_pass_path_with_rows():
    """K above the one-pass limit: amax pass then quantize pass, with a ragged last chunk."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 4160, generator=g) * torch.exp(torch.randn(1, 4160, generator=g))).bfloat16()
    x[1, 4100] = 900.0  # the row amax in the ragged last chunk
    for gs in (None, torch.tensor([11.0])):
        _check_all(x, [0, 4159], gs, rows=(1, 2), max_onepass=32)


def test_reciprocal_multiply_is_corrected_where_a_plain_one_would_differ():
    """The quantizer multiplies by a per-block reciprocal instead of dividing per element
    (``quant_elems``: two Newton-Markstein FMA steps). On rows built around every decision point,
    with static scales from 2^-100 to 2^100 (E4M3-subnormal block scales, effective scales far
    outside [2^-60, 2^60] that take the power-of-two rescale), a plain ``x * RN(1/eff)`` gives a
    different E2M1 code for some elements — checked here, so the rows do exercise the correction —
    and the kernel still matches the oracle's division bit for bit."""
    differing = 0
    for i, gs in enumerate([2.0**-100, 1e-30, 0.013, 1.0, 37.5, 448.0, 3.0e4, 1e30, 2.0**100]):
        x = torch.cat([_on_decision_points(1024, gs, 500 + 7 * i + j) for j in range(3)])
        ref = quantize_activation(x, torch.tensor([], dtype=torch.int32), torch.tensor([gs]))
        eff = (ref.scale.float() / torch.tensor(gs, dtype=torch.float32)).repeat_interleave(16, dim=1)
        naive = e2m1_codes(torch.clamp(x * (1.0 / eff), -6, 6))
        exact = unpack_fp4(ref.packed)
        differing += int((naive != exact).sum())
        _check_all(x, [], torch.tensor([gs]), rows=(1, 4))
    assert differing > 0, "no element where a plain reciprocal multiply differs: the test would not catch it"
