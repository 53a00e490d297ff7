"""RL weight updates through vLLM 0.32's native weight-transfer API with the FourSight backend
(``--weight-transfer-config '{"backend": "foursight_file"}'``), on the vLLM CPU engine.

Oracles: ``foursight.layer.quantize_weight`` of the new weights with the layer's channels, and
the ``/collective_rpc`` route (FourSightWorkerExtension), which must leave a bit-identical engine."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.checkpoint import quantize_model  # noqa: E402
from foursight.quantize_config import QuantizeConfig  # noqa: E402
from foursight.layer import quantize_weight  # noqa: E402
from foursight.calibration import builtin_texts  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from helpers.vllm_engine import EXT, engine_model  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = pytest.mark.vllm


def _files(tiny_llama_dir, tmp_path) -> tuple[Path, Path, Path]:
    """The perturbed weights split over two files (the native API takes an update in chunks) and whole."""
    from safetensors.torch import save_file

    new = perturbed_state(tiny_llama_dir, seed=3)
    names = sorted(new)
    a, b, whole = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "whole.safetensors"
    save_file({n: new[n] for n in names[::2]}, str(a))
    save_file({n: new[n] for n in names[1::2]}, str(b))
    save_file(new, str(whole))
    return a, b, whole


def test_native_update_equals_the_collective_rpc_route(tiny_llama_dir, tmp_path):
    """A checkpoint-mode engine updated through start/update (two chunks)/finish: every layer is
    quantize_weight(new W, same channels); its logprobs are bit-identical to the same update
    through /collective_rpc's foursight_update_weights, and differ from the old weights'."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    ckpt = quantize_model(tiny_llama_dir, tmp_path / "ck", QuantizeConfig(channels="16"), progress=False).out_dir
    a, b, whole = _files(tiny_llama_dir, tmp_path)
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(ckpt), builtin_texts()[:3], 32)
    llm = LLM(model=str(ckpt), enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0, worker_extension_cls=EXT,
              weight_transfer_config={"backend": "foursight_file"})
    try:
        lp_old = engine_prompt_logprobs(llm, seqs)
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        llm.start_weight_update()
        llm.update_weights(WeightTransferUpdateRequest(update_info={"path": str(a)}))
        llm.update_weights(WeightTransferUpdateRequest(update_info={"path": str(b)}))
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        lp_native = engine_prompt_logprobs(llm, seqs)
        sd = load_file(str(whole))
        n = 0
        for mod in engine_model(llm).modules():
            plan = getattr(mod, "foursight_plan", None)
            if plan is None:
                continue
            st = mod.foursight_state
            exp = torch.cat([quantize_weight(sd[f"{s}.weight"], st.channels).weight_packed for s in plan.layout.shard_names])
            assert torch.equal(st.qw.weight_packed, exp), plan.layout.prefix
            n += 1
        assert n == 8
        # back to the original weights, then the same update through the other route
        llm.collective_rpc("foursight_update_weights", args=(str(Path(tiny_llama_dir) / "model.safetensors"), 1))
        llm.reset_prefix_cache()
        assert engine_prompt_logprobs(llm, seqs)[0].tolist() != lp_native[0].tolist()
        llm.collective_rpc("foursight_update_weights", args=(str(whole), 2))
        llm.reset_prefix_cache()
        lp_rpc = engine_prompt_logprobs(llm, seqs)
        assert all(torch.equal(x, y) for x, y in zip(lp_native, lp_rpc))
        assert max(float((x - y).abs().max()) for x, y in zip(lp_native, lp_old)) > 0.01
    finally:
        del llm
        gc.collect()


