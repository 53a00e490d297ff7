"""Bridge scheduling with a scripted engine: backpressure, per-sample ordering, metrics, version gate.

The engine here is a scripted in-process stand-in (fixed tokens after a delay, counting calls):
these tests check the bridge's own scheduling, not engine numerics (covered against vLLM and HF).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from foursight.trainer_bridge.client import RolloutClient, RolloutStreamError
from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.launch import BridgeThread
from foursight.trainer_bridge.protocol import Rollout
from foursight.trainer_bridge.routes.state import VersionGate
from foursight.trainer_bridge.server import create_app


class ScriptedEngine(Engine):
    kind = "scripted"

    def __init__(self, delay_s: float = 0.05, fail_prompt_token: int | None = None):
        self.name = "scripted"
        self.delay_s = delay_s
        self.calls = 0
        self.fail_prompt_token = fail_prompt_token
        self.version = 0

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None):
        self.calls += 1
        await asyncio.sleep(self.delay_s * (1 + (seed or 0) % 3))
        if self.fail_prompt_token is not None and prompt_ids[0] == self.fail_prompt_token:
            raise RuntimeError("scripted failure")
        return Rollout(prompt_ids=prompt_ids, token_ids=[7] * max_tokens, logprobs=[-0.5] * max_tokens, finish_reason="length")

    async def update_weights(self, path, version):
        self.version = version
        return {"engine": self.name, "version": version}

    async def health(self):
        return True


def test_backpressure_slow_reader():
    """Events of ~2 MB each: once the socket buffers are full, a paused reader stops the stream's
    engine work at the window (max_queue=2) instead of letting all 20 samples run ahead."""
    eng = ScriptedEngine(delay_s=0.01)
    b = BridgeThread(create_app([eng], max_queue=2)).start()
    try:
        body = {"prompts": [{"token_ids": [1, 2]}], "n": 20, "sampling": {"max_tokens": 300_000, "seed": 0}}
        with httpx.Client(timeout=120) as h, h.stream("POST", b.url + "/v1/rollouts", json=body) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines))
            assert first["type"] == "sample"
            time.sleep(2.0)  # a slow reader
            calls_during_pause = eng.calls
            rest = [json.loads(x) for x in lines if x]
        print(f"\nengine calls while the reader paused: {calls_during_pause} of 20")
        assert calls_during_pause <= 10, calls_during_pause  # 1 read + ~2 MB events in socket buffers + window 2
        assert len(rest) == 20 and rest[-1]["type"] == "end" and rest[-1]["num_samples"] == 20
        assert eng.calls == 20
    finally:
        b.stop()


def test_failed_samples_and_metrics():
    eng = ScriptedEngine(fail_prompt_token=99)
    b = BridgeThread(create_app([eng])).start()
    try:
        with RolloutClient(b.url) as c:
            out = list(c.stream([[1, 2], [99, 2]], {"max_tokens": 2}, n=3, raise_on_error=False))
        kinds = sorted((o.prompt_index, getattr(o, "type", "sample")) for o in out)
        assert kinds == [(0, "sample")] * 3 + [(1, "error")] * 3
        text = httpx.get(b.url + "/metrics").text
        assert 'foursight_bridge_samples_total{status="error"} 3.0' in text
        assert 'foursight_bridge_errors_total{kind="engine"} 3.0' in text
        assert "foursight_bridge_active_streams 0.0" in text and "foursight_bridge_pending_samples 0.0" in text
    finally:
        b.stop()


def test_client_detects_a_cut_stream():
    """A stream without its end event (bridge died) raises instead of returning short."""
    from foursight.trainer_bridge.client import EventTracker

    tr = EventTracker(raise_on_error=True)
    tr.handle(json.dumps({"type": "sample", "request_id": "r", "prompt_index": 0, "sample_index": 0, "prompt_ids": [1],
                          "token_ids": [2], "logprobs": [-1.0], "finish_reason": "length", "engine": "e", "weight_version": 0}))
    with pytest.raises(RolloutStreamError, match="without its end event after 1"):
        tr.finish()


def test_version_gate_orders_updates_after_streams():
    async def run():
        gate = VersionGate(0)
        order = []

        async def stream(tag):
            async with gate.read() as v:
                order.append((tag, "start", v))
                await asyncio.sleep(0.2)
                order.append((tag, "end", v))

        async def update():
            await asyncio.sleep(0.05)
            async with gate.write(5.0):
                order.append(("update", "apply", gate.version))
                gate.version = 1

        async def late_stream():
            await asyncio.sleep(0.1)  # arrives while the update waits: must see version 1
            await stream("late")

        await asyncio.gather(stream("a"), update(), late_stream())
        return order

    order = asyncio.run(run())
    assert order[0] == ("a", "start", 0) and order[1] == ("a", "end", 0)
    assert order[2] == ("update", "apply", 0)
    assert order[3:] == [("late", "start", 1), ("late", "end", 1)]


class RestartingEngine(ScriptedEngine):
    """Reports a boot id and version like the vLLM worker extension; its ``crash_at``-th generate
    call fails and the engine comes back on version 0 with a new boot id (a restart)."""

    def __init__(self, crash_at: int):
        super().__init__(delay_s=0.02)
        self.boot, self.crash_at, self.gen_calls = "boot-1", crash_at, 0

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None):
        self.gen_calls += 1
        if self.gen_calls == self.crash_at:
            self.boot, self.version = "boot-2", 0
            raise ConnectionError("connection reset by peer")
        return await super().generate(prompt_ids, params, max_tokens, seed)

    async def served_state(self):
        return {"boot_id": self.boot, "version": self.version}


def test_engine_restart_mid_stream_gives_error_events_not_mistagged_samples():
    """The engine restarts during a stream under version 5: the failed call is an error event, and
    every later sample of the stream is an error naming the restart (none carries version 5 while
    the engine serves version 0); health is 503 and says so."""
    eng = RestartingEngine(crash_at=3)
    b = BridgeThread(create_app([eng], max_concurrency=1)).start()
    try:
        # a version-5 engine: what an update through the bridge leaves behind
        import tempfile

        import torch
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as d:
            save_file({"w": torch.ones(2)}, f"{d}/w.safetensors")
            assert httpx.post(b.url + "/v1/weights", json={"version": 5, "path": f"{d}/w.safetensors"}).status_code == 200
        assert eng.version == 5
        body = {"prompts": [{"token_ids": [1, 2]}], "n": 6, "sampling": {"max_tokens": 2}}
        events = []
        with httpx.Client(timeout=60) as h, h.stream("POST", b.url + "/v1/rollouts", json=body) as r:
            for line in r.iter_lines():
                if line:
                    events.append(json.loads(line))
        samples = [e for e in events if e["type"] == "sample"]
        errors = [e for e in events if e["type"] == "error"]
        assert len(samples) == 2 and all(e["weight_version"] == 5 for e in samples)
        assert len(errors) == 4 and events[-1]["type"] == "end" and events[-1]["num_errors"] == 4
        assert "connection reset" in errors[0]["error"]
        assert all("restarted" in e["error"] and "reports weight version 0" in e["error"] for e in errors[1:])
        h = httpx.get(b.url + "/v1/health")
        assert h.status_code == 503 and h.json()["engines"][0]["sync"] == "stale"
    finally:
        b.stop()
