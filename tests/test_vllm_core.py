"""The engine-neutral adapter modules (quant_methods/plan.py, layer_loading.py, param_kinds.py, sharding.py, online.py, config.py) against the PyTorch reference.

No engine is started here: the loaders are driven by a small stand-in for an engine's
column/row loader (narrow along the sharded dim, copy), exactly the contract vLLM/SGLang use.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from foursight.channels import weight_based_channels as calib_weight_channels
from foursight.layer import QuantizedWeight, quantize_weight, reference_linear
from foursight.quant_methods import sharding
from foursight.quant_methods import online as online_mod
from foursight.quant_methods.online import OnlineSettings
from foursight.quant_methods.layer_state import apply_linear
from foursight.quant_methods.plan import CheckpointPlan, LayerPlan, OnlinePlan, layer_params, plan_for_layer
from foursight.quant_methods.sharding import TPContext, concat_shards, localize_channels, shard_quantized_weight
from foursight.channels_file import ChannelsFile
from foursight.schema import CheckpointError, FourSightConfig

pytestmark = pytest.mark.vllm

K = 128


def _w(n, k=K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[:, 5] *= 8  # an outlier column
    return w.bfloat16()


def _x(m=6, k=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, [5, 77]] *= 20
    return x.bfloat16()


CH = torch.tensor([5, 40, 77, 100], dtype=torch.int32)


def _ckpt_tensors(qw: QuantizedWeight, igs: float = 30.0) -> dict[str, torch.Tensor]:
    return {
        "weight_packed": qw.weight_packed,
        "weight_scale": qw.weight_scale,
        "weight_global_scale": qw.weight_global_scale.float().reshape(1),
        "input_global_scale": torch.tensor([igs]),
        "bf16_channels": qw.bf16_channels,
        "weight_bf16": qw.weight_bf16,
    }


class FakeLayer(torch.nn.Module):
    """Registers a plan's parameters like an engine would."""

    def __init__(self, plan: LayerPlan):
        super().__init__()
        self.plan = plan
        self.loaders = {}
        for spec in plan.param_specs(torch.bfloat16):
            t = torch.full(spec.shape, spec.fill).to(spec.dtype) if spec.dtype != torch.float8_e4m3fn else torch.zeros(spec.shape, dtype=spec.dtype)
            p = torch.nn.Parameter(t, requires_grad=False)
            for a, v in spec.attrs.items():
                setattr(p, a, v)
            self.register_parameter(spec.name, p)
            self.loaders[spec.name] = plan.loader.make_loader(spec, self._engine_loader)

    def _engine_loader(self, param, w, shard_id=None):
        """Column loader for fused shards (offset along N) + row loader (narrow along K)."""
        lay = self.plan.layout
        data = param.data
        if shard_id is not None:
            i = sharding.shard_index(shard_id, lay.num_shards)
            off = sum(lay.shard_sizes[:i])
            data = data.narrow(0, off, lay.shard_sizes[i])
        in_dim = getattr(param, "input_dim", None)
        if in_dim is not None and lay.k_split:
            size = data.shape[in_dim]
            w = w.narrow(in_dim, lay.tp_rank * size, size)
        assert data.shape == w.shape
        data.copy_(w)

    def load(self, name, w, shard_id=None):
        self.loaders[name](getattr(self, name), w, shard_id)


def _plan(names_sizes, k, tp_rank=0, tp_size=1, k_split=False, act="dynamic", online=None):
    """A CheckpointPlan, or with ``online`` settings an OnlinePlan (``plan_for_layer`` chooses, as the engines' method does)."""
    names = [n for n, _ in names_sizes]
    cfg = FourSightConfig(channels={n: k for n in names}, activation_scale=act)
    prefix = names[0] if len(names) == 1 else "model.layers.0.self_attn.qkv_proj"
    mapping = {"qkv_proj": [n.rsplit(".", 1)[1] for n in names]} if len(names) > 1 else {}
    kl = K // tp_size if k_split else K
    plan = plan_for_layer(prefix, [s for _, s in names_sizes], K, kl, cfg, mapping, tp_rank, tp_size, online)
    assert isinstance(plan, OnlinePlan if online is not None else CheckpointPlan)
    return plan


