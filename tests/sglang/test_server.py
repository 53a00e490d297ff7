"""A FourSight checkpoint served by the real SGLang HTTP server on CPU.

``python -m sglang.launch_server --model-path CKPT --quantization foursight`` (the method comes
from FourSight's ``sglang.srt.plugins`` entry point; nothing is patched), then:

* ``/generate`` answers with per-token logprobs (``return_logprob``, ``logprob_start_len``);
* its teacher-forced prompt logprobs match the PyTorch reference model of the same checkpoint
  (:func:`foursight.hf.load_reference_model`);
* ``/update_weights_from_disk`` with another FourSight checkpoint swaps the policy (the
  idempotent post-load processing runs again) and the logprobs follow the new reference;
* a checkpoint with a missing tensor fails at load with the shared validator's message.

Tolerance (teacher-forced logprobs, engine vs reference). Both run the same FourSight layer
function (the layer's ``foursight.dispatch.PreparedLinear`` → the PyTorch reference on CPU), but everything
between the linears differs: SGLang's torch-native attention, RMSNorm, RoPE and residual adds in
BF16 vs the HF modules. A BF16 rounding difference in a layer input can move an activation across
an FP4 rounding boundary, which later layers amplify. So the tolerance is measured, not guessed:
the *noise floor* is the |Δ| between two equally valid HF implementations of the same checkpoint
(SDPA vs eager attention), and the engine must satisfy mean |Δ| ≤ 2·floor_mean + 0.01 and
max |Δ| ≤ 2·floor_max + 0.05 (``helpers.sglang_engine.within_floor``). On the tiny model the floor is
≈0.12 mean / 0.5 max nats for W4A4 (≈0.012 / 0.06 for W4A16); the figures of a run are printed.
So that the check can fail for a wrong layer, the engine must also be at least 2.5x closer
(mean |Δ|) to the FourSight reference than that reference is to the plain NVFP4 (k=0) reference
of the same model.
"""

from __future__ import annotations


import httpx
import pytest

from helpers.checkpoints import edited_copy, nan_copy
from helpers.sglang_engine import (abs_diffs, floor_check, free_port, generate_logprobs, hf_prompt_logprobs, launch_server, prompt_ids,
                                   reference_model, refused_at_load, server_prompt_logprobs, sglang_prompt_logprobs,
                                   stop_server, wait_ready)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SEPARATION = 2.5


@pytest.fixture(scope="module")
def server(shared_sglang):
    """The session's SGLang server on ``tiny_ckpt`` (conftest.py; shared with test_bridge_stream.py and
    test_atomic_updates.py): its URL."""
    return shared_sglang.running().url


def _report(name: str, d) -> str:
    return f"{name}: mean |Δ| {d.mean():.5f}, max |Δ| {d.max():.5f} over {d.numel()} tokens"


def test_generate_returns_logprobs(server, tiny_ckpt):
    ids = prompt_ids(tiny_ckpt, n=1)[0]
    out = generate_logprobs(server, ids, max_new_tokens=6, start=-1)
    meta = out["meta_info"]
    toks = meta["output_token_logprobs"]
    assert len(toks) == meta["completion_tokens"] > 0
    for lp, tid, _ in toks:
        assert lp <= 0.0 and isinstance(tid, int)
    # greedy decoding: each generated token's logprob is the max of its distribution, so it
    # equals the teacher-forced logprob of that token when the continuation is fed back
    gen = [t[1] for t in toks]
    tf = sglang_prompt_logprobs(generate_logprobs(server, ids + gen)["meta_info"])[len(ids) - 1:]
    d = abs_diffs([[t[0] for t in toks]], [tf])
    assert float(d.max()) < 5e-2, _report("decode vs prefill", d)


