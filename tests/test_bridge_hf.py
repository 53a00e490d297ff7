"""The bridge with the in-process HF engine: versioned weight updates (BF16 and FourSight
re-quantization), version tags, timeouts and bad updates."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient, RolloutError
from foursight.trainer_bridge.backends.hf import HFEngine
from foursight.trainer_bridge.launch import BridgeThread
from foursight.trainer_bridge.scoring import pad_rollouts, score
from foursight.trainer_bridge.server import create_app
from helpers.weights import perturbed_state as _perturbed_state, reference_with_weights

KEY = "k"


def _bf16_model_with(model_dir, state):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    m.load_state_dict(state, strict=False)
    return m


@pytest.fixture(scope="module")
def hf_bridge(tiny_llama_dir):
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=KEY, sample_timeout_s=120)).start()
    yield b
    b.stop()


def test_hf_engine_logprobs_are_the_models(hf_bridge, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    with RolloutClient(hf_bridge.url, api_key=KEY) as c:
        rs = c.generate([[5, 6, 7, 8], "hello world"], {"max_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": 1}, n=2)
    assert len(rs) == 4 and all(len(r.token_ids) == 12 and r.engine.startswith("hf@") for r in rs)
    m = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    lt, lr, mask = pad_rollouts(rs, score(m, rs))
    # KV-cached decode vs one teacher-forced forward of the same BF16 model
    assert float((lt - lr)[mask].abs().max()) < 0.1
    # the one-call form (score + pad + filter): same model on both sides, nothing is dropped
    import foursight.trainer_bridge as tb

    res = tb.filter(m, rs, {"policy": "max_token"})
    assert bool(res.keep.all()) and res.loss_mask.shape == mask.shape and res.metrics["tim/num_tokens"] == 48


def test_weight_update_versions_and_ordering(hf_bridge, tiny_llama_dir, tmp_path):
    """A stream started under version 0 finishes under 0; the update waits for it; later streams are 1
    and their logprobs are those of the new weights."""
    state = _perturbed_state(tiny_llama_dir)
    path = tmp_path / "new.safetensors"
    save_file(state, str(path))
    c = RolloutClient(hf_bridge.url, api_key=KEY)
    assert c.weight_version() == 0
    first_event = threading.Event()
    stream_events, t_stream_end = [], []

    def long_stream():
        for r in c.stream([[5, 6, 7]], {"max_tokens": 40, "ignore_eos": True, "seed": 2}, n=4):
            stream_events.append(r)
            first_event.set()
        t_stream_end.append(time.monotonic())

    th = threading.Thread(target=long_stream)
    th.start()
    assert first_event.wait(120)
    c2 = RolloutClient(hf_bridge.url, api_key=KEY)
    ack = c2.update_weights(version=1, path=str(path))
    t_update_done = time.monotonic()
    th.join(120)
    assert ack["version"] == 1 and ack["previous_version"] == 0
    assert ack["engines"][0]["updated_tensors"] == len(state)
    assert t_stream_end and t_stream_end[0] <= t_update_done  # the update waited for the old stream
    assert len(stream_events) == 4 and {r.weight_version for r in stream_events} == {0}
    assert c.weight_version() == 1

    new = c.generate([[5, 6, 7], [9, 10]], {"max_tokens": 16, "seed": 3}, n=2)
    assert {r.weight_version for r in new} == {1}
    lt_new, lr, mask = pad_rollouts(new, score(_bf16_model_with(tiny_llama_dir, state), new))
    from transformers import AutoModelForCausalLM

    lt_old, _, _ = pad_rollouts(new, score(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval(), new))
    err_new = float((lt_new - lr)[mask].abs().mean())
    err_old = float((lt_old - lr)[mask].abs().mean())
    assert err_new < 0.02 < err_old, (err_new, err_old)
    # versions only move forward
    with pytest.raises(BridgeHTTPError) as ei:
        c.update_weights(version=1, path=str(path))
    assert ei.value.status == 409
    c.close()
    c2.close()


def test_bad_weight_update_names_the_tensor(hf_bridge, tmp_path):
    c = RolloutClient(hf_bridge.url, api_key=KEY)
    v = c.weight_version()
    bad = tmp_path / "bad.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}, str(bad))
    with pytest.raises(BridgeHTTPError) as ei:
        c.update_weights(version=v + 1, path=str(bad))
    assert ei.value.status == 422 and "model.layers.0.self_attn.q_proj.weight" in str(ei.value)
    unknown = tmp_path / "unknown.safetensors"
    save_file({"model.layers.0.nope.weight": torch.zeros(3, dtype=torch.bfloat16)}, str(unknown))
    with pytest.raises(BridgeHTTPError, match="model.layers.0.nope.weight"):
        c.update_weights(version=v + 1, path=str(unknown))
    with pytest.raises(BridgeHTTPError) as ei:
        c.update_weights(version=v + 1, path=str(tmp_path / "missing.safetensors"))
    assert ei.value.status == 422 and "path" in str(ei.value)
    r = httpx.post(hf_bridge.url + "/v1/weights", json={"version": v + 1}, headers={"X-API-Key": KEY})
    assert r.status_code == 422 and "path, shm_name" in r.json()["error"]
    assert c.weight_version() == v
    c.close()


def test_sample_timeout_gives_error_events(tiny_llama_dir):
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], sample_timeout_s=120)).start()
    try:
        with RolloutClient(b.url) as c:
            with pytest.raises(RolloutError) as ei:
                c.generate([[5, 6, 7]], {"max_tokens": 400, "ignore_eos": True}, n=2, timeout_s=0.05)
            assert len(ei.value.errors) == 2 and all("timeout" in e.error for e in ei.value.errors)
            assert ei.value.end.status == "error" and ei.value.end.num_errors == 2
            out = list(c.stream([[5, 6, 7]], {"max_tokens": 400, "ignore_eos": True}, n=1, raise_on_error=False, timeout_s=0.05))
            assert len(out) == 1 and out[0].type == "error"
    finally:
        b.stop()


def test_foursight_hf_engine_requantizes_on_update(tiny_llama_dir, tmp_path):
    """HF engine on a FourSight checkpoint: after /v1/weights (via shared memory) its logprobs are those
    of the FourSight reference model built from the new BF16 weights with the same channels."""
    import os

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    ckpt = quantize_model(tiny_llama_dir, tmp_path / "ckpt", QuantizeConfig(channels="16"), progress=False).out_dir
    b = BridgeThread(create_app([HFEngine(ckpt, tokenizer=tiny_llama_dir)])).start()
    shm_name = f"foursight-test-{os.getpid()}.safetensors"
    shm_file = f"/dev/shm/{shm_name}"
    try:
        state = _perturbed_state(tiny_llama_dir, seed=1)
        save_file(state, shm_file)
        with RolloutClient(b.url) as c:
            assert c.health()["engines"][0]["name"].startswith("hf-foursight@")
            ack = c.update_weights(version=5, shm_name=shm_name)
            n_lin = sum(1 for k in state if k.endswith("proj.weight"))
            assert ack["engines"][0]["requantized_layers"] == n_lin
            rs = c.generate([[5, 6, 7, 8], [11, 12]], {"max_tokens": 12, "seed": 4}, n=2)
        assert {r.weight_version for r in rs} == {5}
        # independent reference: load the checkpoint, re-quantize each layer from the new weights
        ref = reference_with_weights(ckpt, state)
        lt, lr, mask = pad_rollouts(rs, score(ref, rs))
        assert float((lt - lr)[mask].abs().mean()) < 0.02
    finally:
        b.stop()
        if os.path.exists(shm_file):
            os.remove(shm_file)


@pytest.mark.parametrize("route", ["path", "shm_name"])
def test_non_finite_update_is_rejected_and_previous_weights_keep_serving(tiny_llama_dir, tmp_path, monkeypatch, route):
    """A new policy with one NaN in model.norm.weight (file or shared-memory route): 422 naming the
    tensor, the version unchanged, and the engine still serves the previous weights bit for bit."""
    monkeypatch.setenv("FOURSIGHT_SHM_DIR", str(tmp_path))
    state = _perturbed_state(tiny_llama_dir)
    from transformers import AutoModelForCausalLM

    norm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).model.norm.weight.detach().clone()
    norm[5] = float("nan")
    state["model.norm.weight"] = norm
    save_file(state, str(tmp_path / "nan.safetensors"))
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=KEY, sample_timeout_s=120)).start()
    try:
        c = RolloutClient(b.url, api_key=KEY)
        params = {"max_tokens": 8, "seed": 4, "temperature": 0.0}
        before = c.generate([[5, 6, 7]], params)
        kw = {"path": str(tmp_path / "nan.safetensors")} if route == "path" else {"shm_name": "nan.safetensors"}
        with pytest.raises(BridgeHTTPError) as ei:
            c.update_weights(version=1, **kw)
        assert ei.value.status == 422
        assert "tensor model.norm.weight" in str(ei.value) and "non-finite" in str(ei.value) and route in str(ei.value)
        assert c.weight_version() == 0
        after = c.generate([[5, 6, 7]], params)
        assert after[0].token_ids == before[0].token_ids and after[0].logprobs == before[0].logprobs
        assert {r.weight_version for r in after} == {0}
        c.close()
    finally:
        b.stop()


def test_hf_engine_rejects_non_finite_norm_without_applying_anything(tiny_llama_dir):
    """The engine's own check (a direct load, no bridge): every floating tensor, not only the
    re-quantized weights; nothing is copied when one is rejected."""
    from foursight.trainer_bridge.backends.base import EngineError

    e = HFEngine(tiny_llama_dir)
    e._load()
    state = _perturbed_state(tiny_llama_dir)
    w = e.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    bad = e.model.model.norm.weight.detach().clone()
    bad[0] = float("inf")
    state["model.norm.weight"] = bad
    with pytest.raises(EngineError, match=r"tensor model\.norm\.weight holds 1 non-finite"):
        e.load_tensors_sync(state, 1)
    assert torch.equal(e.model.model.layers[0].self_attn.q_proj.weight, w)
    assert bool(torch.isfinite(e.model.model.norm.weight).all())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def _wait_idle(eng, timeout_s: float = 10.0) -> None:
    """Wait until the HF engine's scheduler holds no sample; fail if it still does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and eng.active_samples:
        time.sleep(0.05)
    assert eng.active_samples == 0, "a cancelled sample is still in the HF engine's scheduler"