def test_fused_shards_match_separate_reference_layers():
    """q/k/v loaded into one fused layer, each with its own global scale, equal the three
    unfused reference layers on the same input (per-row global scale vector)."""
    ws = {"q_proj": _w(64, seed=0), "k_proj": _w(32, seed=1) * 10, "v_proj": _w(32, seed=2) * 0.1}
    qws = {n: quantize_weight(w, CH) for n, w in ws.items()}
    plan = _plan([(f"model.layers.0.self_attn.{n}", w.shape[0]) for n, w in ws.items()], k=4)
    layer = FakeLayer(plan)
    for sid, (n, qw) in zip("qkv", qws.items()):
        for suffix, t in _ckpt_tensors(qw).items():
            layer.load(suffix, t, sid)
    state = plan.process(layer_params(layer, plan))
    assert state.qw.weight_global_scale.shape == (128,)
    x = _x()
    y = apply_linear(state, x)
    y_ref = torch.cat([reference_linear(x, qw) for qw in qws.values()], dim=-1)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=0, atol=2e-2)  # bf16 output rounding only
    # fp32 outputs agree to summation order
    y32 = apply_linear(state, x.float())
    y32_ref = torch.cat([reference_linear(x.float(), qw) for qw in qws.values()], dim=-1)
    assert (y32 - y32_ref).abs().max() <= 1e-4 * y32_ref.abs().max()


def test_each_parameter_is_a_kind_with_its_loading_rule():
    """A checkpoint plan registers the BF16 update weight, three engine-loaded row tensors and three per-shard ones
    (the input scale required only when static); an online plan one BF16 weight. The kind, not a flag, says how each loads."""
    from foursight.quant_methods.param_kinds import BF16UpdateParam, BF16WeightParam, PerShardParam, RowsParam

    names = [("model.layers.0.self_attn.q_proj", 64), ("model.layers.0.self_attn.k_proj", 32)]
    ckpt = _plan(names, k=4)
    kinds = {s.name: type(s) for s in ckpt.param_specs()}
    assert kinds == {"weight": BF16UpdateParam, "weight_packed": RowsParam, "weight_scale": RowsParam, "weight_bf16": RowsParam,
                     "weight_global_scale": PerShardParam, "input_global_scale": PerShardParam, "bf16_channels": PerShardParam}
    shapes = {s.name: (s.shape, s.fill) for s in ckpt.param_specs()}
    assert shapes["bf16_channels"] == ((2, 4), 0.0) and shapes["weight_global_scale"] == ((2,), 1.0) and shapes["weight"] == ((0,), 0.0)
    assert [s.name for s in ckpt.param_specs() if s.required(False)] == ["weight_packed", "weight_scale", "weight_bf16", "weight_global_scale", "bf16_channels"]
    assert not ckpt.quantizes_at_load
    online = _plan(names, k=0, online=OnlineSettings(budget="16"))
    (spec,) = online.param_specs(torch.float16)
    assert type(spec) is BF16WeightParam and spec.shape == (96, K) and spec.dtype == torch.float16 and online.quantizes_at_load


def test_process_is_idempotent_and_leaves_params_untouched():
    qw = quantize_weight(_w(48), CH)
    plan = _plan([("model.layers.0.mlp.down_proj", 48)], k=4)
    layer = FakeLayer(plan)
    for suffix, t in _ckpt_tensors(qw).items():
        layer.load(suffix, t)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    s1 = plan.process(layer_params(layer, plan))
    s2 = plan.process(layer_params(layer, plan))
    for n, p in layer.named_parameters():
        assert torch.equal(p.float(), before[n].float()), n
    x = _x()
    assert torch.equal(apply_linear(s1, x), apply_linear(s2, x))
    assert torch.equal(apply_linear(s2, x), reference_linear(x, qw))
    assert s2.generation == 2


def test_mismatched_shard_channels_name_the_layer():
    q = quantize_weight(_w(64), CH)
    k = quantize_weight(_w(32, seed=1), torch.tensor([5, 40, 77, 101]))
    plan = _plan([("model.layers.0.self_attn.q_proj", 64), ("model.layers.0.self_attn.k_proj", 32)], k=4)
    layer = FakeLayer(plan)
    for sid, qw in zip("qk", (q, k)):
        for suffix, t in _ckpt_tensors(qw).items():
            layer.load(suffix, t, sid)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.qkv_proj: bf16_channels differ"):
        plan.process(layer_params(layer, plan))