def test_logprobs_match_reference_model(server, tiny_ckpt, tiny_nvfp4_ckpt, record_property):
    prompts = prompt_ids(tiny_ckpt, n=4)
    c = floor_check(server_prompt_logprobs(server, prompts), reference_model(tiny_ckpt), prompts)
    d_fp4 = abs_diffs(c.ref, hf_prompt_logprobs(reference_model(tiny_nvfp4_ckpt), prompts))
    msg = f"sglang vs reference: {c.msg}; " + _report("reference vs nvfp4 reference", d_fp4)
    record_property("sglang_vs_reference", msg)
    print(msg)
    assert c.ok, msg
    assert float(c.d.mean()) * SEPARATION <= float(d_fp4.mean()), msg


def test_update_weights_from_disk_follows_new_policy(server, tiny_ckpt, tiny_ckpt_b):
    prompts = prompt_ids(tiny_ckpt, n=4)
    before = server_prompt_logprobs(server, prompts)
    try:
        r = httpx.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_ckpt_b)}, timeout=300)
        assert r.status_code == 200 and r.json()["success"], r.text
        after = server_prompt_logprobs(server, prompts)
        d, ok, msg, _ = floor_check(after, reference_model(tiny_ckpt_b), prompts)
        moved = abs_diffs(after, before)
        print("after update vs reference B:", msg)
        assert ok, msg
        assert float(moved.mean()) >= SEPARATION * float(d.mean()), _report("after vs before", moved)
    finally:  # restore policy A for any later test of this module
        httpx.post(f"{server}/update_weights_from_disk", json={"model_path": str(tiny_ckpt)}, timeout=300)