def _one_token_seconds(c) -> float:
    t0 = time.monotonic()
    c.generate([[5, 6]], {"max_tokens": 1})
    return time.monotonic() - t0


LONG = {"max_tokens": 1000, "ignore_eos": True, "seed": 2}  # ~20-80 s of HF generation on 2 CPU cores


def test_client_disconnect_stops_the_hf_generation_and_metrics_stay_true(tiny_llama_dir):
    """A client that goes away mid-sample: the generation stops (the next 1-token request does not
    wait for the 1000-token one), the stream is released (gauge 0, no reader holding the version
    gate) and the disconnect is counted."""
    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng], sample_timeout_s=600)).start()
    try:
        body = {"prompts": [{"token_ids": [5, 6, 7]}], "n": 1, "sampling": LONG}
        with httpx.Client(timeout=60) as h, h.stream("POST", b.url + "/v1/rollouts", json=body) as r:
            assert r.status_code == 200
            time.sleep(1.5)  # the engine is generating
            assert _metric(httpx.get(b.url + "/metrics").text, "foursight_bridge_active_streams") == 1.0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _metric(httpx.get(b.url + "/metrics").text, "foursight_bridge_active_streams") != 0.0:
            time.sleep(0.1)
        text = httpx.get(b.url + "/metrics").text
        assert _metric(text, "foursight_bridge_active_streams") == 0.0
        assert 'foursight_bridge_errors_total{kind="client_disconnect"} 1.0' in text
        assert httpx.get(b.url + "/v1/weights").json()["streams_open"] == 0
        _wait_idle(eng)  # the abandoned sample left the scheduler (it would otherwise run its 1000 tokens)
        with RolloutClient(b.url) as c:
            dt = _one_token_seconds(c)
        assert dt < 5.0, f"the next 1-token request took {dt:.1f} s: the abandoned generation kept the engine"
    finally:
        b.stop()


