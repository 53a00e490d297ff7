"""The bridge's OpenAI-compatible routes (/v1/completions, /v1/chat/completions) with the
in-process HF engine, driven by the ``openai`` package: completions with per-token logprobs, the
weight version and the bridge's rollout record, vLLM's sampling fields, and 4xx naming fields.

References: the same BF16 model teacher-forced (``scoring.score``) and transformers' own
``generate`` for greedy decoding with a repetition penalty."""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest
import torch
from safetensors.torch import save_file

from foursight.trainer_bridge.backends.hf import HFEngine
from foursight.trainer_bridge.launch import BridgeThread
from foursight.trainer_bridge.protocol import Rollout
from foursight.trainer_bridge.scoring import pad_rollouts, score
from foursight.trainer_bridge.server import create_app
from helpers.weights import perturbed_state

openai = pytest.importorskip("openai")
KEY = "sekrit"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def bridge(tiny_llama_dir):
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=KEY, sample_timeout_s=120)).start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def served(tiny_llama_dir) -> str:
    """The name the bridge serves the HF engine under: its model folder, as vLLM names a served model."""
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def client(bridge):
    return openai.OpenAI(base_url=bridge.url + "/v1", api_key=KEY, max_retries=0)


def _rollouts(choices) -> list[Rollout]:
    return [Rollout.model_validate(c.model_extra["rollout"] if hasattr(c, "model_extra") and c.model_extra else c["rollout"]) for c in choices]