def test_missing_tensor_fails_at_load_naming_it(tiny_ckpt, tmp_path):
    bad = edited_copy(tiny_ckpt, tmp_path / "bad", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    returncode, text = refused_at_load(bad, tmp_path / "bad.log")
    assert returncode != 0
    assert "CheckpointError: missing tensor model.layers.1.self_attn.k_proj.weight_scale" in text, text[-3000:]


def test_non_finite_update_from_disk_is_refused_and_previous_weights_keep_serving(server, tiny_ckpt, tmp_path):
    """An update whose model.norm.weight holds a NaN fails naming the tensor; SGLang then reloads the
    weights it served, and the logprobs are bit-equal to those before."""
    prompts = prompt_ids(tiny_ckpt, n=2)
    before = server_prompt_logprobs(server, prompts)
    bad = nan_copy(tiny_ckpt, tmp_path / "nan_norm", "model.norm.weight")
    r = httpx.post(f"{server}/update_weights_from_disk", json={"model_path": str(bad)}, timeout=300)
    body = r.json()
    assert not body["success"], r.text
    assert "model.norm.weight" in body["message"] and "non-finite" in body["message"], body["message"]
    assert server_prompt_logprobs(server, prompts) == before


def test_bridge_engine_reads_the_version_sglang_serves(server, tiny_ckpt):
    """The bridge's SGLang engine sends its weight version with an update and reads it back from the
    server (how the bridge tells a restarted server, back at version 0, from one in sync)."""
    import asyncio

    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine

    async def run():
        eng = SGLangHTTPEngine(server)
        await eng.start()
        try:
            before = await eng.served_state()
            ack = await eng.update_weights(str(tiny_ckpt), 7)
            after = await eng.served_state()
        finally:
            await eng.aclose()
        return before, ack, after

    before, ack, after = asyncio.run(run())
    assert before is not None and isinstance(before["version"], int)
    assert ack["version"] == 7 and after == {"boot_id": "sglang", "version": 7}


def test_bridge_detects_a_restarted_sglang_server_and_refuses_its_rollouts(tiny_ckpt, tiny_ckpt_b, tmp_path):
    """Liveness against a real SGLang restart (issue 14): the bridge pushes version 7, the SGLang server
    dies and comes back on its original checkpoint at the same URL. SGLang has no boot id; the bridge
    sees the served version fall back to 0, reports the engine stale (health 503), refuses rollouts
    rather than tagging them version 7, and is in sync again after the trainer pushes once more."""
    from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient
    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    probe = prompt_ids(tiny_ckpt, n=2)
    procs = [launch_server(tiny_ckpt, port, tmp_path / "sglang1.log")]
    bridge = None
    try:
        wait_ready(procs[0], url, tmp_path / "sglang1.log")
        bridge = BridgeThread(create_app([SGLangHTTPEngine(url)])).start()
        prompts, sp = [[5, 6, 7, 8], [11, 12, 13]], {"max_tokens": 6, "temperature": 1.0, "seed": 3}
        with RolloutClient(bridge.url) as c:
            c.update_weights(version=7, path=str(tiny_ckpt_b))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["engine_version"] == 7, h

            stop_server(procs[0])  # the server dies and comes back on its checkpoint, same URL
            procs.append(launch_server(tiny_ckpt, port, tmp_path / "sglang2.log"))
            wait_ready(procs[1], url, tmp_path / "sglang2.log")

            r = httpx.get(bridge.url + "/v1/health", timeout=60)
            assert r.status_code == 503 and r.json()["status"] == "degraded", r.text
            e = r.json()["engines"][0]
            assert e["up"] is True and e["sync"] == "stale" and e["engine_version"] == 0, e
            with pytest.raises(BridgeHTTPError) as ei:
                c.generate(prompts, sp, n=2)
            assert ei.value.status == 503 and "reports weight version 0" in str(ei.value)
            stale = server_prompt_logprobs(url, probe)

            c.update_weights(version=8, path=str(tiny_ckpt_b))
            h = c.health()
            assert h["status"] == "ok" and h["engines"][0]["engine_version"] == 8, h
            rs = c.generate(prompts, sp, n=2)
            synced = server_prompt_logprobs(url, probe)
        assert len(rs) == 4 and {r.weight_version for r in rs} == {8}
        # what the health said is what the server served: the restarted server was back on A (the
        # checkpoint it started with), and after the re-push it serves B
        ref_a = hf_prompt_logprobs(reference_model(tiny_ckpt), probe)
        ref_b = hf_prompt_logprobs(reference_model(tiny_ckpt_b), probe)
        for served, near, far in ((stale, ref_a, ref_b), (synced, ref_b, ref_a)):
            d_near, d_far = abs_diffs(served, near), abs_diffs(served, far)
            assert float(d_far.mean()) >= SEPARATION * float(d_near.mean()), (_report("near", d_near), _report("far", d_far))
    finally:
        if bridge is not None:
            bridge.stop()
        for p in procs:
            stop_server(p)


def test_bridge_refuses_a_prompt_beyond_the_sglang_context_naming_the_field(server, tiny_ckpt):
    """issue 28: the SGLang server's context (its GET /v1/models max_model_len, 1024 for the tiny
    model): a prompt plus max_tokens beyond it gets 422 from the bridge naming the field."""
    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app

    b = BridgeThread(create_app([SGLangHTTPEngine(server, tokenizer=tiny_ckpt)])).start()
    try:
        r = httpx.post(b.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5] * 1000}], "sampling": {"max_tokens": 100}}, timeout=120)
        assert r.status_code == 422, r.text[:500]
        assert [f["field"] for f in r.json()["fields"]] == ["sampling.max_tokens"] and "context of 1024 tokens" in r.json()["error"]
        ok = httpx.post(b.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5] * 1000}], "sampling": {"max_tokens": 24}}, timeout=300)
        assert ok.status_code == 200 and ok.text.count('"type":"sample"') == 1, ok.text[-500:]
    finally:
        b.stop()


@pytest.mark.after_the_rest
def test_the_shared_server_outlives_the_in_process_engines(shared_sglang):
    """Every file sharing the session's server ran before this test, and the in-process ``sglang.Engine``
    of the files between them was shut down: ``Engine.shutdown`` kills every child process of pytest, so
    before helpers.sglang_engine kept it to the engine's own, each shutdown killed the shared server and
    the next file started it again (three starts in a full run; on CI of 49526c8 one was still dying
    when the bridge connected: six errors)."""
    srv = shared_sglang.running()
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    assert shared_sglang.starts == 1, f"the shared SGLang server was started {shared_sglang.starts} times in this session"
