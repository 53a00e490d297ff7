"""TRL adapter: the filter on a GRPO batch in TRL's own format (trl 1.16.0 installed; no vLLM server
or training run here — the batch is synthetic, shaped like ``_generate_and_score_completions``'s)."""

from __future__ import annotations

import inspect
import math
from collections import defaultdict

import pytest
import torch

trl = pytest.importorskip("trl")

from foursight.trainer_bridge.filters import FilterConfig  # noqa: E402
from foursight.trainer_bridge.trl import apply_filter_to_trl_batch, check_trl_args  # noqa: E402


def _batch(B=8, T=10, drifted=(1, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    samp = -torch.rand(B, T, generator=g) * 5
    old = samp + torch.randn(B, T, generator=g) * 1e-4
    cm = torch.ones(B, T, dtype=torch.long)
    cm[0, 7:] = 0
    cm[3, 4:] = 0
    for b in drifted:
        old[b, 2] += 2.0  # learner assigns e^2 more probability than the engine: a tail token
    return {
        "prompt_ids": torch.zeros(B, 3, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": cm,
        "old_per_token_logps": old,
        "sampling_per_token_logps": samp,
        "importance_sampling_ratio": torch.ones(B, 1),
        "advantages": torch.zeros(B),
    }


def test_filter_replaces_trl_is_ratio():
    batch = _batch()
    cm_before = batch["completion_mask"].clone()
    out, metrics = apply_filter_to_trl_batch(batch, FilterConfig(policy="max_token"))
    keep = out["foursight_keep"]
    assert (~keep).nonzero().flatten().tolist() == [1, 6]
    w = out["importance_sampling_ratio"]
    assert w.shape == (8, 10)
    expected = cm_before.float() * keep[:, None].float()
    assert torch.equal(w, expected)
    assert torch.equal(out["completion_mask"], cm_before)  # attention mask untouched
    assert metrics["tim/tail_tokens"] == 2 and metrics["filter/dropped_sequences"] == 2
    assert "rollout_corr/k3_kl" in metrics and metrics["filter/nan_sampling_logps"] == 0


def test_filter_with_tis_and_nan_sampling_logps():
    batch = _batch(drifted=())
    batch["sampling_per_token_logps"][2, 5] = float("nan")  # vLLM could not score this token
    batch["old_per_token_logps"][4, 1] = batch["sampling_per_token_logps"][4, 1] + math.log(2.5)
    out, metrics = apply_filter_to_trl_batch(batch, FilterConfig(policy="max_token", tis_cap=2.0))
    assert bool(out["foursight_keep"].all())
    w = out["importance_sampling_ratio"]
    assert w[4, 1] == pytest.approx(2.0)  # truncated at the cap
    assert w[2, 5] == pytest.approx(1.0)  # NaN -> r = 0 -> weight 1, as TRL does
    assert float(w[0, 7:].abs().sum()) == 0.0  # padding
    assert metrics["filter/nan_sampling_logps"] == 1 and metrics["filter/tis_clip_fraction"] > 0


def test_missing_keys_are_named():
    b = _batch()
    del b["sampling_per_token_logps"]
    with pytest.raises(KeyError, match="sampling_per_token_logps"):
        apply_filter_to_trl_batch(b)


def test_trl_still_multiplies_the_ratio_into_the_loss():
    """The hook relies on TRL's documented behaviour; fail loudly if a TRL upgrade changes it."""
    from trl import GRPOConfig, GRPOTrainer

    src = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'per_token_loss * inputs["importance_sampling_ratio"]' in src
    gen = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in ('"old_per_token_logps"', '"sampling_per_token_logps"', '"importance_sampling_ratio"'):
        assert key in gen
    fields = GRPOConfig.__dataclass_fields__
    assert fields["vllm_importance_sampling_clip_max"].default == 3.0
    assert fields["vllm_importance_sampling_mode"].default == "sequence_mask"


def test_trainer_subclass_hook(monkeypatch):
    from trl import GRPOTrainer

    from foursight.trainer_bridge.trl import FourSightGRPOTrainer

    assert issubclass(FourSightGRPOTrainer, GRPOTrainer)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: _batch())
    tr = object.__new__(FourSightGRPOTrainer)  # no model / vLLM server needed to exercise the hook
    tr.foursight_filter = FilterConfig(policy="tail_count", max_tail_tokens=0)
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr.model = torch.nn.Linear(1, 1)
    out = tr._generate_and_score_completions([{}])
    assert (~out["foursight_keep"]).nonzero().flatten().tolist() == [1, 6]
    assert tr._metrics["train"]["foursight/filter/dropped_sequences"] == [2.0]
    assert "foursight/rollout_corr/kl" in tr._metrics["train"]


def test_check_trl_args():
    class A:
        use_vllm = False

    with pytest.raises(ValueError, match="use_vllm"):
        check_trl_args(A())

    class B:
        use_vllm = True
        vllm_importance_sampling_correction = False

    with pytest.raises(ValueError, match="vllm_importance_sampling_correction"):
        check_trl_args(B())


# ---- verl adapter (verl is not installed: a DataProto-shaped stand-in with a dict .batch) ----
def test_verl_batch_filter_and_hook(monkeypatch):
    import sys
    import types

    from foursight.trainer_bridge.verl import apply_to_verl_batch, install_verl_hook

    b = _batch()
    proto = types.SimpleNamespace(batch={"old_log_probs": b["old_per_token_logps"], "rollout_log_probs": b["sampling_per_token_logps"],
                                         "response_mask": b["completion_mask"].clone()})
    out, metrics = apply_to_verl_batch(proto, {"policy": "max_token", "tis_cap": 2.0})
    assert out.batch["response_mask"][[1, 6]].sum() == 0 and out.batch["response_mask"].dtype == torch.long
    assert torch.equal(out.batch["response_mask"][0], b["completion_mask"][0])
    assert out.batch["rollout_is_weights"].shape == (8, 10)
    assert all(k.startswith("rollout_corr/") for k in metrics)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 8)
    # the hook swaps the function verl's trainer imports at call time
    helper = types.ModuleType("verl.trainer.ppo.rollout_corr_helper")
    helper.compute_rollout_correction_and_add_to_batch = lambda batch, cfg: (batch, {})
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.rollout_corr_helper", helper)
    sys.modules["verl.trainer.ppo"].rollout_corr_helper = helper
    install_verl_hook({"policy": "max_token"})
    proto2 = types.SimpleNamespace(batch={"old_log_probs": b["old_per_token_logps"], "rollout_log_probs": b["sampling_per_token_logps"],
                                          "response_mask": b["completion_mask"].clone()})
    _, m2 = helper.compute_rollout_correction_and_add_to_batch(proto2, {"rollout_is": None})
    assert m2["rollout_corr/filter/dropped_sequences"] == 2


# ---- TRL server mode against the bridge: FourSightVLLMClient and the bridge's TRL routes ----
def test_trl_client_syncs_through_the_bridge_routes(tiny_llama_dir, tmp_path):
    """TRL's client protocol against the bridge (HF engine): /server_info names the file backend,
    init refuses TRL's NCCL handshake naming the client to use, and FourSightVLLMClient's updates
    (one per call, or one for a whole ``weight_update()`` block) become bridge weight versions whose
    engine serves the new weights (its greedy tokens equal transformers' on those weights)."""
    import httpx
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.backends.hf import HFEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app
    from foursight.trainer_bridge.trl import FourSightVLLMClient
    from helpers.weights import perturbed_state

    key = "k"
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=key, weights_dirs=[str(tmp_path)])).start()
    try:
        h = {"Authorization": f"Bearer {key}"}
        info = httpx.get(b.url + "/server_info", headers=h, timeout=30).json()["vllm_config"]
        assert info["weight_transfer_config"]["backend"] == "foursight_bridge" and info["model_config"]["logprobs_mode"] == "raw_logprobs"
        nccl = {"init_info": {"master_address": "10.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2}}
        r = httpx.post(b.url + "/init_weight_transfer_engine", json=nccl, headers=h, timeout=30)
        assert r.status_code == 422 and "FourSightVLLMClient" in r.text
        r = httpx.post(b.url + "/update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["bfloat16"], "shapes": [[1]]}},
                       headers=h, timeout=30)
        assert r.status_code == 422 and "update_info" in r.text
        assert httpx.post(b.url + "/server_info", timeout=30).status_code in (401, 405)

        c = FourSightVLLMClient(base_url=b.url, api_key=key, weights_dir=tmp_path, connection_timeout=30)
        c.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).float()  # a float32 learner: sent as BF16
        new = perturbed_state(tiny_llama_dir, seed=7)
        model.load_state_dict(new, strict=False)
        c.update_model_params(model)
        assert c.last_update["version"] == 1 and httpx.get(b.url + "/v1/weights", timeout=30).json()["version"] == 1
        with c.weight_update():
            for name, p in model.named_parameters():
                c.update_named_param(name, p.data)
        assert c.last_update["version"] == 2 and c.last_update["engines"][0]["version"] == 2
        assert not list(tmp_path.glob("foursight-trl-*"))  # the files are removed after each update
        ids = [5, 6, 7, 8]
        out = c.generate([ids], n=1, max_tokens=8, temperature=0.0, generation_kwargs={"ignore_eos": True})
        ref = model.to(torch.bfloat16).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, temperature=None, top_p=None,
                                                top_k=None, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out["completion_ids"][0] == ref
        c.reset_prefix_cache()
        c.close_communicator()
    finally:
        b.stop()


def test_trl_client_uploads_its_weights_from_another_host(tiny_llama_dir, tmp_path):
    """Issue 37 item 3, the part that runs here (loopback only): FourSightVLLMClient(upload=True) on a
    'trainer host' whose files the bridge cannot read sends each update over HTTP in chunks (a chunk
    size far below the file, so the chunking is exercised) into the bridge's --weights-dir, where it is
    applied and removed; the engine serves the learner's weights (greedy tokens equal transformers'); a
    refused update (NaN) is 422 and its upload is removed too; an upload name that could leave the folder is 422."""
    import httpx
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.backends.hf import HFEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.uploads import UPLOADS
    from foursight.trainer_bridge.server import create_app
    from foursight.trainer_bridge.trl import FourSightVLLMClient
    from helpers.weights import perturbed_state

    bridge_dir, trainer_dir = tmp_path / "bridge-weights", tmp_path / "trainer-host"
    bridge_dir.mkdir()
    trainer_dir.mkdir()
    key = "k"
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=key, weights_dirs=[str(bridge_dir)])).start()
    try:
        c = FourSightVLLMClient(base_url=b.url, api_key=key, weights_dir=trainer_dir, upload=True, upload_chunk_bytes=1 << 20,
                                connection_timeout=30)
        c.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
        model.load_state_dict(perturbed_state(tiny_llama_dir, seed=8), strict=False)
        c.update_model_params(model)
        assert c.last_update["version"] == 1
        assert not any((bridge_dir / UPLOADS).glob("*")) and not any(trainer_dir.iterdir())
        ids = [5, 6, 7, 8]
        out = c.generate([ids], n=1, max_tokens=8, temperature=0.0, generation_kwargs={"ignore_eos": True})
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, temperature=None, top_p=None, top_k=None,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out["completion_ids"][0] == ref
        bad = {n: p.detach().clone() for n, p in model.named_parameters()}
        bad["model.norm.weight"][0] = float("nan")
        with pytest.raises(Exception, match="422.*model.norm.weight"):
            c._push(bad)
        assert not any((bridge_dir / UPLOADS).glob("*")) and httpx.get(b.url + "/v1/weights", timeout=30).json()["version"] == 1
        h = {"Authorization": f"Bearer {key}"}
        for name in ("..%2Fx.safetensors", ".hidden.safetensors", "x.bin"):
            r = httpx.put(f"{b.url}/v1/weights/uploads/{name}", content=b"x", headers=h, timeout=30)
            assert r.status_code in (404, 422), (name, r.status_code)
        assert httpx.put(f"{b.url}/v1/weights/uploads/a.safetensors", content=b"x", timeout=30).status_code == 401
    finally:
        b.stop()


def test_trls_vllm_version_warning_prints_once():
    """TRL 1.16 warns that it supports vLLM up to 0.31 from every module that checks vLLM: the docs/trl.md
    example printed it 7 times. Importing as the example does (TRL first, then FourSight's trainer and
    client, then TRL's generation modules and another check) prints it at most once. A subprocess, so that
    nothing of this session's imports or pytest's warning capture counts."""
    import subprocess
    import sys

    code = ("import warnings\n"
            "from trl import GRPOConfig\n"
            "from foursight.trainer_bridge.trl import FourSightGRPOTrainer\n"
            "from foursight.trainer_bridge.trl_client import FourSightVLLMClient\n"
            "import trl.generation.vllm_generation, trl.generation.vllm_client\n"
            "from trl.import_utils import is_vllm_available\n"
            "is_vllm_available()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    n = r.stderr.count("TRL currently supports vLLM versions")
    from packaging.version import Version

    vllm = pytest.importorskip("vllm")
    outside = not Version("0.22.0") <= Version(Version(vllm.__version__).base_version) <= Version("0.31.0")  # TRL 1.16's range
    assert n == (1 if outside else 0), r.stderr[-3000:]
