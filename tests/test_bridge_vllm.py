"""The rollout bridge in front of a real vLLM BF16 server (CPU, tiny Llama), started and torn down here.

One vLLM server (the session's BF16 one, shared with test_bridge_openai_vllm.py: tests/conftest.py's
``tiny_llama_vllm_bf16``) and one bridge serve the whole module; the engine-kill test runs last (a later
user of the shared server gets a fresh one).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from foursight.trainer_bridge.client import (  # noqa: E402
    AsyncRolloutClient,
    BridgeHTTPError,
    RolloutClient,
)
from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine  # noqa: E402
from foursight.trainer_bridge.filters import FilterConfig, apply_filter  # noqa: E402
from foursight.trainer_bridge.launch import BridgeThread  # noqa: E402
from foursight.trainer_bridge.metrics import compute_tim_metrics  # noqa: E402
from foursight.trainer_bridge.protocol import SamplingParams  # noqa: E402
from foursight.trainer_bridge.scoring import pad_rollouts, score  # noqa: E402

pytestmark = [pytest.mark.vllm]

KEY = "test-key-123"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Paris is the capital of",
    "1 + 1 = 2, 2 + 2 =",
    "Once upon a time",
    "import torch\nx = torch.zeros(3)",
]


@pytest.fixture(scope="module")
def vllm_server(tiny_llama_vllm_bf16):
    """The session's BF16 vLLM server on the tiny Llama (tests/conftest.py; test_bridge_openai_vllm.py shares it)."""
    return tiny_llama_vllm_bf16.running()


@pytest.fixture(scope="module")
def bridge(vllm_server, tiny_llama_dir):
    engine = VLLMHTTPEngine(vllm_server.url, tokenizer=tiny_llama_dir)
    b = BridgeThread(_app([engine])).start()
    yield b
    b.stop()


def _app(engines, **kw):
    from foursight.trainer_bridge.server import create_app

    return create_app(engines, api_key=KEY, **kw)


