"""Issue 52 item 2 under the Triton interpreter (CPU): the fragment tile whose activation rows >= M are
zero-filled copies (``FragmentConfig.zfill``), with 16 and 8 token rows, against the plain fragment tile and
the PyTorch reference (``reference_linear``).

* M = 1..4 and 16 (and 5, 9: an 8-row tile then runs two and more token tiles), k = 0 and k > 0, W4A4
  with a dynamic and a static activation scale and W4A16;
* the 16-row form gives the plain 16-row tile's output bit for bit (the same products in the same order;
  the rows it zero-fills are never stored); every form is within fp32-accumulation tolerance of the
  reference;
* the candidate lists: the zfill tiles are never first, an 8-row tile is a candidate only at M <= 4 (the
  autotuner's decode buckets up to 4 are one M each), tags parse back, bad combinations are refused.

The register-operand form of the BF16 columns (issue 52 item 2, second half) is not built: plain Triton
moves the operand's conversion to where it is loaded (docs/kernels.md, "Triton quick wins").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import foursight.kernels.api as fk  # noqa: E402
from foursight.kernels import configs  # noqa: E402
from foursight.kernels.configs import FragmentConfig  # noqa: E402
from helpers.kernel_cases import activation, assert_close_to_reference, quantized_layer  # noqa: E402
from foursight.layer import reference_linear  # noqa: E402

pytestmark = interpreted_only

N, K = 130, 400


@pytest.fixture(scope="module", params=[0, 96], ids=["k0", "k96"])
def layer(request):
    return quantized_layer(N, K, request.param, seed=52)


def _act(m: int, g: torch.Generator) -> torch.Tensor:
    return activation(m, K, g)


ZFILL16 = FragmentConfig(16, 64, 128, 1, 0, zfill=True)
CASES = [
    *[(ZFILL16, m) for m in (1, 2, 3, 4, 16)],
    *[(FragmentConfig(8, 64, 128, 1, 0, zfill=True), m) for m in (1, 2, 3, 4, 5, 9, 16)],
    *[(FragmentConfig(8, 64, 128, 1, 3, cols_late=True, zfill=True), m) for m in (1, 4, 9)],
    *[(FragmentConfig(8, 64, 256, 1, 0, q_split=4, zfill=True), m) for m in (1, 3)],
]


@pytest.mark.parametrize("cfg,m", CASES, ids=lambda v: str(v))
def test_zfill_tiles_against_the_reference(layer, cfg, m):
    qw, pw, g = layer
    x = _act(m, g)
    bias = torch.randn(N, generator=g).bfloat16()
    gs = torch.tensor([17.0])
    plain = FragmentConfig(16, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.split_k, cols_late=cfg.cols_late)
    for kw in ({}, {"input_global_scale": gs}):  # dynamic, static activation scale
        y = fk.splice_linear(x, pw, bias=bias, config=cfg, **kw)
        assert_close_to_reference(y, reference_linear(x, qw, bias=bias, out_dtype=torch.float32, **kw))
        if cfg.block_m == 16:
            assert torch.equal(y, fk.splice_linear(x, pw, bias=bias, config=plain, **kw)), f"{cfg} differs from {plain} ({kw})"
    y16 = fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=cfg)  # W4A16
    assert_close_to_reference(y16, reference_linear(x, qw, bias=bias, act_quant=False, out_dtype=torch.float32))
    if cfg.block_m == 16:
        assert torch.equal(y16, fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=plain))


def test_zfill_candidates():
    from helpers.kernel_switches import kernel_switches

    assert set(configs.ZFILL_CONFIGS) <= set(configs.DECODE_CONFIGS)
    assert configs.DECODE_CONFIGS[0] not in configs.ZFILL_CONFIGS  # first-candidate rule: never first
    with kernel_switches(FOURSIGHT_WS=None, FOURSIGHT_STREAM=None):
        for m in (1, 2, 3, 4, 5, 8, 16):
            cands = fk.candidates("decode", m, "linear")
            eight = [c for c in cands if c.block_m == 8]
            assert bool(eight) == (m <= 4), (m, [str(c) for c in eight])
            assert any(c.zfill and c.block_m == 16 for c in cands)
    for c in configs.ZFILL_CONFIGS:
        assert configs.config_from_str(str(c)) == c
        assert not (c.narrow or c.quant_in)
    # the tags recorded before the field existed stay as they were
    assert str(FragmentConfig(16, 64, 256, 3, max_regs=128, narrow=True, q_split=8)) == "fragment/16/64/256/3/0/128/4/True/False/False/8"
    assert str(configs.COLUMNS_LATE_CONFIGS[1]) == "fragment/64/64/128/3/0/0/4/False/False/False/8/True"
    assert str(dataclasses.replace(ZFILL16, cols_late=True)).endswith("/True/True")
    for bad in (dict(block_m=8), dict(zfill=True, narrow=True), dict(zfill=True, quant_in=True, narrow=True)):
        with pytest.raises(ValueError, match="zfill"):
            FragmentConfig(**{"block_m": 16, "block_n": 64, **bad})
