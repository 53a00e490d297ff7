"""One weight copy inside the engine (issue 36 item 6), through the plugin's own linear method.

A fused q/k/v layer is created, loaded and processed by :class:`FourSightLinearMethodBase` (the hooks
vLLM's and SGLang's methods mix in), with the Triton backend, whose execution form is the fragment form
a GPU engine keeps; the Triton interpreter runs it on the CPU. The engine side is the loader contract
vLLM's QKV / merged-column loaders follow at TP = 1 (a shard's rows at its offset, shape checked), as in
tests/test_vllm_core.py. Checked against an independent reference, a fresh load of the same checkpoint
tensors:

* after ``process_weights_after_loading`` the checkpoint codes and block scales hold no storage, and
  the layer's bytes (every storage its parameters and state hold, each once) exceed the prepared form's
  own ``resident_bytes`` by less than the smaller released tensor (no second copy);
* the output equals the fresh prepared form's, bit for bit;
* a BF16 weight update the way ``load_weights`` gives it (``<shard>.weight``, one shard at a time):
  after the first shard the others still hold their values (not zeros); a forward with only ``q``
  updated equals a fresh load of (new q, old k, old v); after every shard it equals a fresh load of the
  new checkpoint; and the codes are released again after each rebuild;
* a packed (checkpoint-tensor) reload of one shard takes the same road.

Run it in the interpreter process (scripts/test.sh's KERNEL_TESTS), under ``flock /tmp/fs-interp.lock``.
"""

from __future__ import annotations

from helpers.interpreter import interpreted_only  # first: sets TRITON_INTERPRET before the kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

import foursight.kernels.api as fk  # noqa: E402
from foursight.dispatch import TritonBackend  # noqa: E402
from foursight.layer import quantize_weight, reference_linear  # noqa: E402
from foursight.quant_methods.config import FourSightMethodConfig  # noqa: E402
from foursight.quant_methods.plan import FourSightLinearMethodBase  # noqa: E402
from foursight.quant_methods.sharding import TPContext, concat_shards, shard_index  # noqa: E402
from foursight.schema import FourSightConfig, encode_module  # noqa: E402

pytestmark = interpreted_only

K, KS = 256, 8
PREFIX = "model.layers.0.self_attn.qkv_proj"
SHARDS = {"q": ("model.layers.0.self_attn.q_proj", 64), "k": ("model.layers.0.self_attn.k_proj", 32),
          "v": ("model.layers.0.self_attn.v_proj", 32)}
CH = torch.tensor(sorted(torch.randperm(K, generator=torch.Generator().manual_seed(5))[:KS].tolist()), dtype=torch.int32)


class Method(FourSightLinearMethodBase):
    """The plugin's linear method at TP = 1 with the Triton backend (the fragment form, as on a GPU)."""

    def tp_context(self, layer):
        return TPContext(0, 1)

    def set_attrs(self, param, attrs):
        for k, v in attrs.items():
            setattr(param, k, v)


def _engine_loader(sizes):
    """vLLM's QKV / merged-column loader contract at TP = 1: the shard's rows at its offset."""

    def load(param, w, shard_id=None):
        data = param.data
        if shard_id is not None:
            i = shard_index(shard_id, len(sizes))
            data = data.narrow(0, sum(sizes[:i]), sizes[i])
        assert data.shape == w.shape, (data.shape, w.shape)
        data.copy_(w)

    return load


def _new_layer(online=None):
    """The fused layer on a FourSight checkpoint, or with ``online`` settings on a BF16 one (``--quantization foursight``)."""
    cfg = FourSightMethodConfig()
    cfg._init_foursight(None if online else FourSightConfig(channels={n: KS for n, _ in SHARDS.values()}), online)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    method = Method(cfg, PREFIX)
    layer = torch.nn.Module()
    sizes = [r for _, r in SHARDS.values()]
    method.create_weights(layer, K, sizes, K, sum(sizes), torch.bfloat16, weight_loader=_engine_loader(sizes))
    layer.foursight_plan.backend = TritonBackend()  # the GPU's execution form, run by the interpreter
    layer.quant_method = method
    return layer


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sid, (_, rows) in SHARDS.items():
        w = torch.randn(rows, K, generator=g) * 0.05
        w[:, CH[:3].long()] *= 30  # the BF16 channels hold outliers
        out[sid] = w.bfloat16()
    return out