def test_sample_timeout_stops_the_hf_generation(tiny_llama_dir):
    """The per-sample deadline gives an error event and stops the generation itself."""
    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng])).start()
    try:
        with RolloutClient(b.url) as c:
            out = list(c.stream([[5, 6, 7]], LONG, n=1, raise_on_error=False, timeout_s=1.0))
            assert [o.type for o in out] == ["error"] and "timeout" in out[0].error
            _wait_idle(eng)
            dt = _one_token_seconds(c)
        assert dt < 5.0, f"the next 1-token request took {dt:.1f} s: the timed-out generation kept running"
    finally:
        b.stop()


def test_health_fails_while_the_hf_engine_cannot_complete_a_request(tiny_llama_dir):
    """A long request does not hold the round-robin HF engine: health's 1-token probe completes
    meanwhile (200). A stuck model (its lock held, as by a forward that never returns) does: the
    probe does not finish, so health is 503 naming why; once it is released health is 200 again."""
    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng], probe_timeout_s=1.0)).start()
    try:
        h = httpx.get(b.url + "/v1/health", timeout=30)
        assert h.status_code == 200 and h.json()["engines"][0]["probe"]["ok"] is True
        body = {"prompts": [{"token_ids": [5, 6, 7]}], "n": 1, "sampling": LONG}
        with httpx.Client(timeout=60) as hc, hc.stream("POST", b.url + "/v1/rollouts", json=body) as r:
            assert r.status_code == 200
            time.sleep(0.5)
            h = httpx.get(b.url + "/v1/health", timeout=30)
            assert h.status_code == 200 and h.json()["engines"][0]["probe"]["ok"] is True, h.json()
            assert eng.active_samples == 1  # the long one is still running
        _wait_idle(eng)
        with eng._lock:
            h = httpx.get(b.url + "/v1/health", timeout=30)
            assert h.status_code == 503 and h.json()["status"] == "degraded"
            e = h.json()["engines"][0]
            assert e["up"] is True and e["ok"] is False and "did not finish within 1.0 s" in e["probe"]["error"]
            assert httpx.get(b.url + "/v1/health?probe=false").status_code == 200  # liveness only
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(b.url + "/v1/health", timeout=30).status_code != 200:
            time.sleep(0.2)
        assert httpx.get(b.url + "/v1/health", timeout=30).status_code == 200
    finally:
        b.stop()


