"""The bridge's edge (issue 14): weight paths confined to the weights folders, Host/Origin against DNS
rebinding, the body limit, the API key before the body, fields checked against the served model,
and the bind guards in serve() itself. In-process engines: these are the bridge's own checks."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from safetensors.torch import save_file

from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.guards import BindError
from foursight.trainer_bridge.launch import BridgeThread
from foursight.trainer_bridge.protocol import Rollout
from foursight.trainer_bridge.server import create_app, serve

KEY = "edge-key"
H = {"Authorization": f"Bearer {KEY}"}


class CountingEngine(Engine):
    """Fixed answers; counts generate and update calls (what reached the engine)."""

    kind = "counting"

    def __init__(self, vocab: int | None = 100):
        self.name = "counting"
        self.generated = 0
        self.updates: list[tuple[str, int]] = []
        self._vocab = vocab

    @property
    def vocab_size(self):
        return self._vocab

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None):
        self.generated += 1
        await asyncio.sleep(0.01)
        return Rollout(prompt_ids=prompt_ids, token_ids=[3] * max_tokens, logprobs=[-0.1] * max_tokens, finish_reason="length")

    async def update_weights(self, path, version):
        self.updates.append((path, version))
        return {"engine": self.name, "version": version}

    async def health(self):
        return True


@pytest.fixture()
def weights_dir(tmp_path):
    import torch

    d = tmp_path / "weights"
    d.mkdir()
    save_file({"model.norm.weight": torch.ones(4)}, str(d / "ok.safetensors"))
    return d


@pytest.fixture()
def edge(weights_dir):
    eng = CountingEngine()
    b = BridgeThread(create_app([eng], api_key=KEY, weights_dirs=[weights_dir], max_body_bytes=64 << 10, max_tokens_cap=512)).start()
    yield b, eng
    b.stop()


def _update(b, **body):
    return httpx.post(b.url + "/v1/weights", json={"version": 1, **body}, headers=H, timeout=30)


def test_update_path_outside_weights_dir_gets_one_answer_for_every_reason(edge, weights_dir, tmp_path):
    """/etc/passwd, a ../ escape, a symlink out, a nonexistent path, an unreadable file and a device:
    all 422 with the same message, nothing reaches the engine, the version stays 0."""
    b, eng = edge
    outside = tmp_path / "other.safetensors"
    save_file({"model.norm.weight": __import__("torch").ones(4)}, str(outside))
    (weights_dir / "link.safetensors").symlink_to(outside)
    unreadable = weights_dir / "secret.safetensors"
    unreadable.write_bytes(b"x")
    unreadable.chmod(0)
    cases = ["/etc/passwd", str(weights_dir / ".." / "other.safetensors"), str(weights_dir / "link.safetensors"),
             str(weights_dir / "missing.safetensors"), str(tmp_path / "missing.safetensors"), "/dev/zero"]
    if os.geteuid() != 0:  # root reads anything
        cases.append(str(unreadable))
    answers = set()
    for p in cases:
        r = _update(b, path=p)
        assert r.status_code == 422, (p, r.text)
        assert r.json()["fields"][0]["field"] == "path"
        answers.add(r.json()["error"])
    assert len(answers) == 1, answers  # nothing tells an existing file from a missing one
    assert "not an allowed weights file" in answers.pop()
    assert eng.updates == [] and httpx.get(b.url + "/v1/weights").json()["version"] == 0
    r = _update(b, path=str(weights_dir / "ok.safetensors"))
    assert r.status_code == 200, r.text
    assert eng.updates == [(str((weights_dir / "ok.safetensors").resolve()), 1)]


def test_shm_name_cannot_leave_the_shm_folder(edge, tmp_path, monkeypatch):
    b, eng = edge
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("FOURSIGHT_SHM_DIR", str(shm))
    (shm / "escape.safetensors").symlink_to("/etc/passwd")
    for name in ("escape.safetensors", "missing.safetensors", ".."):
        r = _update(b, shm_name=name)
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "shm_name", r.text
    assert eng.updates == []


def test_host_and_origin_are_checked_against_dns_rebinding(edge):
    """A page on evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example (400)
    and, from a browser, Origin: http://evil.example (403); loopback names pass."""
    b, eng = edge
    body = {"prompts": [{"token_ids": [1, 2]}], "sampling": {"max_tokens": 2}}
    r = httpx.post(b.url + "/v1/rollouts", json=body, headers={**H, "Host": "evil.example"})
    assert r.status_code == 400
    r = httpx.post(b.url + "/v1/rollouts", json=body, headers={**H, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "Origin" in r.json()["error"]
    r = httpx.post(b.url + "/v1/weights", json={"version": 1, "shm_name": "x"}, headers={**H, "Origin": "null"})
    assert r.status_code == 403
    assert eng.generated == 0 and eng.updates == []
    r = httpx.post(b.url + "/v1/rollouts", json=body, headers={**H, "Host": f"localhost:{b.port}", "Origin": f"http://127.0.0.1:{b.port}"})
    assert r.status_code == 200 and eng.generated == 1


def test_operator_allowed_host_passes(weights_dir):
    b = BridgeThread(create_app([CountingEngine()], allowed_hosts=["127.0.0.1", "bridge.internal"])).start()
    try:
        body = {"prompts": [{"token_ids": [1]}], "sampling": {"max_tokens": 1}}
        assert httpx.post(b.url + "/v1/rollouts", json=body, headers={"Host": "bridge.internal"}).status_code == 200
        assert httpx.post(b.url + "/v1/rollouts", json=body, headers={"Host": "other.internal"}).status_code == 400
    finally:
        b.stop()


def test_body_over_the_limit_is_413_before_parsing(edge):
    b, eng = edge
    big = {"prompts": [{"token_ids": [1] * 40_000}], "sampling": {"max_tokens": 2}}
    r = httpx.post(b.url + "/v1/rollouts", json=big, headers=H)
    assert r.status_code == 413 and "larger than 65536 bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"prompts": [{"token_ids": [1'
        for _ in range(30_000):  # 90 kB
            yield b", 1"
        yield b"]}]}"

    r = httpx.post(b.url + "/v1/rollouts", content=chunks(), headers={**H, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert eng.generated == 0
    assert 'foursight_bridge_errors_total{kind="bad_request"} 2.0' in httpx.get(b.url + "/metrics").text


def test_api_key_is_checked_before_the_body_is_parsed(edge):
    """A wrong key with a malformed body is 401 (before: the body was parsed first and answered 422)."""
    b, _ = edge
    for path in ("/v1/rollouts", "/v1/weights"):
        r = httpx.post(b.url + path, content=b"{not json", headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
        assert r.status_code == 401, (path, r.status_code, r.text)
        r = httpx.post(b.url + path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 401
    assert httpx.get(b.url + "/v1/health").status_code == 200  # health and metrics stay open
    assert httpx.get(b.url + "/metrics").status_code == 200


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompts": [{"token_ids": [1]}], "sampling": {"min_tokens": 9, "max_tokens": 3}}, "sampling.min_tokens"),
        ({"prompts": [{"token_ids": [1], "max_tokens": 3}], "sampling": {"min_tokens": 5, "max_tokens": 10}}, "prompts[0].max_tokens"),
        ({"prompts": [{"token_ids": [1, 100]}]}, "prompts[0].token_ids[1]"),
        ({"prompts": [{"token_ids": [1]}, {"token_ids": [2, 3, 250]}]}, "prompts[1].token_ids[2]"),
        ({"prompts": [{"token_ids": [1]}], "sampling": {"stop_token_ids": [5, 1000]}}, "sampling.stop_token_ids[1]"),
        ({"prompts": [{"token_ids": [1, 2 ** 63]}]}, "prompts[0].token_ids[1]"),
        ({"prompts": [{"token_ids": [1]}], "sampling": {"seed": 2 ** 63}}, "sampling.seed"),
        ({"prompts": [{"token_ids": [1]}], "n": 4, "sampling": {"seed": 2 ** 63 - 2}}, "sampling.seed"),
        ({"prompts": [{"token_ids": [1]}], "sampling": {"max_tokens": 513}}, "sampling.max_tokens"),
        ({"prompts": [{"token_ids": [1], "max_tokens": 600}]}, "prompts[0].max_tokens"),
        ({"prompts": [{"token_ids": [1]}], "request_id": "a\r\nSet-Cookie: x=1"}, "request_id"),  # before: a 500-like cut
        ({"prompts": [{"token_ids": [1]}], "request_id": ""}, "request_id"),
    ],
)
def test_fields_checked_against_the_served_model_name_the_field(edge, body, field):
    """min_tokens > max_tokens, ids outside the vocabulary (100 here), ints beyond int64, the
    server's max_tokens cap and a request id that cannot be a header value: 422 naming the field,
    and nothing reaches the engine."""
    b, eng = edge
    r = httpx.post(b.url + "/v1/rollouts", json=body, headers=H)
    assert r.status_code == 422, r.text
    assert field in [f["field"] for f in r.json()["fields"]], r.json()
    assert field in r.json()["error"]
    assert eng.generated == 0


def test_per_request_token_budget_names_the_field():
    """--max-request-tokens: n times the sum of the prompts' max_tokens (a prompt's own max_tokens
    counts instead of the sampling one); over the budget 422 naming n, nothing reaches the engine;
    at the budget the request runs."""
    eng = CountingEngine()
    b = BridgeThread(create_app([eng], api_key=KEY, max_request_tokens=100)).start()
    try:
        over = {"prompts": [{"token_ids": [1]}, {"token_ids": [2], "max_tokens": 30}], "n": 2, "sampling": {"max_tokens": 21}}
        r = httpx.post(b.url + "/v1/rollouts", json=over, headers=H)
        assert r.status_code == 422 and "n" in [f["field"] for f in r.json()["fields"]], r.text
        assert "102" in r.json()["error"] and "token budget 100" in r.json()["error"]
        assert eng.generated == 0
        at = {**over, "sampling": {"max_tokens": 20}}
        r = httpx.post(b.url + "/v1/rollouts", json=at, headers=H)
        assert r.status_code == 200 and r.text.count('"type":"sample"') == 4, r.text
    finally:
        b.stop()


def test_ids_at_the_vocabulary_edge_are_accepted(edge):
    b, eng = edge
    r = httpx.post(b.url + "/v1/rollouts", json={"prompts": [{"token_ids": [0, 99]}], "n": 2,
                                                  "sampling": {"max_tokens": 512, "seed": 2 ** 63 - 2, "stop_token_ids": [99]}}, headers=H)
    assert r.status_code == 200 and r.text.count('"type":"sample"') == 2


@pytest.mark.parametrize("host, kw, message", [
    ("0.0.0.0", {}, "allow_remote"),
    ("0.0.0.0", {"allow_remote": True}, "API key"),
    ("192.168.1.7", {"allow_remote": True, "api_key": ""}, "API key"),
])
def test_serve_itself_refuses_remote_binds_without_a_key(host, kw, message, monkeypatch):
    """The guard is in serve(), not only the CLI: nothing is bound (uvicorn.run is never reached)."""
    import uvicorn

    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: ran.append(k))
    with pytest.raises(BindError, match=message):
        serve([CountingEngine()], host=host, **kw)
    assert ran == []
    serve([CountingEngine()], host="0.0.0.0", allow_remote=True, api_key="k")  # allowed with a key
    assert ran and ran[0]["host"] == "0.0.0.0"


# ---- issue 28: undecodable bodies, the model's context, stalled streams -------------------------


@pytest.mark.parametrize("path, shape", [("/v1/rollouts", "bridge"), ("/v1/completions", "openai")])
def test_body_with_invalid_utf8_gets_the_documented_422(edge, path, shape):
    """A body that is not UTF-8: 422 naming ``body`` in the route's documented shape (before:
    FastAPI's 400 {"detail": "There was an error parsing the body"})."""
    b, eng = edge
    r = httpx.post(b.url + path, content=b'{"prompts": [{"text": "\xff\xfe"}]}', headers={**H, "Content-Type": "application/json"})
    assert r.status_code == (422 if shape == "bridge" else 400), r.text  # the OpenAI routes answer as vLLM does
    err = r.json()["error"]
    body = err if shape == "bridge" else err["message"]
    fields = r.json()["fields"] if shape == "bridge" else err["fields"]
    assert body.startswith("invalid request: body:") and "UnicodeDecodeError" in body, r.text
    assert [f["field"] for f in fields] == ["body"]
    assert eng.generated == 0


@pytest.fixture(scope="module")
def hf_edge(tiny_llama_dir):
    """A bridge over the real HF engine (tiny Llama, max_position_embeddings 1024)."""
    from foursight.trainer_bridge.backends.hf import HFEngine

    b = BridgeThread(create_app([HFEngine(tiny_llama_dir)], api_key=KEY)).start()
    yield b
    b.stop()


@pytest.mark.parametrize("prompt_len, sampling, prompt_max, field", [
    (1000, {"max_tokens": 100}, None, "sampling.max_tokens"),
    (1000, {"max_tokens": 8}, 25, "prompts[0].max_tokens"),
    (12000, {"max_tokens": 1}, None, "prompts[0]"),
])
def test_prompt_beyond_the_hf_models_context_is_422_naming_the_field(hf_edge, prompt_len, sampling, prompt_max, field):
    """The HF engine (1024 positions): a prompt plus its max_tokens beyond the context is refused
    before any generation, naming the field (before: accepted; a 12k-token prompt held the engine
    83 s on SmolLM2). At the edge (1000 + 24) the request runs."""
    prompt = {"token_ids": [5] * prompt_len, **({"max_tokens": prompt_max} if prompt_max else {})}
    t0 = __import__("time").monotonic()
    r = httpx.post(hf_edge.url + "/v1/rollouts", json={"prompts": [prompt], "sampling": sampling}, headers=H, timeout=60)
    assert r.status_code == 422, r.text[:500]
    assert field in [f["field"] for f in r.json()["fields"]] and "context of 1024 tokens" in r.json()["error"], r.json()
    assert __import__("time").monotonic() - t0 < 10
    ok = httpx.post(hf_edge.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5] * 1000}], "sampling": {"max_tokens": 24}},
                    headers=H, timeout=120)
    assert ok.status_code == 200 and ok.text.count('"type":"sample"') == 1, ok.text[-500:]