@pytest.mark.slow
def test_bridge_updates_a_vllm_server_through_the_native_api(tiny_llama_dir, tiny_ckpt, tmp_path):
    """The bridge with ``--weight-sync native`` updates a vLLM server started with
    --weight-transfer-config foursight_file (no worker extension): the server reports the new
    version (``/weight_info``) and the rollouts' logprobs are the new weights' (vLLM's own
    /v1/completions before and after agree with the bridge's stream). Issue 38: an update the
    engine refuses (int32 norm, checked by the worker) is 422 naming engine and tensor, and the engine
    stays in service (before: 502, then 503 on health and rollouts); ``/update_weights`` without the
    engine's token, or for a file outside its weights folder, is refused naming no path. Issue 53: vLLM's own
    ``reset_weights`` makes the bridge see the engine stale until its next update."""
    from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread, VLLMServer
    from foursight.trainer_bridge.server import create_app

    ckpt = tiny_ckpt
    _, _, whole = _files(tiny_llama_dir, tmp_path)
    srv = VLLMServer(ckpt, max_model_len=256, log_path=tmp_path / "vllm.log", weights_dir=tmp_path,
                     extra_args=["--quantization", "foursight", "--weight-transfer-config", json.dumps({"backend": "foursight_file"})]).start(300)
    bridge = None
    try:
        bridge = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=ckpt, weight_sync="native", weights_token=srv.weights_token)],
                                         weights_dirs=[tmp_path])).start()
        with RolloutClient(bridge.url) as c:
            before = c.generate([[5, 9, 13, 17]], {"max_tokens": 8, "temperature": 0.0})[0]
            ack = c.update_weights(version=3, path=str(whole))
            assert ack["version"] == 3 and ack["engines"][0]["route"] == "native", ack
            after = c.generate([[5, 9, 13, 17]], {"max_tokens": 8, "temperature": 0.0})[0]
            # refused by the worker before anything loads: 422, engine in sync and serving version 3
            sd = load_file(str(whole))
            sd["model.norm.weight"] = torch.ones(load_file(str(Path(tiny_llama_dir) / "model.safetensors"))["model.norm.weight"].shape,
                                                 dtype=torch.int32)
            save_file(sd, str(tmp_path / "int32.safetensors"))
            with pytest.raises(BridgeHTTPError) as ei:
                c.update_weights(version=4, path=str(tmp_path / "int32.safetensors"))
            assert ei.value.status == 422 and "vllm@" in str(ei.value) and "model.norm.weight" in str(ei.value), str(ei.value)
            h = httpx.get(bridge.url + "/v1/health", timeout=120)
            assert h.status_code == 200 and h.json()["engines"][0]["sync"] == "in_sync", h.text
            again = c.generate([[5, 9, 13, 17]], {"max_tokens": 8, "temperature": 0.0})[0]
            assert again.weight_version == 3 and again.logprobs == after.logprobs
        assert after.weight_version == 3 and before.weight_version == 0
        assert httpx.get(srv.url + "/weight_info").json()["weight_version"].startswith("3-")
        model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        own = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": [5, 9, 13, 17], "max_tokens": 8, "temperature": 0.0,
                                                            "logprobs": 0, "return_tokens_as_token_ids": True}, timeout=120).json()
        assert after.logprobs == own["choices"][0]["logprobs"]["token_logprobs"]
        assert after.logprobs != before.logprobs
        # vLLM's own routes, called directly: no token, a wrong one, a file outside the folder
        outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
        save_file(load_file(str(whole)), str(outside))
        try:
            for info in ({"path": str(whole)}, {"path": str(whole), "token": "wrong"}, {"path": str(outside), "token": srv.weights_token},
                         {"path": "/etc/hostname", "token": srv.weights_token}):
                httpx.post(srv.url + "/start_weight_update", timeout=60)
                r = httpx.post(srv.url + "/update_weights", json={"update_info": info}, timeout=120)
                assert r.status_code != 200 and "FourSight refused the weight update, nothing loaded" in r.text, (info, r.text[:300])
                assert str(outside) not in r.text and "/etc" not in r.text, r.text[:300]
        finally:
            outside.unlink()
        assert httpx.get(srv.url + "/weight_info").json()["weight_version"].startswith("3-")
        # issue 53 item 3 on this route: vLLM's own reset_weights now changes the engine core's weight version, so the
        # bridge sees the engine stale until its next update (d00d877: in_sync, tagging the zeroed engine's samples 3)
        assert httpx.post(srv.url + "/collective_rpc", json={"method": "reset_weights"}, timeout=120).status_code == 200
        h = httpx.get(bridge.url + "/v1/health?probe=false", timeout=120)
        assert h.status_code == 503 and h.json()["engines"][0]["sync"] == "stale", h.text
        with RolloutClient(bridge.url) as c:
            assert c.update_weights(version=5, path=str(whole))["version"] == 5
        assert httpx.get(bridge.url + "/v1/health?probe=false", timeout=120).json()["engines"][0]["sync"] == "in_sync"
    finally:
        if bridge is not None:
            bridge.stop()
        srv.stop()