def _greedy(model, ids: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None,
                             eos_token_id=None, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def test_openai_client_gets_completions_with_logprobs(served, client, model, tok):
    r = client.completions.create(model=served, prompt=[PROMPT, "Hello"], max_tokens=10, temperature=1.0, n=2, logprobs=0, seed=3)
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.model_extra["weight_version"] == 0
    rs = _rollouts(r.choices)
    assert [(x.prompt_index, x.sample_index) for x in rs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert rs[0].prompt_ids == tok.encode(PROMPT) and rs[2].prompt_ids == tok.encode("Hello")
    for c, x in zip(r.choices, rs):
        assert c.logprobs.token_logprobs == x.logprobs and len(x.logprobs) == len(x.token_ids) == 10
        # a character left incomplete at the end is left out, as vLLM's detokenizer leaves it
        assert c.text == tok.decode(x.token_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert x.weight_version == 0 and x.engine.startswith("hf@") and x.logprobs_mode == "raw_logprobs"
    assert r.usage.completion_tokens == 40
    # the logprobs are the model's: the same BF16 model teacher-forced on the sampled tokens
    lt, lr, mask = pad_rollouts(rs, score(model, rs))
    assert float((lt - lr)[mask].abs().max()) < 0.1


def test_chat_completion_templates_and_returns_logprobs(served, client, model, tok):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=served, messages=msgs, max_tokens=8, temperature=0.0, logprobs=True)
    (c,) = r.choices
    (x,) = _rollouts(r.choices)
    want = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert x.prompt_ids == list(want)
    assert x.token_ids == _greedy(model, x.prompt_ids, len(x.token_ids))
    assert [e.logprob for e in c.logprobs.content] == x.logprobs and c.message.role == "assistant"
    assert c.message.content == tok.decode(x.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_vllm_sampling_fields(served, client, model, tok):
    ids = tok.encode(PROMPT)
    # repetition_penalty: greedy equals transformers' greedy with the same penalty (and differs from plain greedy)
    r = client.completions.create(model=served, prompt=PROMPT, max_tokens=16, temperature=0.0, extra_body={"repetition_penalty": 1.5})
    (x,) = _rollouts(r.choices)
    assert x.token_ids == _greedy(model, ids, 16, repetition_penalty=1.5)
    plain = _greedy(model, ids, 16)
    assert x.token_ids != plain
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy
    r = client.completions.create(model=served, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, extra_body={"min_p": 1.0})
    assert _rollouts(r.choices)[0].token_ids == plain
    # stop: the completion ends with the token that completes the stop string; the text stops before it
    stop = tok.decode(plain[:4])[-3:]
    assert stop.strip()
    r = client.completions.create(model=served, prompt=PROMPT, max_tokens=16, temperature=0.0, stop=[stop])
    (c,) = r.choices
    (x,) = _rollouts(r.choices)
    first = next(i for i in range(16) if stop in tok.decode(plain[: i + 1]))
    assert x.token_ids == plain[: first + 1] and c.finish_reason == "stop"
    assert stop not in c.text and tok.decode(plain[: first + 1]).startswith(c.text)


def test_streaming_as_the_openai_client_reads_it(served, client, model, tok):
    """``stream=True`` through the official client: the HF engine streams each sample in pieces (a
    chunk per scheduler turn, before the sample ends; before: one chunk per finished sample), and
    the chunks joined per choice give the same texts, logprobs and finish reasons as the
    non-streaming answer for the same seed; the usage chunk with ``stream_options``; the chat
    route's deltas after its role chunk."""
    kw = dict(model=served, prompt=[PROMPT, "Hello"], max_tokens=24, temperature=1.0, n=2, logprobs=0, seed=11,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    joined: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            d = joined.setdefault(c.index, {"n": 0, "text": "", "lps": [], "finish": None})
            d["n"] += 1
            d["text"] += c.text
            d["lps"] += c.logprobs.token_logprobs if c.logprobs else []
            d["finish"] = c.finish_reason or d["finish"]
    assert sorted(joined) == [0, 1, 2, 3]
    # pieces before the sample ends, not one chunk per finished sample: up to one a scheduler turn (slice_tokens=4), fewer
    # when the event loop wakes after several turns (CI under load got fewer than 24 / 4), so the bound is two
    assert all(d["n"] >= 2 for d in joined.values()), {i: d["n"] for i, d in joined.items()}
    for ref in full.choices:
        got = joined[ref.index]
        assert got["text"] == ref.text and got["lps"] == ref.logprobs.token_logprobs and got["finish"] == ref.finish_reason
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    # chat: the role first, then the assistant's content as deltas, with its logprobs
    msgs = [{"role": "user", "content": "Say hi"}]
    ref = client.chat.completions.create(model=served, messages=msgs, max_tokens=6, temperature=0.0, logprobs=True)
    parts = list(client.chat.completions.create(model=served, messages=msgs, max_tokens=6, temperature=0.0, logprobs=True, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == ref.choices[0].message.content
    lps = [e.logprob for p in parts if p.choices and p.choices[0].logprobs for e in p.choices[0].logprobs.content]
    assert lps == [e.logprob for e in ref.choices[0].logprobs.content]


def test_top_logprobs_and_echo_are_the_models(served, client, model, tok):
    """``logprobs`` k, chat ``top_logprobs`` k and ``echo`` with the HF engine: each position's
    alternatives are the k most likely tokens of the model's own distribution there (the same BF16
    model run over prompt + completion, within BF16 noise), the sampled token first; the echoed
    prompt's logprobs are the model's teacher-forced ones (before: all three refused)."""
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=served, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=3, echo=True)
    (c,) = r.choices
    (x,) = _rollouts(r.choices)
    assert c.text == PROMPT + c.text[len(PROMPT):] and c.logprobs.token_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(ids) + 6 and c.logprobs.top_logprobs[0] is None
    full = ids + x.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
    # the rollout record keeps the alternatives by token id (the answer's dicts are keyed by token text,
    # where two tokens may decode alike): the token itself, then the 3 most likely
    alts = x.prompt_logprobs[1:] + x.top_logprobs
    assert x.prompt_logprobs[0] is None and len(alts) == len(full) - 1
    for t in range(1, len(full)):
        want = ref[t - 1]
        assert alts[t - 1][0][0] == full[t] and abs(c.logprobs.token_logprobs[t] - float(want[full[t]])) < 0.05, t
        best = sorted((lp for _, lp in alts[t - 1]), reverse=True)[:3]  # the token itself is among them when it is in the top 3
        assert len(alts[t - 1]) in (3, 4) and best == pytest.approx([float(v) for v in torch.topk(want, 3).values], abs=0.05), (t, alts[t - 1])
        assert len(c.logprobs.top_logprobs[t]) <= 4
    chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    for e in chat.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely


def test_weight_version_follows_updates(served, bridge, client, tiny_llama_dir, tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(perturbed_state(tiny_llama_dir), str(path))
    r = httpx.post(bridge.url + "/v1/weights", json={"path": str(path), "version": 4}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120)
    assert r.status_code == 200, r.text
    r = client.completions.create(model=served, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert r.model_extra["weight_version"] == 4 and _rollouts(r.choices)[0].weight_version == 4


def test_bad_requests_name_the_field(served, bridge, client):
    h = {"Authorization": f"Bearer {KEY}"}
    url = bridge.url + "/v1/completions"
    cases = [({"prompt": "x", "max_tokens": 4, "frobnicate": 1}, "frobnicate"),
             ({"prompt": "x", "logprobs": 21}, "logprobs"),
             ({"prompt": "x", "stream": "yes please"}, "stream"),
             ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
             ({"prompt": "x", "temperature": -1}, "temperature"),
             ({"prompt": [], "max_tokens": 2}, "prompt")]
    for body, field in cases:
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert any(f["field"].startswith(field) or field in f["message"] for f in r.json()["error"]["fields"]), r.text
    r = httpx.post(bridge.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
                   headers=h, timeout=30)
    assert r.status_code == 400 and "top_logprobs" in r.text
    # issue 53: vLLM's sampling fields that the HF engine cannot honour are refused naming the field and the engine
    # (vLLM and SGLang take them: tests/test_bridge_openai_vllm.py)
    for body, field in (({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": -1.0}, "frequency_penalty"),
                        ({"logit_bias": {"5": 3.0}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "response_format")):
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, **body}, headers=h, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and "engine hf" in err["message"] and "cannot honour" in err["message"], r.text
    # no constraint and no bias are nothing to honour
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}, "presence_penalty": 0.0,
                              "logit_bias": {}}, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.post(url, json={"prompt": "x"}, timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=bridge.url + "/v1", api_key="wrong", max_retries=0).completions.create(model=served, prompt="x")


def test_openai_routes_run_the_served_model_checks_of_rollouts(tiny_llama_dir, tok):
    """The OpenAI routes go through the bridge's one admission path: the server's token caps, the
    vocabulary and int64 bounds give a 400 (vLLM's status for a bad field) naming the field as
    OpenAI spells it (before: these reached the engine, a per-sample error or a 200 beyond the server's cap)."""
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], max_tokens_cap=8, max_request_tokens=20)).start()
    try:
        url = b.url + "/v1/completions"
        big = len(tok)
        cases = [({"prompt": [5, big + 3], "max_tokens": 2}, "prompt[0].token_ids[1]"),
                 ({"prompt": "x", "max_tokens": 9}, "max_tokens"),
                 ({"prompt": "x", "max_tokens": 8, "n": 3}, "n"),
                 ({"prompt": "x", "max_tokens": 2, "n": 2, "seed": 2**63 - 1}, "seed"),
                 ({"prompt": "x", "max_tokens": 2, "stop_token_ids": [big]}, "stop_token_ids[0]")]
        for body, field in cases:
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 400, (body, r.text)
            assert field in [f["field"] for f in r.json()["error"]["fields"]], (body, r.text)
        r = httpx.post(b.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["fields"][0]["field"] == "max_tokens", r.text
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 8, "n": 2}, timeout=120)  # 16 <= 20: served
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    finally:
        b.stop()


def test_trl_vllm_client_generates_through_the_bridge(tiny_llama_dir, model, tok):
    """TRL's own ``VLLMClient`` (trl installed here), pointed at the bridge as at a ``vllm serve``:
    it polls ``/health``, reads the model id from ``/v1/models`` and generates through
    ``/v1/completions`` with vLLM's token-id extensions. What it returns (TRL's ``prompt_ids`` /
    ``completion_ids`` / per-token ``logprobs``) is the model's: the same BF16 model teacher-forced
    on the returned tokens. Weight sync stays the bridge's (``POST /v1/weights``): an HF engine cannot join
    TRL's NCCL group (docs/bridge.md; vLLM engines can: tests/test_bridge_broadcast.py)."""
    trl_client = pytest.importorskip("trl.generation.vllm_client")
    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], sample_timeout_s=120)).start()  # VLLMClient sends no API key
    try:
        c = trl_client.VLLMClient(base_url=b.url, connection_timeout=30)
        assert c.model == str(tiny_llama_dir)  # the served model's name, from /v1/models
        prompts = [tok.encode(PROMPT), tok.encode("Hello")]
        out = c.generate(prompts, n=2, max_tokens=8, temperature=1.0, generation_kwargs={"seed": 5, "ignore_eos": True})
    finally:
        b.stop()
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4 and all(len(x) == 8 for x in out["completion_ids"])
    # one logprob per token (logprobs=0: the sampled token alone), and its id is the sampled token
    assert [[ids[0] for ids in seq] for seq in out["logprob_token_ids"]] == out["completion_ids"]
    rs = [Rollout(request_id="trl", prompt_index=i // 2, sample_index=i % 2, prompt_ids=out["prompt_ids"][i // 2], token_ids=ids,
                  logprobs=[lp[0] for lp in lps], finish_reason="length", engine="hf", logprobs_mode="raw_logprobs", weight_version=0)
          for i, (ids, lps) in enumerate(zip(out["completion_ids"], out["logprobs"]))]
    lt, lr, mask = pad_rollouts(rs, score(model, rs))
    assert float((lt - lr)[mask].abs().max()) < 0.1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_samples(tiny_llama_dir, served, stream):
    """issue 38: ``/v1/completions`` with n = 4 long samples whose client leaves after 1 s: the HF
    engine's active samples fall to 0 and the bridge holds no stream within 2 s, so a weight update
    is not held up (before, non-streamed: the samples ran to their end with the stream open, and an
    update got 409). The streamed form too. (Against vLLM: tests/test_bridge_openai_vllm.py.)"""
    import time

    eng = HFEngine(tiny_llama_dir)
    b = BridgeThread(create_app([eng], sample_timeout_s=120)).start()
    body = {"model": served, "prompt": PROMPT, "n": 4, "max_tokens": 900, "temperature": 1.0, "ignore_eos": True, "stream": stream}
    seen, watching = [0], [True]

    def watch():  # the engine's active samples while the client is there (read after it left, a fast
        while watching[0]:  # cancellation would already show 0: the CI of 2026-12-06 failed that way)
            seen[0] = max(seen[0], eng.active_samples)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout) if not stream else contextlib.nullcontext():
            with httpx.Client(timeout=1.0) as h, h.stream("POST", b.url + "/v1/completions", json=body) as r:
                for _ in r.iter_bytes():
                    if time.monotonic() - t0 > 1.0:
                        break
        watching[0] = False
        watcher.join()
        assert seen[0] > 0, "no sample ran while the client was there: nothing was tested"
        t_left = time.monotonic()
        while time.monotonic() - t_left < 2.0 and (eng.active_samples or httpx.get(b.url + "/v1/weights").json()["streams_open"]):
            time.sleep(0.05)
        assert eng.active_samples == 0 and httpx.get(b.url + "/v1/weights").json()["streams_open"] == 0
    finally:
        watching[0] = False
        b.stop()

