"""TRL's NCCL road through the bridge, on the CPU: TRL's own ``VLLMClient`` against a bridge in front of a vLLM
server, the group passed through to the engine (:mod:`foursight.trainer_bridge.broadcast`) on each of the bridge's
vLLM routes (the FourSight worker extension's ``collective_rpc``; vLLM 0.32's weight-transfer API with ``foursight_nccl``).

TRL's client is used as it is, except for the two calls of its road that only run on CUDA, replaced for the test
by their Gloo counterparts with the same arguments: ``open_trainer_endpoint`` (vLLM's ``trainer_init``: a
``PyNcclCommunicator`` on the current CUDA device) by :func:`weight_broadcast.open_trainer_group` with Gloo, and
``packed_nccl_broadcast_producer`` (CUDA streams, NCCL) by :func:`weight_broadcast.broadcast_packed`. Its
``init_communicator`` also refuses a device that is not CUDA; ``device="cuda"`` (no index) passes that check
without touching CUDA. Everything else (``/get_world_size``, the ``init_info`` it builds, ``/start_weight_update``,
the ``update_info`` it announces, ``/update_weights`` run beside the broadcast, ``/finish_weight_update``) is TRL's.

Oracle: the file road on the same engine (``foursight_update_weights`` of the same tensors), bit for bit; and the
engine's logprobs before a refused update, unchanged. Where an engine cannot join a group, TRL's NCCL
``init_info`` is still 422 (``tests/test_bridge_trl.py::test_trl_client_syncs_through_the_bridge_routes``, HF engine).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("trl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("route", ["collective_rpc", "native"])
def test_trls_client_broadcasts_through_the_bridge(route, tiny_llama_dir, tiny_ckpt, tmp_path, monkeypatch):
    """A FourSight checkpoint served by vLLM, the bridge on its ``route`` (the worker extension's
    ``foursight_broadcast_*``, or vLLM's weight-transfer API with ``foursight_nccl``); TRL's client syncs a learner
    over the group through the bridge: the bridge's version goes up by one and the engine serves exactly what the
    file road (``foursight_update_weights`` of the same tensors) serves; a NaN norm is refused (TRL's call raises
    naming it, 422) and the engine keeps its version and its logprobs; the next update goes through the same group."""
    import httpx
    import trl.generation.vllm_client as trl_client
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from foursight.quant_methods.weight_broadcast import broadcast_packed, open_trainer_group
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.client import RolloutClient
    from foursight.trainer_bridge.launch import BridgeThread, VLLMServer, free_port
    from foursight.trainer_bridge.server import create_app
    from helpers.weights import perturbed_state

    monkeypatch.setattr(trl_client, "open_trainer_endpoint", lambda info: open_trainer_group(info, "gloo"))
    monkeypatch.setattr(trl_client, "packed_nccl_broadcast_producer", broadcast_packed)
    extra = ["--quantization", "foursight", "--worker-extension-cls", EXT]
    if route == "native":
        extra += ["--weight-transfer-config", json.dumps({"backend": "foursight_nccl"})]
    srv = VLLMServer(tiny_ckpt, max_model_len=256, log_path=tmp_path / "vllm.log", weights_dir=tmp_path, extra_args=extra).start(400)
    bridge = None

    def file_road(path, version: int) -> None:
        """The same tensors through the file road: the bridge's POST /v1/weights where it takes files (collective_rpc),
        else the engine's own foursight_update_weights (a native engine with foursight_nccl takes no file)."""
        if route == "collective_rpc":
            rc.update_weights(version=version, path=str(path))
            return
        r = httpx.post(srv.url + "/collective_rpc", json={"method": "foursight_update_weights", "args": [str(path), str(version)],
                                                         "kwargs": {"token": srv.weights_token}}, timeout=300)
        assert r.status_code == 200, r.text[:300]
        assert httpx.post(srv.url + "/reset_prefix_cache", json={}, timeout=60).status_code == 200

    try:
        bridge = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=tiny_ckpt, weights_token=srv.weights_token, weight_sync=route)],
                                         weights_dirs=[tmp_path])).start()
        prompt, params = [[5, 9, 13, 17]], {"max_tokens": 8, "temperature": 0.0}
        client = trl_client.VLLMClient(base_url=bridge.url, group_port=free_port(), connection_timeout=120)
        assert client.get_world_size() == 1
        for bad, field in (({"world_size": 3}, "init_info.world_size"), ({"rank_offset": 2}, "init_info.rank_offset")):
            nccl = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2, **bad}
            r = httpx.post(bridge.url + "/init_weight_transfer_engine", json={"init_info": nccl}, timeout=60)
            assert r.status_code == 422 and field in r.text, r.text  # refused before any engine is asked to join
        client.init_communicator(device="cuda")  # the CUDA check passes; the group is Gloo (see the module docstring)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
        model.load_state_dict(perturbed_state(tiny_llama_dir, seed=5), strict=False)
        with RolloutClient(bridge.url) as rc:
            before = rc.generate(prompt, params)[0]
            client.update_model_params(model)
            assert rc.weight_version() == 1
            if route == "native":
                assert httpx.get(srv.url + "/weight_info", timeout=30).json()["weight_version"].startswith("1-")
            broadcast = rc.generate(prompt, params)[0]
            assert broadcast.weight_version == 1 and broadcast.logprobs != before.logprobs
            # the file road on the same engine: back to the original weights, then the same tensors as a file
            new = {n: p.detach().clone() for n, p in model.named_parameters()}
            save_file(new, str(tmp_path / "new.safetensors"))
            orig = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
            save_file({n: p.detach().clone() for n, p in orig.named_parameters()}, str(tmp_path / "orig.safetensors"))
            file_road(tmp_path / "orig.safetensors", 2)
            assert rc.generate(prompt, params)[0].logprobs == before.logprobs
            file_road(tmp_path / "new.safetensors", 3)
            filed = rc.generate(prompt, params)[0]
            assert (filed.token_ids, filed.logprobs) == (broadcast.token_ids, broadcast.logprobs)
            version = rc.weight_version()
            # a diverged step over the group: refused by the engine after it received it, nothing loaded
            with torch.no_grad():
                model.model.norm.weight[0] = float("nan")
            with pytest.raises(Exception, match=r"422.*model\.norm\.weight"):
                client.update_model_params(model)
            assert rc.weight_version() == version
            again = rc.generate(prompt, params)[0]
            assert again.weight_version == version and again.logprobs == filed.logprobs
            h = httpx.get(bridge.url + "/v1/health", timeout=120)
            assert h.status_code == 200 and h.json()["engines"][0]["sync"] == "in_sync", h.text
            # the group stays usable after a refusal: the next good update goes through it
            with torch.no_grad():
                model.model.norm.weight.copy_(new["model.norm.weight"])
            client.update_model_params(model)
            assert rc.weight_version() == version + 1 and rc.generate(prompt, params)[0].logprobs == filed.logprobs
        client.close_communicator()
    finally:
        if bridge is not None:
            bridge.stop()
        srv.stop()
