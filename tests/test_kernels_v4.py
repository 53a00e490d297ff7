"""SpliceGEMM v4 (issue 36) under the Triton interpreter (CPU): every new form against the plain fragment
tile and the PyTorch reference.

* the issue-36 options of :class:`FragmentConfig` (``narrow`` activation tile, ``quant_in``: the
  activation quantized inside the GEMM, ``persistent`` programs, 8 warps, ``q_split``: the standalone
  quantizer over several programs per row) give output *bit-identical* to the plain tile (the same
  arithmetic in the same order) and within fp32-accumulation tolerance of ``reference_linear``;
* the BF16 columns loaded before the FP4 loop cover every column once, for split counts whose share is
  one preloaded step, more than one, or none;
* the BF16 columns loaded after the FP4 loop (``cols_late``) give the preloaded tile's output bit for bit
  where both plans run each split's columns as one step of the same width, and are within tolerance of
  the reference everywhere (W4A4, W4A16, shares of one step, several, none); their segment plan covers
  every column once; a dense ``X[:, S]`` (``fragment_launch(xs=...)``) gives the gather's output bit for
  bit; the ``cols_late`` candidates are never first and leave the other tiles' tags unchanged;
* the quantizer split over programs is bit-exact (codes, scale bytes, global scales, ``q*s``, ``X[:, S]``);
* the linear compiles with ``torch.compile(fullgraph=True, dynamic=True)`` as one custom op and gives
  eager's output;
* the timer's flush modes, PDL off by default, the experimental Gluon form out of the default
  candidates, the first-candidate rule, configuration tags that parse back.

Small shapes (rows of a 16-row tile or two): the interpreter's cost grows with the programs a launch runs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import foursight.kernels.api as fk  # noqa: E402
import foursight.kernels.act_quant as fk_aq  # noqa: E402
import foursight.kernels.fragment as fk_fragment  # noqa: E402
from foursight.kernels import configs  # noqa: E402
from foursight.kernels.configs import FragmentConfig  # noqa: E402
from foursight.kernels.fragment import fragment_launch  # noqa: E402
from foursight.kernels.split_k import segment_plan, split_plan  # noqa: E402
from helpers.kernel_cases import activation, assert_close_to_reference, quantized_layer  # noqa: E402
from foursight.layer import channel_mask, quantize_activation, quantize_weight, reference_linear  # noqa: E402

pytestmark = interpreted_only

N, K, KS = 130, 400, 128


@pytest.fixture(scope="module")
def layer():
    return quantized_layer(N, K, KS, seed=36)


def _act(m: int, g: torch.Generator) -> torch.Tensor:
    return activation(m, K, g)


PLAIN = FragmentConfig(16, 64, 128, 1, 0)
NEW_FORMS = [
    FragmentConfig(16, 64, 128, 1, 0, narrow=True),
    FragmentConfig(16, 64, 128, 1, 0, narrow=True, quant_in=True),
    FragmentConfig(16, 64, 128, 1, 0, persistent=True),
    FragmentConfig(16, 64, 128, 1, 3, narrow=True, persistent=True),
    FragmentConfig(16, 128, 128, 1, 0, num_warps=8),
    FragmentConfig(16, 64, 128, 1, 0, q_split=4),
]


@pytest.mark.parametrize("cfg", NEW_FORMS, ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_new_fragment_forms_equal_the_plain_tile(layer, cfg, m):
    qw, pw, g = layer
    x = _act(m, g)
    bias = torch.randn(N, generator=g).bfloat16()
    gs = torch.tensor([17.0])
    for kw, ref_kw in (({}, {}), ({"input_global_scale": gs}, {"input_global_scale": gs})):  # dynamic, static scale
        base = cfg if not cfg.num_warps == 8 else FragmentConfig(16, 128, 128, 1, 0)
        plain = FragmentConfig(base.block_m, base.block_n, base.block_k, base.num_stages, base.split_k)
        y0 = fk.splice_linear(x, pw, bias=bias, config=plain, **kw)
        y = fk.splice_linear(x, pw, bias=bias, config=cfg, **kw)
        assert torch.equal(y, y0), f"{cfg} differs from {plain} ({kw})"
        assert_close_to_reference(y, reference_linear(x, qw, bias=bias, out_dtype=torch.float32, **ref_kw))
    y16 = fk.splice_gemm(x, pw, None, out_dtype=torch.float32, config=cfg)  # W4A16: narrow/persistent apply too
    assert torch.equal(y16, fk.splice_gemm(x, pw, None, out_dtype=torch.float32, config=plain))


@pytest.mark.parametrize("cfg", configs.PREFILL_COLS_LATE_CONFIGS, ids=str)
def test_cols_late_prefill_tiles(layer, cfg):
    """Issue 36 item 4's prefill tiles (the columns after the loop; with the quantizer over 8 programs a
    row): within tolerance of the reference with their automatic split plan, and with one split
    bit-identical to the plain 16-row tile with one split and the same column plan (each output's K order
    is the same whatever the tile's shape, and the split quantizer is bit-exact), at M below one tile's
    rows and above them; W4A4 k = 128 (the BF16 columns after the FP4 part) and W4A16.

    Above one tile's rows the same form runs with 16-row tiles (M = 21: two row tiles, the second partial),
    the same code with a smaller ``block_m``: the 128-row tile at M = 133 took 324 s of the interpreter
    with the quantizer over 8 programs a row (1,064 programs a call), the largest test of the suite."""
    qw, pw, g = layer
    for m, tile in ((3, cfg), (21, dataclasses.replace(cfg, block_m=16))):
        _cols_late_case(qw, pw, g, tile, m)


def _cols_late_case(qw, pw, g, cfg, m):
    one = dataclasses.replace(cfg, split_k=1)
    plain = FragmentConfig(16, 64, 128, 1, 1, cols_late=cfg.cols_late)  # one split: the same column steps
    x = _act(m, g)
    bias = torch.randn(N, generator=g).bfloat16()
    y = fk.splice_linear(x, pw, bias=bias, config=cfg)
    assert_close_to_reference(y, reference_linear(x, qw, bias=bias, out_dtype=torch.float32))
    assert torch.equal(fk.splice_linear(x, pw, bias=bias, config=one), fk.splice_linear(x, pw, bias=bias, config=plain)), (cfg, m)
    assert torch.equal(fk.splice_gemm(x, pw, None, out_dtype=torch.float32, config=one),
                       fk.splice_gemm(x, pw, None, out_dtype=torch.float32, config=plain))


def test_quant_in_runs_no_quantizer_launch(layer, monkeypatch):
    """With a static scale at M <= 4 the ``quant_in`` tile quantizes inside the GEMM: the standalone
    quantizer is not launched (and with a dynamic scale, or M > 4, it is)."""
    qw, pw, g = layer
    calls = []
    real = fk_aq.act_quant_launch
    monkeypatch.setattr(fk_aq, "act_quant_launch", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    cfg = FragmentConfig(16, 64, 128, 1, 0, narrow=True, quant_in=True)
    fk.splice_linear(_act(2, g), pw, input_global_scale=torch.tensor([5.0]), config=cfg)
    assert calls == []
    fk.splice_linear(_act(2, g), pw, config=cfg)
    fk.splice_linear(_act(5, g), pw, input_global_scale=torch.tensor([5.0]), config=cfg)
    assert calls == [2, 5]


@pytest.mark.parametrize("late", [False, True], ids=["preloaded", "cols_late"])
@pytest.mark.parametrize("split_k", [1, 2, 3, 8])
def test_bf16_columns_preloaded_cover_every_column(split_k, late):
    """k = 200 BF16 columns over 1 (200 columns: one preloaded step of 32 and six more), 2, 3 and 8
    splits (25 columns: one 32-column step; the last splits have none). ``cols_late``: 1 split (one
    64-column step and three more), 2 (100 -> 112 columns: two steps), 3 (67 -> 80: two steps, the last
    split 40) and 8 (25 -> 32: one step; the last splits have none)."""
    g = torch.Generator().manual_seed(200 + split_k)
    w = torch.randn(64, 1024, generator=g) * 0.05
    ch = torch.sort(torch.randperm(1024, generator=g)[:200]).values.to(torch.int32)
    qw = quantize_weight(w, ch)
    pw = fk.prepare_weight(qw)
    x = (torch.randn(2, 1024, generator=g) * 3).bfloat16()
    cfg = FragmentConfig(16, 64, 128, 1, split_k, cols_late=late)
    y = fk.splice_linear(x, pw, config=cfg)
    assert_close_to_reference(y, reference_linear(x, qw, out_dtype=torch.float32))
    y16 = fk.splice_gemm(x, pw, None, out_dtype=torch.float32, config=cfg)
    ref16 = reference_linear(x, qw, act_quant=False, out_dtype=torch.float32)
    assert (y16 - ref16).abs().max() <= 2e-5 * ref16.abs().max()


@pytest.mark.parametrize("cols", [2, 4, 8])
@pytest.mark.parametrize("static", [False, True])
def test_quantizer_split_over_programs_is_bit_exact(layer, cols, static):
    qw, pw, g = layer
    x = _act(3, g)
    ch = qw.bf16_channels
    gs = torch.tensor([9.0]) if static else None
    one = fk_aq.act_quant_launch(x, channel_mask(ch, K), ch, gs, True, True, True, deq_dtype=torch.bfloat16)
    many = fk_aq.act_quant_launch(x, channel_mask(ch, K), ch, gs, True, True, True, deq_dtype=torch.bfloat16, cols=cols)
    for a, b, what in zip(one, many, ("packed", "scale", "deq", "global scale", "X[:, S]")):
        assert torch.equal(a, b), what
    ref = quantize_activation(x, ch, global_scale=gs)
    assert torch.equal(many[0], ref.packed) and torch.equal(many[1], ref.scale.view(torch.uint8))
    assert torch.equal(many[3], ref.global_scale) and torch.equal(many[4], ref.x_bf16)


def test_fullgraph_compile_calls_one_custom_op(layer):
    """vLLM compiles with fullgraph and a dynamic batch: the linear traces as ``foursight::splice_linear``
    and gives eager's output at every M (aot_eager: no C++ compiler needed)."""
    qw, pw, g = layer
    assert not fk.COMPILE_OP_ERRORS
    torch._dynamo.reset()
    fn = torch.compile(lambda x: fk.splice_linear(x, pw), backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (3, 5):
        x = _act(m, g)
        assert torch.equal(fn(x), fk.splice_linear(x, pw))
    assert fk.OP_HANDLES[pw.op_handle] is pw


def test_timer_flush_modes_and_pdl_default(monkeypatch):
    from foursight.kernels import tuning
    from foursight.kernels.runtime import pdl_supported

    assert tuning.DEFAULT_FLUSH == "read" and set(tuning.FLUSH_MODES) == {"read", "memset", "none"}
    with pytest.raises(ValueError, match="flush"):
        tuning.time_gpu(lambda: None, flush="l2")
    monkeypatch.delenv("FOURSIGHT_PDL", raising=False)
    assert pdl_supported() is False  # off by default (measured a loss on the H200)
    monkeypatch.setenv("FOURSIGHT_PDL", "1")
    import triton.language.extra.cuda as cuda

    assert pdl_supported() is hasattr(cuda, "gdc_wait")


def test_candidate_lists():
    from helpers.kernel_switches import kernel_switches

    with kernel_switches(FOURSIGHT_WS=None, FOURSIGHT_STREAM=None):
        lists = {path: fk.candidates(path, 1, "linear") for path in ("decode", "mid", "prefill")}
    for cands in lists.values():
        assert cands and not any(isinstance(c, configs.WSConfig) for c in cands)  # Gluon WS: opt-in only
        assert all(configs.config_from_str(str(c)) == c for c in cands)
        # first-candidate rule: the first tile of every list is one the H200 grid measured (plain v3 form)
        first = cands[0]
        assert not getattr(first, "quant_in", False) and not getattr(first, "persistent", False)
    assert "first" in configs.__doc__.lower() or "First-candidate rule" in open(configs.__file__).read()
    with pytest.raises(ValueError, match="num_warps"):
        FragmentConfig(16, 64, num_warps=2)


def test_one_backend_registry():
    """Every backend answers ``is_supported(capability)`` itself; the choices and the experimental list come
    from the one registry, the experimental kernel forms' support rules from the one table of forms."""
    from foursight.kernels import backends, forms

    assert backends.CHOICES == ("auto", *backends.REGISTRY)
    assert set(backends.NATIVE) == {n for n, b in backends.REGISTRY.items() if b.experimental} == {"dot_scaled", "flashinfer"}
    for cap in (None, (8, 0), (9, 0), (10, 0), (12, 1)):
        ok = {n: b.is_supported(cap) for n, b in backends.REGISTRY.items()}
        assert ok["reference"] and ok["triton"] == (cap is not None)
        assert ok["dot_scaled"] == (cap is not None and cap[0] in (10, 12))
        name, _ = backends.choose_backend(cap, "auto")
        assert not backends.REGISTRY[name].experimental  # experimental backends run only when asked for
    for f in forms.EXPERIMENTAL:
        assert f.rule(None) and f.rule((10, 0))  # a reason: not supported off sm_90


def _same_steps(pw, cfg: FragmentConfig, m: int) -> bool:
    """Both plans run each split's columns as one step of the same width (then the sums are the same)."""
    kcp = -(-pw.in_features // 256) * 2
    splits, _, _ = split_plan(m, pw.out_features, kcp, pw.num_channels, cfg.block_m, cfg.block_n, cfg.block_k // 128,
                              cfg.split_k, 8)  # 8 resident programs under the interpreter
    early, late = segment_plan(pw.num_channels, splits), segment_plan(pw.num_channels, splits, late=True)
    return early == late and early[1] <= early[0]


@pytest.mark.parametrize("split_k", [0, 1, 4])
@pytest.mark.parametrize("m", [1, 5])
def test_cols_late_equals_the_preloaded_tile(layer, split_k, m):
    qw, pw, g = layer
    x = _act(m, g)
    bias = torch.randn(N, generator=g).bfloat16()
    plain = FragmentConfig(16, 64, 128, 1, split_k)
    late = FragmentConfig(16, 64, 128, 1, split_k, cols_late=True)
    same = _same_steps(pw, plain, m)
    for a_quant in (True, False):
        run = (lambda c: fk.splice_linear(x, pw, bias=bias, config=c)) if a_quant else \
            (lambda c: fk.splice_gemm(x, pw, None, bias=bias, out_dtype=torch.float32, config=c))
        y0, y = run(plain), run(late)
        if same:
            assert torch.equal(y, y0), f"{late} differs from {plain} (W4A{4 if a_quant else 16}, M = {m})"
        assert_close_to_reference(y, reference_linear(x, qw, bias=bias, act_quant=a_quant, out_dtype=torch.float32))
    assert same == (split_k == 4), "the plans of this shape: split_k 4 gives one 32-column step each in both"


def test_late_segment_plan_covers_every_column_once():
    for kk in (1, 15, 16, 17, 100, 128, 200, 512):
        for splits in range(1, 12):
            step, per = segment_plan(kk, splits, late=True)
            assert step in (16, 32, 64) and per % 16 == 0 and step >= min(per, 64)
            seen = [c for p in range(splits) for c in range(p * per, min(kk, (p + 1) * per))]
            assert seen == list(range(kk)), (kk, splits)
    assert segment_plan(128, 3, late=True) == (64, 48)  # 48, 48, 32 columns, not 64, 64, 0
    assert segment_plan(128, 3) == (32, 64)


@pytest.mark.parametrize("late", [False, True], ids=["preloaded", "cols_late"])
def test_splice_linear_gives_every_fragment_tile_the_dense_copy(layer, monkeypatch, late):
    """Through the layer's call (``splice_linear``), every fragment tile after a quantizer launch reads the
    quantizer's dense X[:, S] (columns before or after the FP4 loop: the H100 measured both cheaper than
    the gather, columns.json); a tile that quantizes inside the GEMM (``quant_in``, static scale, no
    quantizer launch) gathers it itself."""
    qw, pw, g = layer
    got = []
    monkeypatch.setattr(fk_fragment, "fragment_launch", lambda *a, **k: got.append(k.get("xs")) or fragment_launch(*a, **k))
    x = _act(3, g)
    y = fk.splice_linear(x, pw, config=FragmentConfig(16, 64, 128, 1, 3, cols_late=late))
    assert len(got) == 1 and got[0] is not None
    assert torch.equal(got[0], x[:, pw.bf16_channels.long()])
    assert_close_to_reference(y, reference_linear(x, qw, out_dtype=torch.float32))
    gs = torch.tensor([17.0])
    fk.splice_linear(x, pw, config=FragmentConfig(16, 64, 128, 1, 3, narrow=True, quant_in=True, cols_late=late),
                     input_global_scale=gs)
    assert len(got) == 2 and got[1] is None


@pytest.mark.parametrize("cfg", [FragmentConfig(16, 64, 128, 1, 0), FragmentConfig(16, 64, 128, 1, 3, cols_late=True)], ids=str)
def test_dense_xs_equals_the_gather(layer, cfg):
    """The quantizer's ``X[:, S]`` copy read densely gives the output of the gather by channel index, bit for
    bit (W4A4: the quantizer's ``q*s``; W4A16: X itself as the FP4 operand)."""
    qw, pw, g = layer
    x = _act(3, g)
    _, _, deq, gs, xs = fk_aq.act_quant_launch(x, pw.channel_mask, pw.bf16_channels, None, False, True, True,
                                               deq_dtype=torch.bfloat16, cols=4)
    assert torch.equal(xs, x[:, pw.bf16_channels.long()])
    for a, a_gs, a_quant in ((deq, gs, True), (x, None, False)):
        y0 = torch.empty(3, N, dtype=torch.float32)
        y1 = torch.empty(3, N, dtype=torch.float32)
        fragment_launch(cfg, a, a_gs, x, pw, None, y0, a_quant)
        fragment_launch(cfg, a, a_gs, x, pw, None, y1, a_quant, xs=xs)
        assert torch.equal(y0, y1), f"dense X[:, S] differs from the gather ({cfg}, W4A{4 if a_quant else 16})"
    assert_close_to_reference(y0, reference_linear(x, qw, act_quant=False, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="xs must be"):
        fragment_launch(cfg, deq, gs, x, pw, None, y0, True, xs=xs[:, :64])


def test_cols_late_candidates():
    late = set(configs.COLUMNS_LATE_CONFIGS)
    assert late <= set(configs.DECODE_CONFIGS) | set(configs.MID_CONFIGS)
    for lst in (configs.DECODE_CONFIGS, configs.MID_CONFIGS):
        assert lst[0] not in late and any(c in late for c in lst)  # first-candidate rule: never first
    for c in (*configs.COLUMNS_LATE_CONFIGS, *configs.DECODE_CONFIGS, *configs.MID_CONFIGS):
        assert configs.config_from_str(str(c)) == c
    # the other tiles keep the tags the H100 run recorded (benchmarks/results/h100-2026-12-06-v4/splice_gemm.json)
    assert str(FragmentConfig(16, 64, 256, 3, max_regs=128, narrow=True, q_split=8)) == "fragment/16/64/256/3/0/128/4/True/False/False/8"
    assert str(configs.COLUMNS_LATE_CONFIGS[1]) == "fragment/64/64/128/3/0/0/4/False/False/False/8/True"