@pytest.fixture(scope="module")
def client(bridge):
    with RolloutClient(bridge.url, api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def hf_bf16(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def rollouts(client):
    """16 samples, temperature 1 with top-p 0.9 (the engine reports raw logprobs)."""
    return client.generate(TEXTS[:4], {"temperature": 1.0, "top_p": 0.9, "max_tokens": 40, "seed": 11}, n=4)


def test_rollouts_stream_per_sample(client, tiny_llama_dir):
    """A 2-token sample arrives while the 800-token samples of the same request are still running."""
    from transformers import AutoTokenizer

    prompts = [{"text": TEXTS[0], "max_tokens": 2}, {"text": TEXTS[1], "max_tokens": 800}]
    t0 = time.monotonic()
    arrivals = []
    for r in client.stream(prompts, {"temperature": 1.0, "ignore_eos": True, "seed": 3}, n=2):
        arrivals.append((time.monotonic() - t0, r))
    got = [(r.prompt_index, len(r.token_ids)) for _, r in arrivals]
    # every sample once, a 2-token one first; the exact order of the rest is vLLM's scheduling, not the
    # bridge's: under the fresh-clone CI's load (2026-12-06) vLLM answered the second 2-token request only
    # after an 800-token one (0,2), (1,800), (0,2), (1,800). The lag check below measures the bridge
    assert sorted(got) == [(0, 2), (0, 2), (1, 800), (1, 800)] and got[0] == (0, 2), got
    long_first = min(t for t, r in arrivals if r.prompt_index == 1)
    # streamed, not batched at the end: a 2-token sample reaches the client as soon as the engine has
    # answered it (queued_s + engine_s, the bridge's clock), not when the 800-token ones end. The
    # delay is measured from the engine's answer: on a loaded 2-core box vLLM itself once answered
    # the 2-token requests only with the long ones (engine_s 2.31 s of 2.32 s; CI, 2026-12-05), which
    # says nothing about the bridge. A ratio, not a fixed margin: the speed depends on machine load.
    lag = max(t - (r.timing.queued_s + r.timing.engine_s) for t, r in arrivals if r.prompt_index == 0)
    assert lag < 0.5 * long_first, arrivals
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for _, r in arrivals:
        assert r.prompt_ids == tok.encode(prompts[r.prompt_index]["text"])
        assert len(r.logprobs) == len(r.token_ids)
        assert r.weight_version == 0 and r.engine.startswith("vllm@") and r.logprobs_mode == "raw_logprobs"
        assert r.finish_reason == "length" and r.timing.engine_s > 0


def test_logprobs_match_engine_completions(rollouts, vllm_server, bridge):
    """Each streamed sample equals vLLM's own /v1/completions answer (same body, same seed: the same
    tokens), and its logprobs are vLLM's own: within BF16 noise of both of vLLM's computations of
    them (the direct completion, and the teacher-forced prompt_logprobs of the same tokens), and on a
    quiet machine bit-equal to one of them. Which one is bit-equal depends on the machine: vLLM's CPU engine is not
    batch-invariant (the bridge's samples ran batched, the checks run one request at a time), and on
    the machine of this session the bridge matched the teacher-forced pass exactly (0.0) and the
    direct completion to 2.0e-2, where earlier machines showed the reverse."""
    model = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]["id"]
    eng = VLLMHTTPEngine(vllm_server.url, model=model)  # only used to build the same request body
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=11)
    worst_direct = worst_tf = 0.0
    with httpx.Client(base_url=vllm_server.url, timeout=60) as h:
        for r in rollouts:
            seed = 11 + r.prompt_index * 4 + r.sample_index
            d = h.post("/v1/completions", json=eng.completion_body(r.prompt_ids, sp, 40, seed)).json()
            direct = VLLMHTTPEngine.parse_completion(d)
            assert direct.token_ids == r.token_ids
            worst_direct = max(worst_direct, max(abs(a - b) for a, b in zip(direct.logprobs, r.logprobs)))
            d2 = h.post("/v1/completions", json={"model": eng.model, "prompt": r.prompt_ids + r.token_ids, "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
            pl = d2["choices"][0]["prompt_logprobs"][len(r.prompt_ids):]
            tf = [pl[t][str(tok)]["logprob"] for t, tok in enumerate(r.token_ids)]
            worst_tf = max(worst_tf, max(abs(a - b) for a, b in zip(tf, r.logprobs)))
    print(f"\nmax |bridge - direct completions| = {worst_direct:.2e}, max |bridge - teacher-forced prompt_logprobs| = {worst_tf:.2e}")
    # bit-equal to one of the two when the machine is quiet (0.0 here, run alone); under the fresh-clone CI's load of
    # 2026-12-06 neither was (8.1e-3): vLLM batched the bridge's 16 streamed samples differently from the checks' one
    # request at a time. The bridge passes vLLM's numbers through: a shifted or recomputed logprob would be off by
    # far more than BF16 noise, and the tokens above are equal exactly
    assert max(worst_direct, worst_tf) <= 3e-2


def test_score_bf16_hf_vs_bf16_engine(rollouts, hf_bf16):
    """score() with the BF16 HF model reproduces the engine's raw logprobs up to BF16 kernel noise."""
    lt, lr, m = pad_rollouts(rollouts, score(hf_bf16, rollouts, batch_size=5))
    met = compute_tim_metrics(lt, lr, m)
    print(f"\nBF16 HF vs BF16 vLLM (tiny llama, {int(m.sum())} tokens): mean|r|={met['tim/abs_log_ratio_mean']:.4f} "
          f"max|r|={met['tim/abs_log_ratio_max']:.4f} kl={met['rollout_corr/kl']:.2e} k3={met['rollout_corr/k3_kl']:.2e}")
    assert met["tim/abs_log_ratio_mean"] < 0.03
    assert met["tim/abs_log_ratio_max"] < 0.3
    assert abs(met["rollout_corr/kl"]) < 5e-3
    # the convention matters: temperature-scaling the learner (processed) on top-p samples is refused
    from foursight.trainer_bridge.scoring import ScoringError

    with pytest.raises(ScoringError, match="rollouts\\[0\\]"):
        score(hf_bf16, rollouts[:1], logprobs_mode="processed_logprobs")


def test_filter_removes_planted_drift(rollouts, hf_bf16):
    """Real rollouts + real learner scores; three sequences get a planted engine-side drift."""
    lt, lr, m = pad_rollouts(rollouts, score(hf_bf16, rollouts))
    planted = [2, 7, 13]
    for b in planted:
        lr[b, 5:10] += 1.5  # the engine over-rates five tokens (ratio e^-1.5)
    policies = [
        FilterConfig(policy="max_token"),
        FilterConfig(policy="tail_count", max_tail_tokens=2),
        FilterConfig(policy="geo_mean", geo_lo=0.95, geo_hi=1.05),
        FilterConfig(policy="quantile", quantile=3 / len(rollouts) + 1e-9, tis_cap=2.0),
    ]
    for cfg in policies:
        res = apply_filter(lt, lr, m, cfg)
        assert sorted((~res.keep).nonzero().flatten().tolist()) == planted, cfg.policy
        assert float(res.loss_mask[planted].sum()) == 0.0
        assert res.metrics["tim/tail_tokens"] == 15
    # the verl geometric preset (0.999-1.001) drops the planted ones too
    res = apply_filter(lt, lr, m, FilterConfig(policy="geo_mean"))
    assert set(planted) <= set((~res.keep).nonzero().flatten().tolist())


def test_sse_stream(bridge):
    body = {"prompts": [{"token_ids": [5, 6, 7]}], "n": 2, "sampling": {"max_tokens": 4, "seed": 1}, "stream_format": "sse"}
    with httpx.Client(timeout=60) as h:
        r = h.post(bridge.url + "/v1/rollouts", json=body, headers={"X-API-Key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [f["type"] for f in frames] == ["sample", "sample", "end"]
    assert frames[-1]["status"] == "ok" and frames[-1]["num_samples"] == 2


N_STREAMS = 100


def test_hundred_concurrent_streams(bridge):
    """The load test of issue 14: 100 streams at once (more than the bridge's 64 engine slots, so some
    wait), every one completes, the sample counter counts each once and the queue drains to 0."""
    async def run():
        async with AsyncRolloutClient(bridge.url, api_key=KEY) as c:
            async def one(i):
                return await c.generate([{"token_ids": [5 + i % 50, 9, 11]}], {"max_tokens": 8, "seed": i, "ignore_eos": True}, n=1)

            return await asyncio.gather(*(one(i) for i in range(N_STREAMS)))

    before = httpx.get(bridge.url + "/metrics").text
    t0 = time.monotonic()
    results = asyncio.run(run())
    dt = time.monotonic() - t0
    assert len(results) == N_STREAMS and all(len(r) == 1 and len(r[0].token_ids) == 8 for r in results)
    after = httpx.get(bridge.url + "/metrics").text

    def ok_count(text):
        for line in text.splitlines():
            if line.startswith('foursight_bridge_samples_total{status="ok"}'):
                return float(line.split()[-1])
        return 0.0

    assert ok_count(after) - ok_count(before) == N_STREAMS
    assert "foursight_bridge_tokens_per_second" in after and "foursight_bridge_queue_depth 0.0" in after
    print(f"\n{N_STREAMS} concurrent streams x 8 tokens in {dt:.2f} s")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"n": 1}, "prompts"),
        ({"prompts": [{"text": "hi"}], "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"prompts": [{"text": "hi"}], "n": 0}, "n"),
        ({"prompts": [{"text": "hi", "token_ids": [1, 2]}]}, "prompts[0]"),
        ({"prompts": [{"text": "hi"}], "sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"prompts": [{"text": "hi"}], "sampling": {"temprature": 1.0}}, "sampling.temprature"),
        ({"prompts": [{"token_ids": [1, -3]}]}, "prompts[0].token_ids[1]"),
        ({"prompts": []}, "prompts"),
    ],
)
def test_bad_rollout_requests_name_the_field(bridge, body, field):
    r = httpx.post(bridge.url + "/v1/rollouts", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 422, r.text
    assert field in [f["field"] for f in r.json()["fields"]], r.json()
    assert field in r.json()["error"]


def test_api_key_required(bridge):
    body = {"prompts": [{"token_ids": [5, 6]}], "sampling": {"max_tokens": 2}}
    assert httpx.post(bridge.url + "/v1/rollouts", json=body).status_code == 401
    assert httpx.post(bridge.url + "/v1/rollouts", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(bridge.url + "/v1/weights", json={"path": "/x", "version": 1}).status_code == 401
    with RolloutClient(bridge.url) as c, pytest.raises(BridgeHTTPError, match="401"):
        list(c.stream([[5, 6]], {"max_tokens": 2}))
    assert httpx.get(bridge.url + "/v1/health").status_code == 200  # health stays open (loopback)


def test_weight_update_on_plain_bf16_vllm_fails_explicitly(bridge, client, tmp_path):
    """A BF16 vLLM without the FourSight worker extension cannot take the update: 502 naming the
    engine, and the version stays 0 (streams keep their tag)."""
    from safetensors.torch import save_file

    p = tmp_path / "w.safetensors"
    save_file({"model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}, str(p))
    with pytest.raises(BridgeHTTPError) as ei:
        client.update_weights(version=1, path=str(p))
    assert ei.value.status == 502 and "vllm@" in str(ei.value) and "foursight_update_weights" in str(ei.value)
    assert client.weight_version() == 0
    with pytest.raises(BridgeHTTPError) as ei:
        client.update_weights(version=0, path=str(p))
    assert ei.value.status == 409 and "version" in str(ei.value)


def test_openai_routes_forward_vllm_sampling_fields(bridge, vllm_server, tiny_llama_dir):
    """An OpenAI client at the bridge's /v1/completions with vLLM's sampling fields gets what vLLM's
    own /v1/completions returns for the same request (greedy, repetition penalty, min_p, stop): the
    same tokens and logprobs, and the bridge's rollout record with the weight version."""
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode(TEXTS[0])
    c = openai.OpenAI(base_url=bridge.url + "/v1", api_key=KEY, max_retries=0)
    model = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]["id"]
    served = c.models.list().data[0].id  # the name the bridge serves (a wrong one is 404, as on vLLM)
    for extra in ({"repetition_penalty": 1.4}, {"min_p": 0.2, "repetition_penalty": 1.1}):
        r = c.completions.create(model=served, prompt=ids, max_tokens=12, temperature=0.0, logprobs=0, extra_body=extra)
        (x,) = [ch.model_extra["rollout"] for ch in r.choices]
        want = httpx.post(vllm_server.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 12, "temperature": 0.0,
                                                                     "logprobs": 0, "return_tokens_as_token_ids": True, **extra},
                          timeout=120).json()["choices"][0]
        assert x["token_ids"] == [int(t.split(":", 1)[1]) for t in want["logprobs"]["tokens"]], extra
        assert r.choices[0].logprobs.token_logprobs == x["logprobs"] == want["logprobs"]["token_logprobs"]
        assert x["weight_version"] == r.model_extra["weight_version"] and x["engine"].startswith("vllm@")
    # vLLM's token-id extensions (what TRL's VLLMClient sends) are answered in vLLM's own shape
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0.0, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    got = httpx.post(bridge.url + "/v1/completions", json={"model": served, **body}, headers={"X-API-Key": KEY}, timeout=120).json()["choices"][0]
    want = httpx.post(vllm_server.url + "/v1/completions", json={"model": model, **body}, timeout=120).json()["choices"][0]
    for key in ("prompt_token_ids", "token_ids"):
        assert got[key] == want[key], key
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    assert got["logprobs"]["top_logprobs"] == want["logprobs"]["top_logprobs"]
    plain = x["token_ids"]
    stop = tok.decode(plain[:5])[-3:]
    r = c.completions.create(model=served, prompt=ids, max_tokens=12, temperature=0.0, stop=[stop], extra_body={"min_p": 0.2, "repetition_penalty": 1.1})
    want = httpx.post(vllm_server.url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 12, "temperature": 0.0,
                                                                 "min_p": 0.2, "repetition_penalty": 1.1, "stop": [stop]}, timeout=120).json()
    assert r.choices[0].finish_reason == want["choices"][0]["finish_reason"] == "stop"
    assert r.choices[0].text == want["choices"][0]["text"]


def test_prompt_beyond_the_vllm_context_is_422_naming_the_field(bridge):
    """issue 28: the vLLM server's max_model_len (1024, read from its GET /v1/models): a prompt plus
    max_tokens beyond it is refused by the bridge, 422 naming the field (before: the engine's own
    400 came back as an error event); at the edge (1000 + 24) the request runs."""
    with httpx.Client(timeout=120) as h:
        r = h.post(bridge.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5] * 1000}], "sampling": {"max_tokens": 100}},
                   headers={"X-API-Key": KEY})
        assert r.status_code == 422, r.text[:500]
        assert [f["field"] for f in r.json()["fields"]] == ["sampling.max_tokens"] and "context of 1024 tokens" in r.json()["error"]
        ok = h.post(bridge.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5] * 1000}], "sampling": {"max_tokens": 24}},
                    headers={"X-API-Key": KEY})
        assert ok.status_code == 200 and ok.text.count('"type":"sample"') == 1, ok.text[-500:]