def test_native_route_loads_the_tensors_it_checked(tiny_llama_dir, tiny_ckpt, tmp_path):
    """Issue 38 item 2: ``update_weights`` keeps the tensors it checked, not the path. A file rewritten
    with a NaN norm before ``finish_weight_update`` (before: served), and one path reused for two
    buckets (before: the last bucket loaded twice, the first bucket's layers kept their old weights),
    both end bit-identical to the same weights pushed whole through ``/collective_rpc``."""
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    new = perturbed_state(tiny_llama_dir, seed=4)
    orig = str(Path(tiny_llama_dir) / "model.safetensors")
    save_file(new, str(tmp_path / "whole.safetensors"))
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_ckpt), builtin_texts()[:3], 32)
    llm = LLM(model=str(tiny_ckpt), enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0, worker_extension_cls=EXT,
              weight_transfer_config={"backend": "foursight_file"})
    path = tmp_path / "bucket.safetensors"

    def native(buckets: list[dict], after_each=None) -> list[torch.Tensor]:
        llm.start_weight_update()
        for i, b in enumerate(buckets):
            save_file(b, str(path))
            llm.update_weights(WeightTransferUpdateRequest(update_info={"path": str(path)}))
            if after_each is not None:
                after_each(i)
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        return engine_prompt_logprobs(llm, seqs)

    def rpc(file: str, version: int) -> list[torch.Tensor]:
        llm.collective_rpc("foursight_update_weights", args=(file, version))
        llm.reset_prefix_cache()
        return engine_prompt_logprobs(llm, seqs)

    def poison(_):
        bad = {**new, "model.norm.weight": torch.full_like(load_file(orig)["model.norm.weight"], float("nan"))}
        save_file(bad, str(path))

    try:
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        ref = rpc(str(tmp_path / "whole.safetensors"), 1)
        base = rpc(orig, 2)
        assert not all(torch.equal(a, b) for a, b in zip(ref, base))
        rewritten = native([new], after_each=poison)
        assert all(torch.isfinite(x).all() for x in rewritten), "the NaN written after the check was served"
        assert all(torch.equal(a, b) for a, b in zip(rewritten, ref))
        rpc(orig, 3)
        names = sorted(new)
        reused = native([{n: new[n] for n in names[: len(names) // 2]}, {n: new[n] for n in names[len(names) // 2:]}])
        assert all(torch.equal(a, b) for a, b in zip(reused, ref)), "a bucket of a reused path was not loaded"
    finally:
        del llm
        gc.collect()


def test_fused_shard_gate_holds_shards_until_the_fused_layer_is_complete():
    """The gate lets a fused layer's shards through only together (in the mapping's order, across
    several calls), passes every other tensor at once, and names what is left incomplete."""
    from foursight.quant_methods.vllm_weight_update import FusedShardGate, check_fused_complete

    class Model(torch.nn.Module):
        packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    att = "model.layers.0.self_attn"
    gate = FusedShardGate(Model())
    first = [n for n, _ in gate.admit([(f"{att}.k_proj.weight", 1), (f"{att}.o_proj.weight", 2), (f"{att}.q_proj.weight", 3),
                                       ("model.layers.0.mlp.up_proj.weight", 4)])]
    assert first == [f"{att}.o_proj.weight"]
    assert gate.incomplete() == ["model.layers.0.mlp.gate_up_proj.weight (got up_proj; missing gate_proj)",
                                 f"{att}.qkv_proj.weight (got q_proj, k_proj; missing v_proj)"]
    second = list(gate.admit([(f"{att}.v_proj.weight", 5), ("model.layers.0.mlp.gate_proj.weight", 6)]))
    assert second == [(f"{att}.q_proj.weight", 3), (f"{att}.k_proj.weight", 1), (f"{att}.v_proj.weight", 5),
                      ("model.layers.0.mlp.gate_proj.weight", 6), ("model.layers.0.mlp.up_proj.weight", 4)]
    assert gate.incomplete() == []
    # restricted to one fused layer (the engine passes its CPU-packed ones): the others pass at once
    only = FusedShardGate(Model(), only=[f"{att}.qkv_proj"])
    assert [n for n, _ in only.admit([("model.layers.0.mlp.up_proj.weight", 1), (f"{att}.q_proj.bias", 2)])] == \
        ["model.layers.0.mlp.up_proj.weight"]
    assert only.incomplete() == [f"{att}.qkv_proj.bias (got q_proj; missing k_proj, v_proj)"]
    # an unpacked model (no CPU-packed layer) takes half a fused layer
    check_fused_complete(Model(), [f"{att}.q_proj.weight"])