def test_short_request_is_not_starved_by_a_long_one(tiny_llama_dir):
    """Round-robin: while a 1000-token ignore_eos request runs, a 1-token request submitted after it
    finishes while the long one has produced less than half its tokens, and in less than half the
    long one's time."""
    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng], sample_timeout_s=600)).start()
    try:
        long_done, long_out = [], []

        def long_request():
            t0 = time.monotonic()
            with RolloutClient(b.url) as c:
                long_out.extend(c.generate([[5, 6, 7]], LONG))
            long_done.append(time.monotonic() - t0)

        th = threading.Thread(target=long_request)
        th.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(n >= 8 for n in eng.active_progress()):
            time.sleep(0.01)  # the long one is decoding
        with RolloutClient(b.url) as c:
            t0 = time.monotonic()
            short = c.generate([[9, 10]], {"max_tokens": 1})
            dt_short = time.monotonic() - t0
        long_tokens = eng.active_progress()
        assert len(short) == 1 and len(short[0].token_ids) == 1
        assert not long_done and long_tokens and long_tokens[0] < LONG["max_tokens"] // 2, long_tokens
        th.join(600)
        assert long_done and len(long_out) == 1 and len(long_out[0].token_ids) == LONG["max_tokens"]
        assert dt_short < long_done[0] / 2, (dt_short, long_done[0])
    finally:
        b.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "top_p": 0.9}],
                         ids=["greedy", "seeded"])
