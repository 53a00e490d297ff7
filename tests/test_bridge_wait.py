"""``foursight bridge serve --wait``: a bridge started before its engine waits for the engine's
``/health`` (bounded), instead of failing at startup with a traceback."""

from __future__ import annotations

import threading
import time

from typer.testing import CliRunner

from foursight.trainer_bridge.cli import app, wait_for_engines
from foursight.trainer_bridge.launch import free_port


def test_no_engine_is_a_clear_error_after_the_wait(monkeypatch):
    monkeypatch.delenv("FOURSIGHT_BRIDGE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["serve", "--engine", "vllm", "--engine-url", url, "--wait", "3"], env={"COLUMNS": "300"})
    took = time.monotonic() - t0
    text = " ".join(r.output.replace("│", " ").split())
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert url in text and "--wait 3" in text and "waiting up to 3 s" in text, text
    assert 2.5 < took < 30, took


def test_waits_for_an_engine_that_comes_up_late():
    """The engine's health route answers only after a few seconds (as vLLM's does while it loads)."""
    import uvicorn
    from fastapi import FastAPI

    eng = FastAPI()

    @eng.get("/health")
    def health():
        return {}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(eng, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Timer(3.0, server.run)
    th.daemon = True
    th.start()
    try:
        t0 = time.monotonic()
        wait_for_engines([f"http://127.0.0.1:{port}"], timeout_s=60, interval_s=0.5)
        assert 2.5 < time.monotonic() - t0 < 60
    finally:
        server.should_exit = True
        th.join(10)
