"""The dense ``X[:, S]`` copy of the quantizer split over programs per row (``q_split``,
:func:`foursight.kernels.act_quant._act_quant_row_part`), under the Triton interpreter (CPU).

Each of the ``COLS`` parts of a row copies its share of the ``KS`` channels (issue 36, docs/kernels.md
"Next, in order" item 1), so the copy must still equal ``x[:, S]`` exactly, for ``KS`` not a multiple
of the parts, fewer channels than parts, none, more than one tile (``KS > 256``), several rows, a row
stride that is not ``K`` and a column stride that is not 1; and the other outputs (codes, scale
bytes, global scales, ``q*s``) must equal the one-program-per-row quantizer's bit for bit. Every
output starts poisoned (NaN / 0xAB), so an element nobody writes fails. The last test launches part
0 alone: it writes its share and nothing else (the copy is spread, not done by part 0).

About 10 s in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import triton  # noqa: E402

import foursight.kernels.act_quant as fk_aq  # noqa: E402
from foursight.layer import channel_mask  # noqa: E402

pytestmark = interpreted_only

_REAL_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    t = _REAL_EMPTY(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else 0xAB)


def _launch(monkeypatch, x, ch, gs, cols):
    """``act_quant_launch`` as the fragment form calls it (kernels.api: packed, ``q*s``, ``X[:, S]``),
    its outputs allocated poisoned."""
    with monkeypatch.context() as mp:
        mp.setattr(torch, "empty", _poisoned_empty)
        return fk_aq.act_quant_launch(x, channel_mask(ch, x.shape[1]), ch, gs, True, True, True,
                                      deq_dtype=torch.bfloat16, cols=cols)


def _inputs(m: int, k: int, ks: int, seed: int, layout: str):
    g = torch.Generator().manual_seed(seed)
    ch = torch.sort(torch.randperm(k, generator=g)[:ks]).values.to(torch.int32)
    wide = (torch.randn(m, 3 * k + 5, generator=g) * 4.0).bfloat16()
    if layout == "contiguous":
        x = wide[:, :k].contiguous()
    elif layout == "row_stride":  # rows 3K + 5 apart
        x = wide[:, 7:7 + k]
    else:  # "col_stride": columns 3 apart as well
        x = wide[:, 1:1 + 3 * k:3]
    return x, ch


@pytest.mark.parametrize(("k", "ks", "cols", "layout", "static"), [
    (400, 37, 8, "row_stride", False),  # KS not a multiple of the parts
    (400, 3, 8, "contiguous", False),  # fewer channels than parts
    (256, 5, 16, "col_stride", True),  # fewer channels than parts, 16 parts, static scale
    (400, 0, 4, "row_stride", False),  # no channels
    (400, 128, 8, "contiguous", True),  # the shipped k = 128, 8 parts
    (512, 300, 4, "col_stride", False),  # more than one tile of 256 per row (the tail loop)
    (512, 300, 16, "row_stride", False),
])
def test_split_xs_copy_and_outputs(monkeypatch, k, ks, cols, layout, static):
    x, ch = _inputs(3, k, ks, seed=k * 1000 + ks * 10 + cols, layout=layout)
    assert not x.is_contiguous() or layout == "contiguous"
    gs = torch.tensor([5.0]) if static else None
    one = _launch(monkeypatch, x, ch, gs, cols=1)
    many = _launch(monkeypatch, x, ch, gs, cols=cols)
    ref = x[:, ch.long()]  # independent of the kernels
    assert many[4].shape == ref.shape and many[4].dtype == x.dtype
    assert torch.equal(many[4], ref), "X[:, S] copy of the split quantizer"
    assert torch.equal(one[4], ref), "X[:, S] copy of the one-program quantizer"
    for a, b, what in zip(one[:4], many[:4], ("packed", "scale", "q*s", "global scale")):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), what


def test_part_zero_alone_writes_only_its_share():
    """Launch only part 0 of 8 (grid (M, 1)): it writes ``BLOCK_KS / 8`` channels of each row's copy
    and leaves the rest untouched (before issue 36's item 1, part 0 copied the whole row)."""
    m, k, ks, cols = 2, 256, 100, 8
    x, ch = _inputs(m, k, ks, seed=1, layout="row_stride")
    block_ks = 128  # the launcher's: next power of two of KS, 16..256
    gs = torch.empty(m)
    xs = torch.full((m, ks), float("nan"), dtype=x.dtype)
    dummy = torch.empty(1)
    fk_aq.act_quant_kernel[(m, 1)](
        x, x.stride(0), x.stride(1), channel_mask(ch, k), ch, gs,
        dummy, dummy, dummy, gs, xs, k, ks,
        BLOCK_K=triton.next_power_of_2(k), ONE_PASS=True, HAS_CH=True, STATIC_GS=False,
        WRITE_PACKED=False, WRITE_DEQ=False, WRITE_XS=True, BLOCK_KS=block_ks, DIV6_RECIP=False,
        COLS=cols, num_warps=4,
    )
    share = block_ks // cols
    assert torch.equal(xs[:, :share], x[:, ch[:share].long()])
    assert xs[:, share:].isnan().all(), "part 0 wrote beyond its share"
