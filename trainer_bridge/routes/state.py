"""The state the bridge's routes share: one :class:`BridgeState` per app (engines, the weight
:class:`VersionGate`, the Prometheus :class:`BridgeMetrics`, the limits), stored on
``app.state.bridge`` by ``server.create_app`` and handed to each route by the FastAPI dependency
:func:`bridge_state`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Annotated, AsyncIterator, Sequence

import anyio
from fastapi import Depends, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.bridge_config import BridgeConfig
from foursight.trainer_bridge.guards import WeightsRoots
from foursight.trainer_bridge.liveness import Liveness
from foursight.trainer_bridge.uploads import UploadStore


class DrainTimeout(RuntimeError):
    pass


class UpdateInProgress(RuntimeError):
    pass


class VersionGate:
    """Readers (streams) hold the current weight version; a writer (update) waits for them to drain.

    While an update waits or runs, new streams wait, so every sample of a stream is produced
    under the version the stream reports.
    """

    def __init__(self, version: int = 0):
        self.version = version
        self.readers = 0
        self.writer = False
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def read(self) -> AsyncIterator[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer)
            self.readers += 1
            v = self.version
        try:
            yield v
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled (disconnected) stream still releases its read
                async with self._cond:
                    self.readers -= 1
                    self._cond.notify_all()

    @asynccontextmanager
    async def write(self, drain_timeout_s: float) -> AsyncIterator[None]:
        async with self._cond:
            if self.writer:
                raise UpdateInProgress("another weight update is in progress")
            self.writer = True
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.readers == 0), drain_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                self.writer = False
                self._cond.notify_all()
                raise DrainTimeout(f"{self.readers} stream(s) still running after {drain_timeout_s} s") from None
        try:
            yield
        finally:
            async with self._cond:
                self.writer = False
                self._cond.notify_all()


class BridgeMetrics:
    """Prometheus metrics of one bridge app (own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.active_streams = Gauge("foursight_bridge_active_streams", "Rollout streams open", registry=r)
        self.samples = Counter("foursight_bridge_samples", "Samples emitted", ["status"], registry=r)
        self.tokens = Counter("foursight_bridge_generated_tokens", "Generated tokens streamed", registry=r)
        self.tokens_per_s = Gauge("foursight_bridge_tokens_per_second", "Generated tokens/s over the last 10 s", registry=r)
        self.pending = Gauge("foursight_bridge_pending_samples", "Samples waiting for an engine slot or running", registry=r)
        self.queue_depth = Gauge("foursight_bridge_queue_depth", "Finished samples waiting to be sent", registry=r)
        self.errors = Counter("foursight_bridge_errors", "Errors", ["kind"], registry=r)
        self.latency = Histogram("foursight_bridge_sample_seconds", "Engine time per sample", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))
        self.version = Gauge("foursight_bridge_weight_version", "Current weight version", registry=r)
        self.engine_up = Gauge("foursight_bridge_engine_up", "Engine answered the last health check", ["engine"], registry=r)
        self.engine_in_sync = Gauge("foursight_bridge_engine_in_sync", "Engine serves the weights the bridge tags samples with",
                                    ["engine"], registry=r)
        self._window: deque[tuple[float, int]] = deque()

    def add_tokens(self, n: int) -> None:
        self.tokens.inc(n)
        now = time.monotonic()
        self._window.append((now, n))

    def refresh_rate(self, window_s: float = 10.0) -> None:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - window_s:
            self._window.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._window) / window_s)


class BridgeState:
    """Everything the routes of one bridge share: the engines, the bridge's options (``config``, a
    :class:`~foursight.trainer_bridge.bridge_config.BridgeConfig`; each option also reads as an attribute,
    ``state.max_queue`` is ``state.config.max_queue``), the weight gate, metrics and liveness."""

    def __init__(self, engines: Sequence[Engine], config: BridgeConfig):
        if not engines:
            raise ValueError("the bridge needs at least one engine")
        self.engines = list(engines)
        self.config = config
        self.roots = WeightsRoots(config.weights_dirs)
        #: the weight uploads (:class:`~foursight.trainer_bridge.uploads.UploadStore`; set by ``server.create_app``, None:
        #: uploads refused)
        self.uploads: UploadStore | None = None
        #: a trainer's broadcast group passed through to the engines (:mod:`foursight.trainer_bridge.broadcast`), None: none open
        self.broadcast_group = None
        self.inflight = {id(e): 0 for e in self.engines}  # keyed by object: a name may change at start()
        self.metrics = BridgeMetrics()
        self.liveness = Liveness(self.engines, probe_timeout_s=config.probe_timeout_s)
        # made in start(), inside the server's event loop
        self.gate: VersionGate | None = None
        self.sem: asyncio.Semaphore | None = None

    def __getattr__(self, name: str):
        """The bridge's options read as attributes (called only for names the state itself lacks)."""
        config = self.__dict__.get("config")
        if config is not None and name in BridgeConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    async def start(self) -> None:
        """At app startup: the version gate and concurrency limit, every engine started and its served state recorded."""
        self.gate = VersionGate(self.initial_version)
        self.sem = asyncio.Semaphore(self.max_concurrency)
        self.metrics.version.set(self.initial_version)
        for e in self.engines:
            await e.start()
        await self.liveness.baseline_all(self.initial_version)

    async def aclose(self) -> None:
        for e in self.engines:
            await e.aclose()

    def pick_engine(self, allowed: Sequence[Engine] | None = None) -> Engine:
        """The engine with the fewest calls in flight (first one on ties), among ``allowed``."""
        return min(allowed or self.engines, key=lambda e: self.inflight[id(e)])


def bridge_state(request: Request) -> BridgeState:
    """FastAPI dependency: the app's :class:`BridgeState`."""
    return request.app.state.bridge


#: a route parameter annotated ``state: State`` receives the app's :class:`BridgeState`
State = Annotated[BridgeState, Depends(bridge_state)]