def test_missing_wrong_shape_wrong_dtype_name_the_tensor():
    qw = quantize_weight(_w(48), CH)
    plan = _plan([("model.layers.3.mlp.down_proj", 48)], k=4)
    layer = FakeLayer(plan)
    t = _ckpt_tensors(qw)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.down_proj\.weight_scale has dtype torch.float32"):
        layer.load("weight_scale", t["weight_scale"].float())
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.3\.mlp\.down_proj\.weight_packed has shape \[48, 32\]"):
        layer.load("weight_packed", t["weight_packed"][:, :32])
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mlp\.down_proj\.bf16_channels has shape \[3\], expected \[4\]"):
        layer.load("bf16_channels", t["bf16_channels"][:3])
    for suffix in ("weight_packed", "weight_global_scale", "bf16_channels", "weight_bf16"):
        layer.load(suffix, t[suffix])
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\.mlp\.down_proj\.weight_scale"):
        plan.process(layer_params(layer, plan))
    layer.load("weight_scale", t["weight_scale"])
    bad = t["weight_global_scale"].clone() * float("nan")
    layer.load("weight_global_scale", bad)
    with pytest.raises(CheckpointError, match=r"down_proj\.weight_global_scale must be a global scale in .*got nan"):
        plan.process(layer_params(layer, plan))


@pytest.mark.parametrize("static", [True, False])
def test_row_parallel_tp2_sums_to_unsharded_reference(static):
    """Row-parallel TP=2: each rank keeps only its K-shard's BF16 channels (re-indexed locally),
    the global scale is shared; the rank outputs sum to the unsharded layer."""
    w = _w(48)
    qw = quantize_weight(w, CH)  # channels 5, 40 in rank 0's half; 77, 100 in rank 1's
    igs = torch.tensor([30.0]) if static else None
    x = _x().float()
    y_ref = reference_linear(x, qw, input_global_scale=igs)
    ys = []
    for r in range(2):
        plan = _plan([("model.layers.0.mlp.down_proj", 48)], k=4, tp_rank=r, tp_size=2, k_split=True, act="static" if static else "dynamic")
        layer = FakeLayer(plan)
        for suffix, t in _ckpt_tensors(qw).items():
            layer.load(suffix, t)
        st = plan.process(layer_params(layer, plan))
        assert st.qw.bf16_channels.tolist() == ([5, 40] if r == 0 else [77 - 64, 100 - 64])
        assert torch.equal(st.qw.weight_global_scale, qw.weight_global_scale)
        # the core's loader path equals the direct shard helper
        sq = shard_quantized_weight(qw, r, 2, "K")
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(st.qw.tensors(), sq.tensors()))
        ys.append(apply_linear(st, x[:, r * 64 : (r + 1) * 64]))
    y = ys[0] + ys[1]
    rel = float((y - y_ref).norm() / y_ref.norm())
    if static:
        assert rel < 1e-6  # same codes; float32 summation order only
    else:
        # per-rank dynamic activation scale (amax over the local K shard): NVFP4-rounding level
        y_bf16 = x @ w.float().t()
        assert rel < 0.5 * float((y_ref - y_bf16).norm() / y_bf16.norm())


def test_column_parallel_tp2_concatenates_to_unsharded():
    qw = concat_shards([quantize_weight(_w(64), CH), quantize_weight(_w(64, seed=3) * 4, CH)])
    x = _x()
    y_ref = reference_linear(x, qw)
    parts = [reference_linear(x, shard_quantized_weight(qw, r, 2, "N")) for r in range(2)]
    assert torch.equal(torch.cat(parts, -1), y_ref)


def test_localize_channels():
    local, keep = localize_channels(torch.tensor([1, 63, 64, 70, 127]), 64, 64)
    assert local.tolist() == [0, 6, 63] and keep.tolist() == [2, 3, 4]


def test_online_quantization_with_channels_file(tmp_path):
    ws = [_w(64), _w(32, seed=1)]
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    f = tmp_path / "foursight_channels.json"
    f.write_text(json.dumps({"format_version": 1, "channels": {n: CH.tolist() for n in names}, "input_amax": {n: 9.0 for n in names}}))
    st = OnlineSettings(channels_file=ChannelsFile.read(f))
    plan = _plan([(n, w.shape[0]) for n, w in zip(names, ws)], k=0, online=st)
    layer = FakeLayer(plan)
    layer.load("weight", ws[0], "q")
    layer.load("weight", ws[1], "k")
    state = plan.process(layer_params(layer, plan))
    x = _x()
    y_ref = torch.cat([reference_linear(x, quantize_weight(w, CH)) for w in ws], -1)
    torch.testing.assert_close(apply_linear(state, x).float(), y_ref.float(), rtol=0, atol=2e-2)
    assert state.channels.tolist() == CH.tolist()


