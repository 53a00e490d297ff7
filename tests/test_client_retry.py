"""The HTTP clients (engine backends, the bridge client) retry a refused connect: a server that
comes up a moment late is reached, and one that never comes up still fails, after the bounded
backoff (httpx's transport retries, which never resend a request that reached the server)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import httpx
import pytest

from foursight.trainer_bridge.client import RolloutClient
from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
from foursight.trainer_bridge.launch import free_port


class _Health(http.server.BaseHTTPRequestHandler):
    seen_auth: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Health.seen_auth.append(self.headers.get("Authorization"))
        body = b'{"data": [{"id": "served-model"}]}' if self.path == "/v1/models" else b'{"version": 3, "update_in_progress": false, "streams_open": 0}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def _serve_later(port: int, delay_s: float) -> tuple[threading.Thread, list]:
    box: list = []

    def run():
        time.sleep(delay_s)
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
        box.append(srv)
        srv.serve_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _refused(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)
    except httpx.ConnectError:
        return True
    return False


def test_engine_client_reaches_a_server_that_starts_late():
    """The engine client's first call (``GET /v1/models`` at start) waits through refused connects;
    its health probe does not (a dead engine is reported at once, not after the backoff)."""
    port = free_port()
    assert _refused(port)  # nothing listens yet: a client without retries fails here

    async def probe():
        dead = VLLMHTTPEngine(f"http://127.0.0.1:{port}", model="m")  # a given model: start() connects to nothing
        await dead.start()
        try:
            t0 = time.monotonic()
            return await dead.health(), time.monotonic() - t0
        finally:
            await dead.aclose()

    up, took = asyncio.run(probe())
    assert not up and took < 2.0
    eng = VLLMHTTPEngine(f"http://127.0.0.1:{port}")
    _, box = _serve_later(port, 1.2)

    async def go():
        t0 = time.monotonic()
        await eng.start()
        try:
            return eng.model, await eng.health(), time.monotonic() - t0
        finally:
            await eng.aclose()

    try:
        model, up, waited = asyncio.run(go())
        assert model == "served-model" and up and waited >= 1.0  # it waited for the server, through refused connects
    finally:
        box and box[0].shutdown()


def test_bridge_client_reaches_a_bridge_that_starts_late():
    port = free_port()
    assert _refused(port)
    _, box = _serve_later(port, 1.2)
    try:
        with RolloutClient(f"http://127.0.0.1:{port}") as c:
            assert c.weight_version() == 3
    finally:
        box and box[0].shutdown()


def test_retries_are_bounded():
    port = free_port()
    t0 = time.monotonic()
    with RolloutClient(f"http://127.0.0.1:{port}") as c, pytest.raises(httpx.ConnectError):
        c.weight_version()
    assert 5.0 < time.monotonic() - t0 < 30.0  # backoff 0.5 + 1 + 2 + 4 s, then the error


def test_compare_sends_its_api_key_to_a_given_engine_url(tmp_path):
    """``foursight compare --api-key`` reaches a server given by ``--engine-url`` as a bearer token."""
    from foursight.compare.launch import open_engine
    from foursight.compare.spec import EngineSpec

    port = free_port()
    _, box = _serve_later(port, 0.0)
    try:
        eng, srv = open_engine(EngineSpec("vllm", "bf16"), {"bf16": tmp_path}, {"vllm:bf16": f"http://127.0.0.1:{port}"},
                               tmp_path / "logs", "python", 256, api_key="k-123")
        assert srv is None
        eng.model = "m"  # skip /v1/models; /health is what this server answers

        async def go():
            await eng.start()
            try:
                return await eng.health()
            finally:
                await eng.aclose()

        _Health.seen_auth.clear()
        assert asyncio.run(go())
        assert _Health.seen_auth == ["Bearer k-123"]
    finally:
        box and box[0].shutdown()
