"""The format codec (schema.encode_module / decode_module), the channels file rules, and the
static activation scale: one calibration loaded as a checkpoint or online gives one scale."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from foursight import schema
from foursight.layer import quantize_activation, quantize_weight, reference_linear
from foursight.nvfp4 import global_scale_from_amax
from foursight.channels_file import CHANNELS_FORMAT_VERSION, ChannelsFile
from foursight.schema import CheckpointError

Q, K_, V = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")


def test_codec_round_trip_and_names():
    w = torch.randn(32, 64).bfloat16()
    qw = quantize_weight(w, torch.tensor([3, 9]))
    t = schema.encode_module("m.lin", qw, torch.tensor([7.5]), bias=torch.ones(32).bfloat16())
    assert set(t) == {f"m.lin.{s}" for s in (*schema.TENSOR_SUFFIXES, schema.BIAS)}
    back = schema.decode_module("m.lin", {k.rpartition(".")[2]: v for k, v in t.items()}, 32, 64, 2)
    for a, b in zip(qw.tensors(), back.tensors()):
        assert torch.equal(a.float() if a.is_floating_point() else a, b.float() if b.is_floating_point() else b)
    bad = {k.rpartition(".")[2]: v for k, v in t.items()}
    bad[schema.WEIGHT_SCALE] = bad[schema.WEIGHT_SCALE][:, :2]
    with pytest.raises(CheckpointError, match=r"tensor m\.lin\.weight_scale has shape \[32, 2\], expected \[32, 4\]"):
        schema.decode_module("m.lin", bad, 32, 64, 2)


def test_codec_refuses_a_per_row_global_scale():
    qw = quantize_weight(torch.randn(16, 32).bfloat16(), torch.tensor([], dtype=torch.int32))
    qw.weight_global_scale = torch.ones(16)
    with pytest.raises(CheckpointError, match="one weight_global_scale"):
        schema.encode_module("m", qw)


def _write(tmp_path, data) -> str:
    p = tmp_path / "foursight_channels.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_channels_file_round_trip(tmp_path):
    cf = ChannelsFile({Q: [9, 3], K_: [3, 9]}, {Q: 4.25, K_: 4.25})
    p = cf.write(tmp_path / "c.json")
    back = ChannelsFile.read(p)
    assert back.channels == {Q: [3, 9], K_: [3, 9]} and back.input_amax == {Q: 4.25, K_: 4.25}
    assert json.loads(p.read_text())["format_version"] == CHANNELS_FORMAT_VERSION
    assert ChannelsFile.read(tmp_path / "c.json").channel_tensor(Q).dtype == torch.int32
    assert ChannelsFile.read(tmp_path / "c.json").channel_tensor("nope") is None


@pytest.mark.parametrize(
    "data,msg",
    [
        ([1, 2], "expected a JSON object"),
        ({"format_version": 3, "channels": {}}, "format_version 3, expected 2"),
        ({"format_version": 2, "channels": {}, "extra": 1}, r"unknown key\(s\) \['extra'\]"),
        ({"format_version": 2, "channels": []}, "'channels' must be an object"),
        ({"format_version": 2, "channels": {Q: [1, -2]}}, "non-negative ints"),
        ({"format_version": 2, "channels": {Q: [1, 2.5]}}, "non-negative ints"),
        ({"format_version": 2, "channels": {Q: [True]}}, "non-negative ints"),
        ({"format_version": 2, "channels": {Q: [4, 4]}}, "repeated indices"),
        ({"format_version": 2, "channels": {Q: [1]}, "input_amax": {Q: float("nan")}}, "finite number"),
        ({"format_version": 2, "channels": {Q: [1]}, "input_amax": {Q: "3"}}, "finite number"),
        ({"format_version": 2, "channels": {Q: [1]}, "input_amax": {V: 3.0}}, "missing from 'channels'"),
    ],
)
def test_channels_file_rules(tmp_path, data, msg):
    with pytest.raises(CheckpointError, match=msg):
        ChannelsFile.read(_write(tmp_path, data))


def test_channels_file_missing_and_invalid_json(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ChannelsFile.read(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CheckpointError, match="invalid JSON"):
        ChannelsFile.read(tmp_path / "bad.json")


def test_version1_file_keeps_channels_but_not_its_all_channel_amax(tmp_path):
    cf = ChannelsFile.read(_write(tmp_path, {"format_version": 1, "channels": {Q: [2, 1]}, "input_amax": {Q: 9.0}}))
    assert cf.channels == {Q: [1, 2]} and cf.input_amax == {}
    with pytest.raises(CheckpointError, match="format_version 1 amax is over all channels"):
        cf.input_scale([Q], "qkv")


def test_static_scale_is_made_from_the_fp4_part():
    """The static scale quantizes X exactly as the dynamic scale would on the calibration rows:
    both come from max |X| with the BF16 channels zeroed (they are zeroed before quantization)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    x[:, 5] *= 50  # the outlier channel goes to BF16
    ch = torch.tensor([5], dtype=torch.int32)
    from foursight.calibration import ChannelStats

    amax = ChannelStats.from_rows(x).fp4_amax(ch)
    expected = global_scale_from_amax(x[:, [c for c in range(64) if c != 5]].abs().amax())
    assert torch.equal(schema.static_input_scale([amax]), expected.reshape(1))
    # on the row that holds the layer-wide FP4 amax, the static scale is that row's dynamic scale
    r = int(x[:, [c for c in range(64) if c != 5]].abs().amax(1).argmax())
    qa_static = quantize_activation(x[r : r + 1], ch, schema.static_input_scale([amax]))
    qa_dyn = quantize_activation(x[r : r + 1], ch)
    assert torch.equal(qa_static.global_scale, qa_dyn.global_scale) and torch.equal(qa_static.packed, qa_dyn.packed)