def test_interleaved_samples_are_identical_to_alone(tiny_llama_dir, sampling):
    """A sample's tokens and logprobs are bit-identical whether it runs alone or interleaved
    (slices of 4 tokens) with other samples, and equal to the one-call HF generation (``hf_generate``)."""
    from foursight.trainer_bridge.hf_sampling import hf_generate
    from foursight.trainer_bridge.protocol import SamplingParams

    eng = HFEngine(tiny_llama_dir)
    eng._load()
    jobs = [([5, 6, 7], 30, 11), ([9, 10], 17, 12), ([3, 4, 5, 6, 7, 8], 25, 13), ([5, 6, 7], 30, 14)]
    sp = SamplingParams(ignore_eos=True, **sampling)
    alone = [eng.generate_sync(p, sp, n, seed) for p, n, seed in jobs]
    for (p, n, seed), a in zip(jobs, alone):
        ref = hf_generate(eng.model, [p], n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=seed)[0]
        assert a.token_ids == ref.token_ids and a.logprobs == ref.logprobs
    futures = [eng._submit(p, sp, n, seed, None).future for p, n, seed in jobs]  # all active at once
    together = [f.result(120) for f in futures]
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.logprobs == a.logprobs
    if sampling["temperature"] > 0:
        assert alone[0].token_ids != alone[3].token_ids  # same prompt, other seed: another sample


def test_hf_engine_reload_is_detected_and_rollouts_refused_until_an_update(tiny_llama_dir, tmp_path):
    """After an update to version 3 the engine reloads its folder (what a restart does: new boot id,
    version 0, original weights). Health is 503 and says what the engine serves; rollouts are 503
    naming the engine instead of samples tagged 3; an update to 4 brings it back."""
    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng], api_key=KEY)).start()
    try:
        state = _perturbed_state(tiny_llama_dir)
        save_file(state, str(tmp_path / "w.safetensors"))
        with RolloutClient(b.url, api_key=KEY) as c:
            c.update_weights(version=3, path=str(tmp_path / "w.safetensors"))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["sync"] == "in_sync" and h["engines"][0]["weight_version"] == 3
            boot = h["engines"][0]["boot_id"]
            eng._load()  # the engine restarts on its checkpoint
            r = httpx.get(b.url + "/v1/health")
            assert r.status_code == 503
            e = r.json()["engines"][0]
            assert e["sync"] == "stale" and e["weight_version"] is None and e["engine_version"] == 0 and e["restarted"] is True
            assert "restarted" in e["reason"] and "version 3" in e["reason"]
            with pytest.raises(BridgeHTTPError) as ei:
                c.generate([[5, 6, 7]], {"max_tokens": 4})
            assert ei.value.status == 503 and eng.name in str(ei.value) and "reports weight version 0" in str(ei.value)
            c.update_weights(version=4, path=str(tmp_path / "w.safetensors"))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["weight_version"] == 4 and h["engines"][0]["boot_id"] != boot
            rs = c.generate([[5, 6, 7]], {"max_tokens": 6, "seed": 1})
        assert {r.weight_version for r in rs} == {4}
        lt, lr, mask = pad_rollouts(rs, score(_bf16_model_with(tiny_llama_dir, state), rs))
        assert float((lt - lr)[mask].abs().max()) < 0.1  # the new weights are served again
    finally:
        b.stop()


def test_requests_share_the_hf_engine_equally_whatever_their_sample_count(tiny_llama_dir):
    """Fairness is per request, then per sample: one request of 6 long samples and one of a single
    sample, submitted at once: the single sample gets every other turn, so it finishes while each
    of the 6 has made well under half its tokens (per-sample round-robin would give it 1 turn in 7,
    finishing with the others). Without a request, samples are their own groups (as before)."""
    from foursight.trainer_bridge.protocol import SamplingParams

    eng = HFEngine(tiny_llama_dir, slice_tokens=2)
    asyncio.run(eng.start())
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with eng._lock:  # hold the scheduler until every sample is queued
        big = [eng._submit([5, 6, 7 + i], sp, 40, 0, None, request="big") for i in range(6)]
        small = eng._submit([9, 10], sp, 40, 0, None, request="small")
    small.future.result(timeout=300)
    progress = [len(s.token_ids) for s in big]
    assert all(p <= 16 for p in progress), progress  # ~ 40/6 + a slice each; 40 for per-sample round-robin
    for s in big:
        assert len(s.future.result(timeout=300).token_ids) == 40
    # the same with no request given: 7 groups of one, so the small one finishes among the others
    with eng._lock:
        big = [eng._submit([5, 6, 7 + i], sp, 40, 0, None) for i in range(6)]
        small = eng._submit([9, 10], sp, 40, 0, None)
    small.future.result(timeout=300)
    assert min(len(s.token_ids) for s in big) >= 36
