"""FourSight inside the real vLLM engine (CPU build, in-process), on the tiny random models.

Oracle: the PyTorch reference model of the same checkpoint (``foursight.hf.load_reference_model``)
and ``foursight.layer.quantize_weight`` / ``reference_linear``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.checkpoint import quantize_model  # noqa: E402
from foursight.quantize_config import QuantizeConfig  # noqa: E402
from foursight.hf import load_reference_model  # noqa: E402
from foursight.layer import quantize_weight  # noqa: E402
from foursight.calibration import builtin_texts  # noqa: E402
from foursight.trainer_bridge.scoring import sequence_logprobs as hf_prompt_logprobs  # noqa: E402
from helpers.checkpoints import edited_copy  # noqa: E402
from foursight.trainer_bridge.metrics import abs_diff_summary  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from helpers.vllm_engine import close, engine_model, make_llm  # noqa: E402

pytestmark = pytest.mark.vllm

def perturbed_copy(src: Path, dst: Path, seed: int = 1, scale: float = 0.05) -> Path:
    """A copy of a BF16 model folder with every 2-D weight perturbed by ``scale`` of its std."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if v.dim() == 2:
            v = (v.float() + scale * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
        out[k] = v.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def seqs(tiny_ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    return fixed_sequences(tok, builtin_texts()[:4], 32)


@pytest.fixture(scope="module")
def llm_fs(tiny_ckpt):
    llm = make_llm(tiny_ckpt, quantization="foursight")
    yield llm
    close(llm)


def capture_layer_io(llm, prompt_ids):
    """Run one prompt and record (input, output) of every FourSight layer of the engine."""
    from vllm import SamplingParams, TokensPrompt

    model = engine_model(llm)
    rec, hooks = {}, []
    for name, mod in model.named_modules():
        if getattr(mod, "foursight_plan", None) is not None:
            def hook(m, inp, out, name=name):
                y = out[0] if isinstance(out, tuple) else out
                rec.setdefault(name, (inp[0].detach().clone(), y.detach().clone(), m))
            hooks.append(mod.register_forward_hook(hook))
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return rec


def test_checkpoint_generates_and_every_layer_matches_reference(llm_fs, tiny_ckpt, seqs):
    """LLM(model=ckpt, quantization="foursight") generates, and every engine layer (fused
    q/k/v and gate/up, row-parallel o/down) computes exactly what the reference layers compute
    on the same input."""
    from vllm import SamplingParams

    out = llm_fs.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    ref = load_reference_model(tiny_ckpt)
    rec = capture_layer_io(llm_fs, seqs[0])
    assert len(rec) == 2 * 4  # qkv, o, gate_up, down per layer
    for name, (x, y, mod) in rec.items():
        plan = mod.foursight_plan
        with torch.no_grad():
            y_ref = torch.cat([ref.get_submodule(n)(x) for n in plan.layout.shard_names], dim=-1)
        assert y.shape == y_ref.shape, name
        d = (y.float() - y_ref.float()).abs()
        # identical math; fused vs separate fp32 GEMMs may flip the last bf16 bit of a few outputs
        assert float(d.max()) <= 2**-7 * float(y_ref.float().abs().max()), name
        assert float((d == 0).float().mean()) > 0.98, name


def test_teacher_forced_logprobs_close_to_reference(llm_fs, tiny_ckpt, seqs, tiny_llama_dir):
    """Whole-model teacher-forced logprobs: engine FourSight vs the reference model of the same
    checkpoint. Only the non-quantized parts differ (vLLM's fused RMSNorm / rotary / attention in
    BF16 vs HF's); FP4 activation rounding amplifies those BF16 differences, so the bound is
    set relative to the quantization effect being measured: the engine-vs-reference gap must be
    well below the FourSight-vs-BF16 gap of the reference itself."""
    from transformers import AutoModelForCausalLM

    eng = engine_prompt_logprobs(llm_fs, seqs)
    ref = hf_prompt_logprobs(load_reference_model(tiny_ckpt), seqs)
    bf = hf_prompt_logprobs(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16), seqs)
    gap = abs_diff_summary(eng, ref)
    effect = abs_diff_summary(ref, bf)
    print(f"\ntiny llama k=16: engine vs reference |Δ| mean {gap['mean']:.4f} max {gap['max']:.4f}; reference FourSight vs BF16 mean {effect['mean']:.4f}")
    assert gap["mean"] < 0.6 * effect["mean"]


def test_post_load_processing_is_idempotent(llm_fs, seqs):
    """Running process_weights_after_loading again (as a reload would) changes nothing."""
    a = engine_prompt_logprobs(llm_fs, seqs[:2])
    model = engine_model(llm_fs)
    params_before = {n: p.detach().clone() for n, p in model.named_parameters() if "weight_packed" in n}
    for mod in model.modules():
        if getattr(mod, "foursight_plan", None) is not None:
            mod.quant_method.process_weights_after_loading(mod)
            mod.quant_method.process_weights_after_loading(mod)
    for n, p in model.named_parameters():
        if n in params_before:
            assert torch.equal(p, params_before[n]), n
    llm_fs.reset_prefix_cache()
    b = engine_prompt_logprobs(llm_fs, seqs[:2])
    assert abs_diff_summary(a, b)["max"] == 0.0


def test_weight_update_in_checkpoint_mode(llm_fs, tiny_llama_dir, tmp_path):
    """BF16 update into an engine loaded from a FourSight checkpoint: every layer becomes
    quantize_weight(new W, same channels), the version is returned, nothing restarts."""
    pert = perturbed_copy(Path(tiny_llama_dir), tmp_path / "pert")
    res = llm_fs.collective_rpc("foursight_update_weights", args=(str(pert / "model.safetensors"), 5))
    assert res[0]["version"] == 5 and res[0]["requantized_layers"] == 8
    assert llm_fs.collective_rpc("foursight_weight_version") == [5]
    from safetensors.torch import load_file

    sd = load_file(str(pert / "model.safetensors"))
    model = engine_model(llm_fs)
    for mod in model.modules():
        plan = getattr(mod, "foursight_plan", None)
        if plan is None:
            continue
        st = mod.foursight_state
        parts = [quantize_weight(sd[f"{n}.weight"], st.channels) for n in plan.layout.shard_names]
        exp_packed = torch.cat([p.weight_packed for p in parts])
        assert torch.equal(st.qw.weight_packed, exp_packed), plan.layout.prefix
        exp_gs = torch.cat([p.weight_global_scale.expand(p.out_features) for p in parts])
        assert torch.equal(st.qw.weight_global_scale.reshape(-1).expand(exp_gs.numel()), exp_gs), plan.layout.prefix
        assert torch.equal(st.qw.weight_bf16, torch.cat([p.weight_bf16 for p in parts])), plan.layout.prefix


def test_online_quantization_update_matches_fresh_load(tiny_llama_dir, tiny_ckpt, seqs, tmp_path, monkeypatch):
    """BF16 model + --quantization foursight with the checkpoint's channels file gives the same
    logprobs as the checkpoint; updating it with a perturbed copy gives the same logprobs as a
    fresh load of the perturbed weights."""
    monkeypatch.setenv("FOURSIGHT_CHANNELS_FILE", str(tiny_ckpt / "foursight_channels.json"))
    pert = perturbed_copy(Path(tiny_llama_dir), tmp_path / "pert")
    llm = make_llm(tiny_llama_dir, quantization="foursight")
    a = engine_prompt_logprobs(llm, seqs)
    ck = make_llm(tiny_ckpt)  # same process: a second engine
    assert abs_diff_summary(a, engine_prompt_logprobs(ck, seqs))["max"] == 0.0
    close(ck)
    res = llm.collective_rpc("foursight_update_weights", args=(str(pert / "model.safetensors"), "2"))
    assert res[0]["version"] == 2
    llm.reset_prefix_cache()
    b = engine_prompt_logprobs(llm, seqs)
    assert abs_diff_summary(a, b)["mean"] > 1e-3  # the outputs changed
    close(llm)
    fresh = make_llm(pert, quantization="foursight")
    c = engine_prompt_logprobs(fresh, seqs)
    close(fresh)
    assert abs_diff_summary(b, c)["max"] == 0.0


def test_online_fallback_without_channels_file(tiny_llama_dir, seqs, monkeypatch, tmp_path):
    """No channels file: weight-based channels (budget from FOURSIGHT_CHANNEL_BUDGET), equal to
    the offline fallback selection; k=0 is plain NVFP4."""
    from foursight.channels import weight_based_channels
    from safetensors.torch import load_file

    monkeypatch.delenv("FOURSIGHT_CHANNELS_FILE", raising=False)
    monkeypatch.setenv("FOURSIGHT_CHANNEL_BUDGET", "16")
    sd = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    llm = make_llm(tiny_llama_dir, quantization="foursight")
    for mod in engine_model(llm).modules():
        plan = getattr(mod, "foursight_plan", None)
        if plan is not None:
            exp = weight_based_channels([sd[f"{n}.weight"] for n in plan.layout.shard_names], 16)
            assert mod.foursight_state.channels.tolist() == exp.tolist(), plan.layout.prefix
    close(llm)


def test_zero_channels_is_plain_nvfp4(tiny_llama_dir, tmp_path):
    """k=0: no BF16 channels anywhere; each layer equals compressed-tensors-style plain NVFP4."""
    ck = quantize_model(tiny_llama_dir, tmp_path / "k0", QuantizeConfig(channels="0"), progress=False).out_dir
    llm = make_llm(ck)
    from safetensors.torch import load_file

    sd = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    for mod in engine_model(llm).modules():
        plan = getattr(mod, "foursight_plan", None)
        if plan is not None:
            st = mod.foursight_state
            assert st.qw.bf16_channels.numel() == 0 and st.qw.weight_bf16.shape[1] == 0
            exp = torch.cat([quantize_weight(sd[f"{n}.weight"], torch.zeros(0, dtype=torch.int32)).weight_packed for n in plan.layout.shard_names])
            assert torch.equal(st.qw.weight_packed, exp), plan.layout.prefix
    close(llm)


def test_bad_checkpoints_fail_naming_the_tensor(tiny_ckpt, tmp_path):
    from foursight.schema import CheckpointError

    miss = edited_copy(tiny_ckpt, tmp_path / "missing", lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        make_llm(miss)

    def bad_shape(sd):
        sd["model.layers.0.mlp.down_proj.weight_packed"] = sd["model.layers.0.mlp.down_proj.weight_packed"][:, :-8].contiguous()

    shp = edited_copy(tiny_ckpt, tmp_path / "shape", bad_shape)
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight_packed has shape"):
        make_llm(shp)

    ver = tmp_path / "version"
    shutil.copytree(tiny_ckpt, ver)
    cfg = json.loads((ver / "config.json").read_text())
    cfg["quantization_config"]["format_version"] = 7
    (ver / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"quantization_config\.format_version: .*unsupported FourSight format_version 7"):
        make_llm(ver)


def test_qwen2_biases_w4a16(tiny_qwen2_dir, tmp_path):
    """Qwen2 (q/k/v biases) as a W4A16 checkpoint (activation_dtype="bf16"): every engine
    layer matches the reference layers, and without FP4 activation rounding to amplify BF16
    differences the whole-model teacher-forced logprobs sit at BF16 implementation noise."""
    from transformers import AutoTokenizer

    ck = quantize_model(tiny_qwen2_dir, tmp_path / "q2", QuantizeConfig(channels="16", activations="bf16"), progress=False).out_dir
    tok = AutoTokenizer.from_pretrained(ck)
    seqs = fixed_sequences(tok, builtin_texts()[:4], 32)
    llm = make_llm(ck)
    ref = load_reference_model(ck)
    rec = capture_layer_io(llm, seqs[0])
    assert any(getattr(m, "bias", None) is not None for _, _, m in rec.values())
    for name, (x, y, mod) in rec.items():
        with torch.no_grad():
            y_ref = torch.cat([ref.get_submodule(n)(x) for n in mod.foursight_plan.layout.shard_names], dim=-1)
        assert float((y.float() - y_ref.float()).abs().max()) <= 2**-7 * float(y_ref.float().abs().max()), name
        assert not mod.foursight_state.act_quant
    gap = abs_diff_summary(engine_prompt_logprobs(llm, seqs), hf_prompt_logprobs(ref, seqs))
    close(llm)
    print(f"\ntiny qwen2 W4A16 k=16: engine vs reference |Δ| mean {gap['mean']:.4f} max {gap['max']:.4f}")
    # BF16 engine vs HF BF16 on the tiny models: ~0.01 mean, ~0.08 max (docs/vllm.md)
    assert gap["mean"] < 0.05 and gap["max"] < 0.3


def _set(name, idx, value):
    def edit(sd):
        t = sd[name].float().clone()
        t.view(-1)[idx] = value
        sd[name] = t.to(sd[name].dtype).contiguous()
    return edit


def _inf_row(name, row):
    def edit(sd):
        t = sd[name].clone()
        t[row] = float("inf")
        sd[name] = t.contiguous()
    return edit


@pytest.mark.parametrize("case, edit, tensor", [
    ("norm", _set("model.norm.weight", 5, float("nan")), "model.norm.weight"),
    ("embedding", _inf_row("model.embed_tokens.weight", 7), "model.embed_tokens.weight"),
    ("fp8_scale", _set("model.layers.0.self_attn.q_proj.weight_scale", 3, float("nan")), "model.layers.0.self_attn.q_proj.weight_scale"),
])
def test_non_finite_checkpoint_refuses_to_load_in_vllm_naming_the_tensor(tiny_ckpt, tmp_path, case, edit, tensor):
    """A NaN norm, an Inf embedding row or a NaN fp8 weight scale: vLLM does not start serving
    (before: it loaded, and the first request killed the engine); the error names the tensor."""
    from foursight.schema import CheckpointError

    bad = edited_copy(tiny_ckpt, tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {tensor}") + r".*non-finite"):
        make_llm(bad)


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"])
def test_non_finite_bf16_weight_refuses_online_quantization_naming_the_tensor(tiny_llama_dir, tmp_path, monkeypatch, tensor):
    """Online mode (a BF16 model served with --quantization foursight): a NaN in a linear weight
    (quantized by FourSight at load) or in a norm (loaded by vLLM's own loader) stops the load
    naming the tensor, before any request."""
    from foursight.schema import CheckpointError

    monkeypatch.delenv("FOURSIGHT_CHANNELS_FILE", raising=False)
    bad = edited_copy(Path(tiny_llama_dir), tmp_path / "bad", _set(tensor, 11, float("nan")))
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {tensor}") + r".*non-finite"):
        make_llm(bad, quantization="foursight")


def test_non_finite_update_is_rejected_by_the_worker_and_previous_weights_keep_serving(llm_fs, tiny_llama_dir, tmp_path):
    """foursight_update_weights with a NaN in model.norm.weight (the engine's own path, no bridge):
    the error names the tensor, the version is unchanged and the engine's logprobs are bit-equal
    to those before (nothing was loaded)."""
    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams, TokensPrompt

    sd = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    norm = sd["model.norm.weight"].clone()
    norm[3] = float("nan")
    pert = {k: (v.float() * 1.5).to(v.dtype) for k, v in sd.items() if k.endswith("proj.weight")}
    pert["model.norm.weight"] = norm
    save_file(pert, str(tmp_path / "nan.safetensors"))
    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    prompt = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8])]
    before_v = llm_fs.collective_rpc("foursight_weight_version")
    before = llm_fs.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    with pytest.raises(Exception, match=r"tensor model\.norm\.weight.*non-finite"):
        llm_fs.collective_rpc("foursight_update_weights", args=(str(tmp_path / "nan.safetensors"), 99))
    assert llm_fs.collective_rpc("foursight_weight_version") == before_v
    after = llm_fs.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert after.token_ids == before.token_ids
    lp = lambda out: [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]  # noqa: E731
    assert lp(after) == lp(before)