def test_zz_engine_killed_mid_stream(bridge, client, vllm_server):
    """Kill vLLM while samples are running: every unfinished sample gets an error event, the end
    event says "error", the counts add up, and the client raises. Runs last (kills the server)."""
    prompts = [{"token_ids": [5, 6, 7], "max_tokens": 2}, {"token_ids": [8, 9, 10], "max_tokens": 900}]
    events = []
    t_kill = None
    with httpx.Client(timeout=120) as h:
        body = {"prompts": prompts, "n": 3, "sampling": {"ignore_eos": True, "seed": 5}}
        with h.stream("POST", bridge.url + "/v1/rollouts", json=body, headers={"X-API-Key": KEY}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                ev = json.loads(line)
                events.append(ev)
                if t_kill is None and ev["type"] == "sample":
                    # at the first finished sample. Which of the others are done by then is up to
                    # the CPU engine's scheduling (a 900-token sample has been seen to finish before
                    # the third 2-token one), so the checks below hold for any split
                    vllm_server.kill()
                    t_kill = time.monotonic()
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "end" and kinds.count("end") == 1
    end = events[-1]
    samples = [e for e in events if e["type"] == "sample"]
    errors = [e for e in events if e["type"] == "error"]
    assert end["status"] == "error"
    assert end["num_samples"] == len(samples) and end["num_errors"] == len(errors)
    # nothing silently lost: every (prompt, sample) is reported once, as a sample or as an error
    done = [(e["prompt_index"], e["sample_index"]) for e in samples]
    failed = [(e["prompt_index"], e["sample_index"]) for e in errors]
    assert sorted(done + failed) == [(p, i) for p in range(2) for i in range(3)]
    assert failed, "the kill came after every sample had finished: nothing was tested"
    # a reported sample is whole, never cut by the kill
    assert all(len(e["token_ids"]) == (2, 900)[e["prompt_index"]] for e in samples)
    assert all(e["error"] and e["engine"].startswith("vllm@") for e in errors)
    # a new request fails at once, before any sample, naming the dead engine (issue 53: before, it waited out
    # the engine client's connect retries and ended in an error event); health reports the dead engine
    t0 = time.monotonic()
    with pytest.raises(BridgeHTTPError) as ei:
        client.generate([[5, 6, 7]], {"max_tokens": 2})
    assert ei.value.status == 503 and "does not answer its health route" in str(ei.value), ei.value
    assert time.monotonic() - t0 < 5.0
    h = httpx.get(bridge.url + "/v1/health")
    assert h.status_code == 503 and h.json()["status"] == "degraded"
