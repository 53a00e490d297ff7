"""The FourSight SGLang linear method inside SGLang's real linear layers, in-process (no engine).

SGLang's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``RowParallelLinear`` are built
with the FourSight quant config (TP=1), the checkpoint tensors go through SGLang's own v1 weight
loaders (wrapped by the shared core's loaders), and the outputs are compared bit-exactly with
``foursight.layer.reference_linear`` of the unfused checkpoint modules. Bad checkpoints must fail
with the shared validator's messages (the same text as vLLM and the HF reference loader).
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.sglang

sglang = pytest.importorskip("sglang")

from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from foursight.tensor_io import load_quantized_tensors  # noqa: E402
from foursight.schema import decode_module  # noqa: E402
from foursight.layer import reference_linear  # noqa: E402
from foursight.quant_methods.online import OnlineSettings  # noqa: E402
from foursight.quant_methods.sglang_method import FourSightSGLangConfig, FourSightSGLangLinearMethod  # noqa: E402
from foursight.quant_methods.sglang_plugin import register  # noqa: E402
from foursight.schema import CheckpointError  # noqa: E402

H, I, HEADS, KV, HD = 128, 256, 4, 2, 32  # tiny Llama shapes
L0 = "model.layers.0"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    cfg, mods, rest = load_quantized_tensors(tiny_ckpt)
    raw = json.loads((tiny_ckpt / "config.json").read_text())["quantization_config"]
    return raw, mods


@pytest.fixture(autouse=True)
def _tp1():
    with get_parallel().override(tp_size=1, tp_rank=0):
        yield


def _config(raw: dict) -> FourSightSGLangConfig:
    # SGLang adds these keys before from_config; the strict schema must not see them
    return FourSightSGLangConfig.from_config({**raw, "packed_modules_mapping": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}, "hf_config": object()})


def _qkv(cfg):
    return QKVParallelLinear(H, HD, HEADS, KV, bias=False, quant_config=cfg, prefix=f"{L0}.self_attn.qkv_proj")


def _load_qkv(layer, mods, drop: tuple[str, str] | None = None, edit=None):
    for sid, s in zip("qkv", ("q_proj", "k_proj", "v_proj")):
        for suf, t in mods[f"{L0}.self_attn.{s}"].items():
            if drop == (s, suf):
                continue
            if edit is not None:
                t = edit(s, suf, t)
            p = getattr(layer, suf)
            p.weight_loader(p, t, sid)


def _ref_qkv(mods, x):
    outs = []
    for s, n in (("q_proj", HEADS * HD), ("k_proj", KV * HD), ("v_proj", KV * HD)):
        t = mods[f"{L0}.self_attn.{s}"]
        outs.append(reference_linear(x, decode_module(s, t, n, H, t["bf16_channels"].numel())))
    return torch.cat(outs, -1)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def test_plugin_registration():
    register()
    register()  # idempotent
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    assert QUANTIZATION_METHODS["foursight"] is FourSightSGLangConfig
    assert get_quantization_config("foursight") is FourSightSGLangConfig
    assert QUANTIZATION_CHOICES.count("foursight") == 1
    import importlib.metadata as md

    eps = {e.name: e.value for e in md.entry_points(group="sglang.srt.plugins")}
    assert eps.get("foursight") == "foursight.quant_methods.sglang_plugin:register"


def test_fused_layers_bit_exact_with_reference(ckpt):
    raw, mods = ckpt
    cfg = _config(raw)
    torch.manual_seed(0)
    x = torch.randn(7, H, dtype=torch.bfloat16) * 2
    qkv = _qkv(cfg)
    assert isinstance(qkv.quant_method, FourSightSGLangLinearMethod)
    _load_qkv(qkv, mods)
    qkv.quant_method.process_weights_after_loading(qkv)
    assert torch.equal(_out(qkv(x)), _ref_qkv(mods, x))

    gu = MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=cfg, prefix=f"{L0}.mlp.gate_up_proj")
    for sid, s in enumerate(("gate_proj", "up_proj")):
        for suf, t in mods[f"{L0}.mlp.{s}"].items():
            p = getattr(gu, suf)
            p.weight_loader(p, t, sid)
    gu.quant_method.process_weights_after_loading(gu)
    ref = torch.cat([reference_linear(x, decode_module(s, mods[f"{L0}.mlp.{s}"], I, H, 16)) for s in ("gate_proj", "up_proj")], -1)
    assert torch.equal(_out(gu(x)), ref)

    down = RowParallelLinear(I, H, bias=False, quant_config=cfg, prefix=f"{L0}.mlp.down_proj")
    for suf, t in mods[f"{L0}.mlp.down_proj"].items():
        p = getattr(down, suf)
        p.weight_loader(p, t)
    down.quant_method.process_weights_after_loading(down)
    x2 = torch.randn(3, I, dtype=torch.bfloat16)
    assert torch.equal(down.quant_method.apply(down, x2), reference_linear(x2, decode_module("d", mods[f"{L0}.mlp.down_proj"], H, I, 16)))


def test_processing_is_idempotent_and_reload_refreshes(ckpt, tiny_ckpt_b):
    raw, mods = ckpt
    _, mods_b, _ = load_quantized_tensors(tiny_ckpt_b)
    cfg = _config(raw)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    qkv = _qkv(cfg)
    _load_qkv(qkv, mods)
    before = {n: p.detach().clone() for n, p in qkv.named_parameters()}
    qkv.quant_method.process_weights_after_loading(qkv)
    y1 = _out(qkv(x))
    qkv.quant_method.process_weights_after_loading(qkv)  # second call: same state, params untouched
    assert torch.equal(_out(qkv(x)), y1)
    for n, p in qkv.named_parameters():
        assert torch.equal(p.detach().view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.detach(),
                           before[n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else before[n]), n
    # RL weight update through the loaders only (what update_weights_from_tensor does):
    # the next forward must use the new weights without an explicit process call
    _load_qkv(qkv, mods_b)
    assert qkv.foursight_plan.loader.stale
    assert torch.equal(_out(qkv(x)), _ref_qkv(mods_b, x))
    assert not torch.equal(_out(qkv(x)), y1)


def test_online_quantization_matches_checkpoint(ckpt, tiny_llama_dir, tiny_ckpt):
    """BF16 weights quantized at load with the checkpoint's channels file give the checkpoint's layer."""
    from safetensors.torch import load_file

    raw, mods = ckpt
    cfg = FourSightSGLangConfig(online=OnlineSettings.from_env(str(tiny_ckpt / "foursight_channels.json")))
    assert cfg.mode == "online"
    bf16 = load_file(str(tiny_llama_dir / "model.safetensors"))
    qkv = _qkv(cfg)
    assert [n for n, _ in qkv.named_parameters()] == ["weight"]
    for sid, s in zip("qkv", ("q_proj", "k_proj", "v_proj")):
        qkv.weight.weight_loader(qkv.weight, bf16[f"{L0}.self_attn.{s}.weight"], sid)
    qkv.quant_method.process_weights_after_loading(qkv)
    x = torch.randn(5, H, dtype=torch.bfloat16)
    assert torch.equal(_out(qkv(x)), _ref_qkv(mods, x))


def test_ignore_list_gives_unquantized_layer(ckpt):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    raw, _ = ckpt
    cfg = _config({**raw, "ignore": ["lm_head", "re:.*self_attn\\.[qkv]_proj"]})
    qkv = _qkv(cfg)
    assert isinstance(qkv.quant_method, UnquantizedLinearMethod)
    assert tuple(qkv.weight.shape) == ((HEADS + 2 * KV) * HD, H) and qkv.weight.is_floating_point()
    assert not hasattr(qkv, "weight_packed")


def test_same_config_base_as_vllm(ckpt):
    """SGLang's config is the engine-neutral base: the fused layer's own name in ``ignore`` skips
    it (as in vLLM), a half-ignored fused layer is refused with the shared wording, capability 80."""
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from foursight.quant_methods.config import FourSightMethodConfig
    from foursight.quant_methods.plan import FourSightLinearMethodBase

    raw, _ = ckpt
    cfg = _config({**raw, "ignore": ["lm_head", "qkv_proj"]})
    assert isinstance(cfg, FourSightMethodConfig) and issubclass(FourSightSGLangLinearMethod, FourSightLinearMethodBase)
    assert isinstance(_qkv(cfg).quant_method, UnquantizedLinearMethod)
    assert cfg.get_min_capability() == 80
    with pytest.raises(CheckpointError, match="some fused shards are in ignore and some are not"):
        _qkv(_config({**raw, "ignore": ["lm_head", "k_proj"]}))


# ---- bad checkpoints: the shared validator's messages -----------------------------------------


def _load_expect(raw, mods, match: str, **kw):
    cfg = _config(raw)
    qkv = _qkv(cfg)
    with pytest.raises(CheckpointError) as ei:
        _load_qkv(qkv, mods, **kw)
        qkv.quant_method.process_weights_after_loading(qkv)
    assert str(ei.value) == match or match in str(ei.value), str(ei.value)
    return str(ei.value)


def test_bad_missing_tensor(ckpt):
    raw, mods = ckpt
    msg = _load_expect(raw, mods, "missing tensor model.layers.0.self_attn.k_proj.weight_scale", drop=("k_proj", "weight_scale"))
    assert msg == "missing tensor model.layers.0.self_attn.k_proj.weight_scale"


def test_bad_dtype(ckpt):
    raw, mods = ckpt
    edit = lambda s, suf, t: t.float() if (s, suf) == ("v_proj", "weight_scale") else t  # noqa: E731
    _load_expect(raw, mods, "tensor model.layers.0.self_attn.v_proj.weight_scale has dtype torch.float32, expected torch.float8_e4m3fn", edit=edit)


def test_bad_shape(ckpt):
    raw, mods = ckpt
    edit = lambda s, suf, t: t[:, :-1] if (s, suf) == ("q_proj", "weight_bf16") else t  # noqa: E731
    _load_expect(raw, mods, "tensor model.layers.0.self_attn.q_proj.weight_bf16 has shape [128, 15]", edit=edit)


def test_bad_channels_differ_between_fused_shards(ckpt):
    raw, mods = ckpt

    def edit(s, suf, t):
        if (s, suf) == ("k_proj", "bf16_channels"):  # another valid set: channels not in S
            other = sorted(set(range(H)) - set(t.tolist()))[: t.numel()]
            return torch.tensor(other, dtype=torch.int32)
        return t

    _load_expect(raw, mods, "model.layers.0.self_attn.qkv_proj: bf16_channels differ between fused shards", edit=edit)


def test_bad_channel_out_of_range(ckpt):
    raw, mods = ckpt

    def edit(s, suf, t):
        if suf == "bf16_channels":
            t = t.clone()
            t[-1] = H + 5
        return t

    _load_expect(raw, mods, "tensor model.layers.0.self_attn.q_proj.bf16_channels has indices outside [0, 128)", edit=edit)


def test_bad_global_scale(ckpt):
    raw, mods = ckpt
    edit = lambda s, suf, t: torch.tensor([0.0]) if (s, suf) == ("q_proj", "weight_global_scale") else t  # noqa: E731
    _load_expect(raw, mods, "tensor model.layers.0.self_attn.q_proj.weight_global_scale must be a global scale in", edit=edit)


def test_bad_config_field():
    with pytest.raises(CheckpointError, match=r"quantization_config\.activation_dtype"):
        FourSightSGLangConfig.from_config({"quant_method": "foursight", "activation_dtype": "int8"})
    with pytest.raises(CheckpointError, match=r"quantization_config\.chanels"):
        FourSightSGLangConfig.from_config({"quant_method": "foursight", "chanels": {}})


def test_same_message_as_hf_reference_loader(tiny_ckpt, tmp_path):
    """The HF reference loader (and vLLM, through the same core) reports the same text."""
    import shutil

    from safetensors.torch import load_file, save_file

    from foursight.hf import load_reference_model

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.self_attn.v_proj.weight_scale"] = t["model.layers.0.self_attn.v_proj.weight_scale"].float()
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        load_reference_model(bad)
    assert str(ei.value) == "tensor model.layers.0.self_attn.v_proj.weight_scale has dtype torch.float32, expected torch.float8_e4m3fn"


@pytest.mark.parametrize("offload", [False, True], ids=["no-offload", "cpu-offload"])
def test_checkpoint_codes_released_unless_sglang_offloads_weights(ckpt, offload):
    """One weight copy (issue 36 item 6) in SGLang: with the fragment form a GPU engine builds (the Triton
    backend; built on the CPU, no kernel runs) the layer's codes and block scales are released after
    processing; with SGLang's ``--cpu-offload-gb`` offloader they are the weights it streams from the CPU
    and stay."""
    from sglang.srt.utils.offloader import OffloaderV1, set_offloader, get_offloader

    from foursight.dispatch import TritonBackend

    raw, mods = ckpt
    qkv = _qkv(_config(raw))
    _load_qkv(qkv, mods)
    qkv.foursight_plan.backend = TritonBackend()
    before = get_offloader()
    if offload:
        set_offloader(OffloaderV1(cpu_offload_max_bytes=1 << 30))
    try:
        qkv.quant_method.process_weights_after_loading(qkv)
    finally:
        set_offloader(before)
    held = qkv.weight_packed.untyped_storage().nbytes()
    assert (held > 0) == offload and (qkv.foursight_plan.loader.released is None) == offload