def test_one_calibration_gives_one_static_scale_both_ways(tiny_llama_dir, tmp_path):
    """A checkpoint with static activation scales and the online static mode fed with the channels
    file written beside it (or by ``foursight calibrate``) load the same ``input_global_scale``
    and compute the same layer output."""
    from foursight.checkpoint import calibrate_channels
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.hf import load_reference_model
    from foursight.quant_methods.online import OnlineSettings
    from foursight.quant_methods.layer_state import apply_linear
    from foursight.quant_methods.plan import OnlinePlan
    from transformers import AutoModelForCausalLM

    ckpt = quantize_model(tiny_llama_dir, tmp_path / "ckpt", QuantizeConfig(channels="16", activation_scale="static"), progress=False).out_dir
    tensors = load_file(str(ckpt / "model.safetensors"))
    cf = ChannelsFile.read(ckpt)
    # `foursight calibrate` with the same settings writes the same file
    calibrated = ChannelsFile.read(calibrate_channels(tiny_llama_dir, tmp_path / "cal.json", channels="16"))
    assert calibrated.channels == cf.channels and calibrated.input_amax == cf.input_amax

    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    ws = [bf16.get_submodule(n).weight.detach() for n in (Q, K_, V)]
    k_dim = ws[0].shape[1]
    config = schema.FourSightConfig(activation_scale="static")
    plan = OnlinePlan.for_layer("model.layers.0.self_attn.qkv_proj", [w.shape[0] for w in ws], k_dim, k_dim, config,
                                {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, settings=OnlineSettings(channels_file=cf, static_act_scale=True))
    state = plan.process({"weight": torch.cat(ws)})

    for n in (Q, K_, V):
        assert torch.equal(state.input_global_scale, tensors[f"{n}.{schema.INPUT_GLOBAL_SCALE}"]), n
    ref = load_reference_model(ckpt)
    x = torch.randn(5, k_dim, generator=torch.Generator().manual_seed(3)).bfloat16() * 4
    y_ckpt = torch.cat([ref.get_submodule(n)(x) for n in (Q, K_, V)], -1)
    assert torch.equal(apply_linear(state, x), y_ckpt)
    # and it is the static path: not what dynamic per-row scales would give
    y_dyn = torch.cat([reference_linear(x, quantize_weight(w, torch.tensor(cf.channels[Q]))) for w in ws], -1)
    assert not torch.equal(y_dyn, y_ckpt)