def test_openai_route_checks_the_context_too(hf_edge):
    """The OpenAI routes check the context as vLLM's server does: a prompt that fills it, or a
    ``max_tokens`` beyond it, is 400 naming the field; a prompt whose ``max_tokens`` reaches past it
    gets the rest of the context (issue 53: before, 400; vLLM trims), never a sample past the
    model's positions."""
    r = httpx.post(hf_edge.url + "/v1/completions", json={"prompt": [5] * 1024, "max_tokens": 1}, headers=H, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[0]" and "context of 1024" in r.json()["error"]["message"], r.text
    r = httpx.post(hf_edge.url + "/v1/completions", json={"prompt": [5] * 8, "max_tokens": 1025}, headers=H, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "context of 1024" in r.json()["error"]["message"], r.text
    r = httpx.post(hf_edge.url + "/v1/completions", json={"prompt": [5] * 1020, "max_tokens": 10, "ignore_eos": True}, headers=H, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text[-500:]


def _stalled_stream(url: str, n: int = 256, max_tokens: int = 4096):
    """Open a large rollout stream and never read it (a 4 KiB receive buffer: the server's writes block)."""
    import json
    import socket

    host, port = url.split("//")[1].split(":")
    body = json.dumps({"prompts": [{"token_ids": [1]}], "n": n, "sampling": {"max_tokens": max_tokens}}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


@pytest.mark.parametrize("write_timeout_s, expect", [(2.0, 200), (None, 409)])
def test_a_stream_whose_client_stops_reading_is_dropped_and_cannot_block_updates(weights_dir, write_timeout_s, expect):
    """A client opens a large stream and never reads. With the write timeout (2 s here; 30 s by
    default) the bridge drops it and a weight update goes through (200, the stream count back to 0);
    with a timeout longer than the update's drain_timeout_s (the behaviour before: no timeout) the
    update is refused 409 while the stream holds."""
    import time

    eng = CountingEngine()
    app = create_app([eng], api_key=KEY, weights_dirs=[weights_dir], write_timeout_s=write_timeout_s or 600.0)
    b = BridgeThread(app).start()
    s = _stalled_stream(b.url)
    try:
        time.sleep(1.0)
        r = httpx.post(b.url + "/v1/weights", json={"version": 1, "path": str(weights_dir / "ok.safetensors"), "drain_timeout_s": 6},
                       headers=H, timeout=60)
        assert r.status_code == expect, r.text
        if expect == 200:
            assert httpx.get(b.url + "/v1/weights").json() == {"version": 1, "update_in_progress": False, "streams_open": 0}
            assert 'kind="write_timeout"' in httpx.get(b.url + "/metrics").text
    finally:
        s.close()
        b.stop()


@pytest.mark.parametrize("path, shape", [("/v1/rollouts", "bridge"), ("/v1/completions", "openai")])
def test_a_body_that_is_not_json_is_named_body(edge, path, shape):
    """A body that is not JSON: 422 naming ``body`` (before: ``[1]``, FastAPI's byte offset read as a list index)."""
    b, eng = edge
    r = httpx.post(b.url + path, content=b"{not json", headers={**H, "Content-Type": "application/json"})
    assert r.status_code == (422 if shape == "bridge" else 400), r.text  # the OpenAI routes answer as vLLM does
    err = r.json()["error"]
    fields = r.json()["fields"] if shape == "bridge" else err["fields"]
    assert [f["field"] for f in fields] == ["body"], r.text
    assert eng.generated == 0
