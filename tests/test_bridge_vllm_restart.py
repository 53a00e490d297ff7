"""Issue 14, liveness: a real vLLM engine (CPU, tiny Llama, FourSight worker extension) restarted
behind the bridge after a weight update. Before: the bridge kept tagging samples with the pushed
version while the engine served its original weights, and health said ok."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("vllm")

from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient  # noqa: E402
from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine  # noqa: E402
from foursight.trainer_bridge.launch import BridgeThread, VLLMServer  # noqa: E402
from foursight.trainer_bridge.scoring import pad_rollouts, score  # noqa: E402
from foursight.trainer_bridge.server import create_app  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXT = ["--worker-extension-cls", "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"]


def _hf_with(model_dir, state):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    m.load_state_dict(state, strict=False)
    return m


def _mean_err(model, rs) -> float:
    lt, lr, m = pad_rollouts(rs, score(model, rs))
    return float((lt - lr)[m].abs().mean())


def test_engine_restart_after_an_update_is_detected_and_refused(tiny_llama_dir, tmp_path):
    srv = VLLMServer(tiny_llama_dir, max_model_len=512, log_path=tmp_path / "vllm1.log", extra_args=EXT,
                     weights_dir=tmp_path).start(timeout_s=400)
    b = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=tiny_llama_dir, weights_token=srv.weights_token)])).start()
    srv2 = None
    try:
        state = perturbed_state(tiny_llama_dir)
        save_file(state, str(tmp_path / "step21.safetensors"))
        prompts, sp = [[5, 6, 7, 8], [11, 12, 13]], {"max_tokens": 12, "temperature": 1.0, "seed": 3}
        with RolloutClient(b.url) as c:
            e0 = c.health()["engines"][0]
            assert e0["sync"] == "in_sync" and e0["engine_version"] == 0 and e0["probe"]["ok"]
            c.update_weights(version=21, path=str(tmp_path / "step21.safetensors"))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["weight_version"] == 21 and h["engines"][0]["engine_version"] == 21

            srv.kill()  # the engine dies and comes back on its checkpoint, same URL
            srv2 = VLLMServer(tiny_llama_dir, port=srv.port, max_model_len=512, log_path=tmp_path / "vllm2.log", extra_args=EXT,
                              weights_dir=tmp_path, weights_token=srv.weights_token)
            srv2.start(timeout_s=400)

            r = httpx.get(b.url + "/v1/health", timeout=60)
            assert r.status_code == 503 and r.json()["status"] == "degraded"
            e = r.json()["engines"][0]
            assert e["up"] is True and e["sync"] == "stale" and e["engine_version"] == 0 and e["weight_version"] is None
            assert e["restarted"] is True and e["boot_id"] == e0["boot_id"]  # the one the bridge pushed to
            assert "restarted" in e["reason"] and "version 21" in e["reason"]
            with pytest.raises(BridgeHTTPError) as ei:
                c.generate(prompts, sp, n=2)
            assert ei.value.status == 503 and "reports weight version 0" in str(ei.value)
            # the OpenAI route takes the same admission path: refused too, not tagged version 21
            r = httpx.post(b.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
            assert r.status_code == 503 and "reports weight version 0" in r.json()["error"]["message"], r.text

            # the trainer pushes again: the engine is back on the new weights, samples say 22
            c.update_weights(version=22, path=str(tmp_path / "step21.safetensors"))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["engine_version"] == 22 and h["engines"][0]["boot_id"] != e0["boot_id"]
            rs = c.generate(prompts, sp, n=2)

            # a NaN in model.norm.weight: the bridge refuses it naming the tensor, and so does the
            # worker itself when called directly; the version stays and the engine stays healthy
            bad = dict(state)
            bad["model.norm.weight"] = torch.full((128,), float("nan"), dtype=torch.bfloat16)
            save_file(bad, str(tmp_path / "nan.safetensors"))
            with pytest.raises(BridgeHTTPError) as ei:
                c.update_weights(version=23, path=str(tmp_path / "nan.safetensors"))
            assert ei.value.status == 422 and "tensor model.norm.weight" in str(ei.value) and "non-finite" in str(ei.value)
            r = httpx.post(srv2.url + "/collective_rpc", json={"method": "foursight_update_weights",
                                                                "args": [str(tmp_path / "nan.safetensors"), "23"],
                                                                "kwargs": {"token": srv.weights_token}}, timeout=120)
            assert r.status_code != 200 and "model.norm.weight" in r.text
            # a path that does not exist: the same 422 as on every engine kind (before: 502 from vLLM)
            with pytest.raises(BridgeHTTPError) as ei:
                c.update_weights(version=23, path=str(tmp_path / "missing.safetensors"))
            assert ei.value.status == 422 and "not an allowed weights file" in str(ei.value)
            h = c.health()
            assert h["status"] == "ok" and h["weight_version"] == 22 and h["engines"][0]["engine_version"] == 22
        assert {r.weight_version for r in rs} == {22}
        err_new, err_stale = _mean_err(_hf_with(tiny_llama_dir, state), rs), _mean_err(_hf_with(tiny_llama_dir, {}), rs)
        print(f"\nafter the re-push: mean|r| vs new weights {err_new:.4f}, vs the checkpoint {err_stale:.4f}")
        assert err_new < 0.05 and err_stale > 5 * err_new
    finally:
        b.stop()
        srv.stop()
        if srv2 is not None:
            srv2.stop()


def test_engine_restart_is_detected_on_the_native_sync_route(tiny_llama_dir, tmp_path):
    """Issue 28, class 4: with ``weight_sync="native"`` (vLLM's own weight-transfer API, no FourSight worker
    extension) a vLLM restarted from its checkpoint after an update was not noticed: samples kept the pushed
    version while the engine served the original weights, and health said ok. The engine's version now comes
    from its ``/weight_info``, which a restart resets."""
    import json

    args = ["--weight-transfer-config", json.dumps({"backend": "foursight_file"})]
    srv = VLLMServer(tiny_llama_dir, max_model_len=512, log_path=tmp_path / "vllm1.log", extra_args=args,
                     weights_dir=tmp_path).start(timeout_s=400)
    b = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=tiny_llama_dir, weight_sync="native",
                                                weights_token=srv.weights_token)])).start()
    srv2 = None
    try:
        save_file(perturbed_state(tiny_llama_dir), str(tmp_path / "step5.safetensors"))
        prompts, sp = [[5, 6, 7, 8]], {"max_tokens": 6, "temperature": 1.0, "seed": 3}
        with RolloutClient(b.url) as c:
            assert c.health()["engines"][0]["sync"] == "in_sync"
            c.update_weights(version=5, path=str(tmp_path / "step5.safetensors"))
            assert c.health()["engines"][0]["engine_version"] == 5

            srv.kill()
            srv2 = VLLMServer(tiny_llama_dir, port=srv.port, max_model_len=512, log_path=tmp_path / "vllm2.log", extra_args=args,
                              weights_dir=tmp_path, weights_token=srv.weights_token)
            srv2.start(timeout_s=400)

            r = httpx.get(b.url + "/v1/health", timeout=60)
            assert r.status_code == 503, r.text
            e = r.json()["engines"][0]
            assert e["sync"] == "stale" and e["engine_version"] == 0 and e["weight_version"] is None, e
            with pytest.raises(BridgeHTTPError) as ei:
                c.generate(prompts, sp, n=1)
            assert ei.value.status == 503 and "reports weight version 0" in str(ei.value)

            c.update_weights(version=6, path=str(tmp_path / "step5.safetensors"))  # the re-push brings it back
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["engine_version"] == 6
            assert {r.weight_version for r in c.generate(prompts, sp, n=1)} == {6}
    finally:
        b.stop()
        srv.stop()
        if srv2 is not None:
            srv2.stop()