def test_online_fallback_warns_and_uses_weight_channels(caplog):
    online_mod.warned_fallback.clear()
    ws = [_w(64), _w(32, seed=1)]
    plan = _plan([("model.layers.0.self_attn.q_proj", 64), ("model.layers.0.self_attn.k_proj", 32)], k=0, online=OnlineSettings(budget="16"))
    layer = FakeLayer(plan)
    layer.load("weight", ws[0], "q")
    layer.load("weight", ws[1], "k")
    with caplog.at_level(logging.WARNING, logger="foursight.quant_methods"):
        state = plan.process(layer_params(layer, plan))
    assert "no channels file" in caplog.text
    assert state.channels.tolist() == calib_weight_channels(ws, 16).tolist()
    assert 5 in state.channels.tolist()


def test_online_tp_uses_shared_scale_and_global_channels():
    """Online row-parallel TP=2 with simulated collectives equals quantizing the whole weight then sharding."""
    w = _w(48)
    plans, layers = [], []
    for r in range(2):
        p = _plan([("model.layers.0.mlp.down_proj", 48)], k=0, tp_rank=r, tp_size=2, k_split=True, online=OnlineSettings(budget="16"))
        lay = FakeLayer(p)
        lay.load("weight", w)
        plans.append(p)
        layers.append(lay)
    halves = [layers[r].weight.detach() for r in range(2)]
    full = quantize_weight(w, calib_weight_channels([w], 16))  # unsharded reference

    def tp(r):
        """Collectives over the two simulated ranks (the other rank's values computed as it would)."""
        other = halves[1 - r].float().clone()
        loc, _ = localize_channels(full.bf16_channels, (1 - r) * 64, 64)
        other[:, loc.long()] = 0

        def reduce_max(t):
            return torch.maximum(t, other.abs().amax().reshape(t.shape))

        def gather_cat(t):
            scores = [halves[i].float().abs().amax(0) for i in range(2)]
            return torch.cat(scores)

        return TPContext(r, 2, reduce_max, gather_cat)

    for r in range(2):
        st = plans[r].process(layer_params(layers[r], plans[r]), tp(r))
        assert st.channels.tolist() == full.bf16_channels.tolist()
        sq = shard_quantized_weight(full, r, 2, "K")
        for a, b in zip(st.qw.tensors(), sq.tensors()):
            assert torch.equal(a.float(), b.float())


def test_config_base_ignore_rule_and_wording():
    """The engine-neutral config base decides for both engines: a shard is ignored when its own
    name or the fused layer's name matches ``ignore``; a fused layer half-ignored is refused."""
    from foursight.quant_methods.config import MIN_CAPABILITY, FourSightMethodConfig

    def cfg(ignore):
        c = FourSightMethodConfig()
        c._init_foursight(FourSightConfig(ignore=ignore), None)
        return c

    qkv = "model.layers.0.self_attn.qkv_proj"
    assert cfg(["lm_head"]).quantizes(qkv)
    assert not cfg(["qkv_proj"]).quantizes(qkv)  # the fused name
    assert not cfg(["re:.*\\.(q|k|v)_proj"]).quantizes(qkv)  # every shard
    with pytest.raises(CheckpointError, match=r"qkv_proj: some fused shards are in ignore and some are not .*ignore all or none"):
        cfg(["k_proj"]).quantizes(qkv)
    assert FourSightMethodConfig.get_min_capability() == MIN_CAPABILITY == 80


def test_vllm_config_is_the_base():
    pytest.importorskip("vllm")
    from foursight.quant_methods.config import FourSightMethodConfig
    from foursight.quant_methods.plan import FourSightLinearMethodBase
    from foursight.quant_methods.vllm_method import FourSightLinearMethod, FourSightVllmConfig

    c = FourSightVllmConfig(FourSightConfig(ignore=["k_proj"]))
    assert isinstance(c, FourSightMethodConfig) and issubclass(FourSightLinearMethod, FourSightLinearMethodBase)
    assert c.get_min_capability() == 80 and c.get_name() == "foursight"
    with pytest.raises(CheckpointError, match="ignore all or none"):
        c.quantizes("model.layers.0.self_attn.qkv_proj")