def _load_checkpoint(layer, weights, only=None):
    """Load the checkpoint tensors of ``weights`` (quantized with CH) through the parameters' own loaders."""
    for sid, (name, _) in SHARDS.items():
        if only is not None and sid not in only:
            continue
        for key, t in encode_module(name, quantize_weight(weights[sid], CH)).items():
            p = getattr(layer, key.rpartition(".")[2])
            p.weight_loader(p, t, sid)


def _fresh(weights):
    """The independent reference: a new layer loaded from the checkpoint of ``weights`` and processed."""
    layer = _new_layer()
    _load_checkpoint(layer, weights)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _storage_bytes(layer) -> int:
    """Bytes of every storage the layer's parameters and execution state hold, each counted once."""
    from foursight.quant_methods.layer_state import state_tensors

    ts: list[torch.Tensor] = list(layer.parameters())
    state_tensors(layer.foursight_state, ts, set())
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())


def _form(layer):
    pw = layer.foursight_state.prepared.state
    return pw.fragment.words, pw.fragment.scales, pw.weight_global_scale, pw.weight_bf16, pw.bf16_channels


def _assert_same_form(layer, ref):
    for a, b in zip(_form(layer), _form(ref)):
        assert torch.equal(a, b)


def _assert_released(layer):
    n = layer.foursight_plan.layout.out_local
    for name, shape in (("weight_packed", (n, K // 2)), ("weight_scale", (n, K // 16))):
        p = getattr(layer, name)
        assert p.untyped_storage().nbytes() == 0, f"{name} still holds {p.untyped_storage().nbytes()} bytes"
        assert tuple(p.shape) == shape  # the engine still sees the parameter as it registered it
    # no second copy of the codes or scales anywhere: the layer holds its prepared form plus less than
    # the smaller released tensor (the small per-shard scales and channels, and W[:, S] shared with the form)
    extra = _storage_bytes(layer) - fk.resident_bytes(layer.foursight_state.prepared.state)
    assert 0 <= extra < n * K // 16, extra


@pytest.fixture(scope="module")
def x():
    g = torch.Generator().manual_seed(7)
    t = torch.randn(4, K, generator=g)
    t[:, CH[:3].long()] *= 20
    return t.bfloat16()


def test_release_update_and_fresh_load_agree(x):
    old, new = _weights(1), _weights(2)
    layer = _new_layer()
    _load_checkpoint(layer, old)
    packed0, scale0 = layer.weight_packed.detach().clone(), layer.weight_scale.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    _assert_released(layer)

    # the output is the prepared form's, and that is the checkpoint's (reference within bf16 rounding)
    ref_old = _fresh(old)
    pw_direct = fk.prepare_weight(concat_shards([quantize_weight(old[s], CH) for s in SHARDS], PREFIX))
    y = layer.quant_method.apply(layer, x)
    assert torch.equal(y, fk.splice_linear(x, pw_direct))
    assert torch.equal(y, layer.quant_method.apply(ref_old, x))
    y_ref = torch.cat([reference_linear(x, quantize_weight(old[s], CH)) for s in SHARDS], dim=-1)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=2e-2 * y_ref.abs().max().item())

    # a BF16 update as load_weights gives it: q alone first. The whole layer comes back before the
    # first write, so k and v keep their checkpoint bytes (exactly: our quantizer writes 0 where no form reads)
    wparam = layer.weight
    wparam.weight_loader(wparam, new["q"].float(), "q")  # a float32 learner, as TRL colocate hands it over
    rows_q = SHARDS["q"][1]
    assert torch.equal(layer.weight_packed[rows_q:], packed0[rows_q:])
    assert torch.equal(layer.weight_scale[rows_q:].view(torch.uint8), scale0[rows_q:].view(torch.uint8))
    assert layer.foursight_plan.loader.stale
    y_q = layer.quant_method.apply(layer, x)  # a stale layer rebuilds before its forward
    _assert_released(layer)
    ref_q = _fresh({"q": new["q"], "k": old["k"], "v": old["v"]})
    _assert_same_form(layer, ref_q)
    assert torch.equal(y_q, layer.quant_method.apply(ref_q, x))

    # the other shards, one at a time, then the post-load step (vLLM's finish_update / SGLang's session end)
    for sid in ("k", "v"):
        wparam.weight_loader(wparam, new[sid], sid)
    layer.quant_method.process_weights_after_loading(layer)
    _assert_released(layer)
    ref_new = _fresh(new)
    _assert_same_form(layer, ref_new)
    assert torch.equal(layer.quant_method.apply(layer, x), layer.quant_method.apply(ref_new, x))

    # a whole sync (TRL colocate: every shard, no post-load step): the last shard rebuilds it in its loader
    newer = _weights(3)
    for sid in SHARDS:
        wparam.weight_loader(wparam, newer[sid], sid)
    assert not layer.foursight_plan.loader.stale
    _assert_released(layer)
    ref_newer = _fresh(newer)
    _assert_same_form(layer, ref_newer)
    assert torch.equal(layer.quant_method.apply(layer, x), layer.quant_method.apply(ref_newer, x))

    # a packed reload of one shard (checkpoint tensors in) takes the same road
    _load_checkpoint(layer, old, only={"v"})
    layer.quant_method.process_weights_after_loading(layer)
    _assert_released(layer)
    _assert_same_form(layer, _fresh({"q": newer["q"], "k": newer["k"], "v": old["v"]}))


def test_reference_backend_keeps_the_params(x):
    """The CPU reference's float32 weight cannot rebuild the codes: nothing is released there."""
    layer = _new_layer()
    layer.foursight_plan.backend = None  # dispatch's choice: the reference on CPU tensors
    _load_checkpoint(layer, _weights(1))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight_packed.untyped_storage().nbytes() == layer.weight_packed.numel()
    assert layer.foursight_plan.loader.released is None


def _new_online_layer(keep_bf16: bool):
    """The same fused layer on a BF16 checkpoint (``--quantization foursight``, online mode, the weight-based
    channels of KS per input), the BF16 weights kept or freed (``FOURSIGHT_ONLINE_KEEP_BF16``)."""
    from foursight.quant_methods.online import OnlineSettings

    layer = _new_layer(OnlineSettings(budget=str(KS), keep_bf16=keep_bf16))
    weights = _weights(3)
    for sid in SHARDS:
        layer.weight.weight_loader(layer.weight, weights[sid], sid)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_an_online_serving_layer_holds_one_copy_of_the_codes(x):
    """Online mode with the BF16 weights freed (a serving engine) holds the prepared form and nothing more: on the
    H100 the 8B-shaped serving row held 1.25 bytes per weight value, where one copy is 0.61
    (benchmarks/results/engine-h100-2026-12-07b): the layer's QuantizedWeight codes stayed beside the form's own.
    Its output equals the same layer's with the BF16 weights kept (which frees nothing), bit for bit."""
    served, kept = _new_online_layer(keep_bf16=False), _new_online_layer(keep_bf16=True)
    assert served.weight.untyped_storage().nbytes() == 0
    n = served.foursight_plan.layout.out_local
    extra = _storage_bytes(served) - fk.resident_bytes(served.foursight_state.prepared.state)
    assert 0 <= extra < n * K // 16, f"{extra} bytes beside the prepared form: a second copy of the codes"
    assert torch.equal(served.quant_method.apply(served, x), kept.quant_method.apply(kept, x))
