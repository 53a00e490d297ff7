"""What each engine serves, as the bridge knows it: restart detection and the health probe.

The bridge tags every sample with a weight version, so it must know that the engine still serves
the weights it pushed. An engine that can report its state (:meth:`Engine.served_state`: the
FourSight vLLM worker extension, the in-process HF engine) gives a boot id and the version of its
last update, and, where it can, the weights id the bridge sent with that update (a nonce per push:
the vLLM routes). The bridge records them at start and after every update it pushes, and compares:

* **in sync**: the engine reports the version (and weights id) the bridge last pushed to it;
* **stale**: it reports another one (a restarted engine is back on its checkpoint, version 0; a
  weights id the bridge did not send: someone else loaded weights into it), or
  the last update failed on it (its weights are unknown). A stale engine gets no samples; when no
  engine is in sync ``/v1/rollouts`` answers 503 naming the engine and what it serves. A weight
  update with a new version brings it back (it must carry every tensor the trainer changed);
* **unknown**: the state could not be read (engine down or not answering). Samples may still go to
  it, but each first re-reads the state, so a restarted engine is caught before it serves one.

Engines that cannot report their state (plain vLLM without the extension, SGLang) are
*untracked*: they cannot take bridge updates either, so they are assumed to serve what they
started with. See docs/bridge.md and docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Sequence

from foursight.trainer_bridge.backends.base import Engine
from foursight.trainer_bridge.protocol import SamplingParams

IN_SYNC, STALE, UNKNOWN, UNTRACKED = "in_sync", "stale", "unknown", "untracked"


class EngineStale(RuntimeError):
    """The engine does not serve the weights the bridge would tag its samples with."""


class EngineSync:
    """The bridge's record of one engine: boot id and engine version after the last push."""

    def __init__(self, engine: Engine, bridge_version: int):
        self.engine = engine
        self.tracked = False
        self.boot_id: str | None = None
        #: engine-reported version that means "serves bridge_version"; None: unknown weights
        self.expected: int | None = None
        self.bridge_version = bridge_version
        self.status = UNTRACKED
        self.reason: str | None = None
        self.engine_version: int | None = None
        #: the weights id the engine reported after the last push (None: the engine has none)
        self.weights_id: str | None = None
        self.restarted = False
        self._lock = asyncio.Lock()
        self._checked_at = -math.inf

    def view(self) -> dict[str, Any]:
        """The health entry of this engine (what it serves, as far as the bridge knows)."""
        serving = self.bridge_version if self.status in (IN_SYNC, UNTRACKED) else None
        return {"sync": self.status, "weight_version": serving, "engine_version": self.engine_version,
                "boot_id": self.boot_id, "restarted": self.restarted, "reason": self.reason}

    def _stale_reason(self, version: int, restarted: bool) -> str:
        what = "restarted and " if restarted else ""
        return (f"engine {self.engine.name} {what}reports weight version {version}, but the bridge pushed version "
                f"{self.bridge_version} to it (engine version {self.expected}): its samples would carry a version it does not "
                f"serve, so it gets none until a weight update (POST /v1/weights with a greater version) brings it back")

    async def check(self, timeout_s: float) -> str:
        """Read the engine's state and update the status (concurrent callers share one read)."""
        if not self.tracked:
            return self.status
        asked = time.monotonic()
        async with self._lock:
            if self._checked_at >= asked:  # someone read it while we waited
                return self.status
            try:
                st = await asyncio.wait_for(self.engine.served_state(), timeout_s)
            except Exception as e:  # noqa: BLE001 - down or not answering: unknown, re-read before each sample
                self.status, self.reason = UNKNOWN, f"engine {self.engine.name} did not report its state: {type(e).__name__}: {e}"
            else:
                self._apply(st)
            self._checked_at = time.monotonic()
            return self.status

    def _apply(self, st: dict[str, Any] | None) -> None:
        if st is None:
            self.status = STALE
            self.reason = f"engine {self.engine.name} no longer reports its state (restarted without the FourSight worker extension?)"
            return
        version, boot = int(st["version"]), str(st["boot_id"])
        self.engine_version = version
        if boot != self.boot_id:
            self.restarted = True
        if self.expected is None:
            self.status = STALE
            self.reason = (f"engine {self.engine.name}: the last weight update failed on it, so its weights are unknown; "
                           f"push a weight update with a version greater than {self.bridge_version}")
        elif version != self.expected:
            self.status, self.reason = STALE, self._stale_reason(version, boot != self.boot_id)
        elif st.get("weights_id") != self.weights_id:
            self.status = STALE
            self.reason = (f"engine {self.engine.name} serves weights the bridge did not push (weights id {st.get('weights_id')!r}, "
                           f"the bridge's last push set {self.weights_id!r}): something else loaded weights into it, so it gets "
                           f"no samples until a weight update (POST /v1/weights with a greater version) brings it back")
        else:
            # same version: a restart without any update since (same checkpoint) serves the same weights
            self.status, self.reason, self.boot_id = IN_SYNC, None, boot

    async def baseline(self, bridge_version: int, timeout_s: float) -> None:
        """Record what the engine serves now as ``bridge_version`` (at start and after an update)."""
        async with self._lock:
            st = await asyncio.wait_for(self.engine.served_state(), timeout_s)
            self.bridge_version = bridge_version
            if st is None:
                self.tracked, self.status = False, UNTRACKED
                return
            self.tracked, self.boot_id, self.expected = True, str(st["boot_id"]), int(st["version"])
            self.weights_id = st.get("weights_id")
            self.engine_version, self.status, self.reason, self.restarted = self.expected, IN_SYNC, None, False
            self._checked_at = time.monotonic()

    def update_failed(self, bridge_version: int, atomic: bool) -> None:
        """An update to this engine failed: unless the engine applies updates atomically, its
        weights may be partly new, so it is stale until the next successful update."""
        if self.tracked and not atomic:
            self.expected, self.status = None, STALE
            self.reason = (f"engine {self.engine.name}: the weight update failed on it, so its weights are unknown; "
                           f"push a weight update with a version greater than {bridge_version}")

    def mark_unknown(self) -> None:
        """A call to the engine failed: re-read its state before it gets the next sample."""
        if self.tracked and self.status == IN_SYNC:
            self.status = UNKNOWN


class Liveness:
    """The :class:`EngineSync` of every engine of one bridge, whether each answers its health route
    (:meth:`up_all`), and the health probe."""

    def __init__(self, engines: Sequence[Engine], state_timeout_s: float = 10.0, probe_timeout_s: float = 10.0):
        self.state_timeout_s = state_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.sync = {id(e): EngineSync(e, 0) for e in engines}
        self._up: dict[int, tuple[float, bool]] = {}
        self._up_locks = {id(e): asyncio.Lock() for e in engines}

    async def up(self, engine: Engine) -> bool:
        """Whether ``engine`` answers its health route now, as ``/v1/health`` reads it (the engine's
        ``health()``: no connect retries, so a dead engine is known at once). Callers that ask while a
        read is under way share it (a burst of requests costs one read, as :meth:`EngineSync.check`);
        a read that ended before the caller asked is not reused, so an engine that died a moment
        ago is not taken for up. The admission of every request asks it first, so that a request to
        a dead engine fails at once instead of waiting out the engine client's connect retries
        (22.5 s per request on SGLang before, issue 53)."""
        asked = time.monotonic()
        async with self._up_locks[id(engine)]:
            at, ok = self._up.get(id(engine), (-math.inf, False))
            if at >= asked:  # someone read it while we waited
                return ok
            try:
                ok = bool(await asyncio.wait_for(engine.health(), self.probe_timeout_s))
            except Exception:  # noqa: BLE001 - no answer is not up
                ok = False
            self._up[id(engine)] = (time.monotonic(), ok)
            return ok

    async def up_all(self) -> list[bool]:
        return list(await asyncio.gather(*(self.up(s.engine) for s in self.sync.values())))

    def of(self, engine: Engine) -> EngineSync:
        return self.sync[id(engine)]

    async def baseline_all(self, bridge_version: int) -> None:
        for s in self.sync.values():
            await s.baseline(bridge_version, self.state_timeout_s)

    async def check_all(self, engines: Sequence[Engine] | None = None) -> list[str]:
        """The sync status of every engine (of ``engines`` only, when given: the others are not asked)."""
        chosen = self.sync.values() if engines is None else [self.of(e) for e in engines]
        return list(await asyncio.gather(*(s.check(self.state_timeout_s) for s in chosen)))

    async def ensure(self, engine: Engine) -> None:
        """Before a sample goes to ``engine``: re-read its state when it is not known to be in sync;
        raise :class:`EngineStale` when it serves other weights."""
        s = self.of(engine)
        if s.status in (IN_SYNC, UNTRACKED):
            return
        if await s.check(self.state_timeout_s) == STALE:
            raise EngineStale(s.reason)

    async def probe(self, engine: Engine) -> dict[str, Any]:
        """One greedy 1-token request: can the engine complete a request now, with finite logprobs?"""
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0), 1, None), self.probe_timeout_s)
            if not r.logprobs or not all(math.isfinite(v) for v in r.logprobs):
                return {"ok": False, "seconds": time.monotonic() - t0, "error": f"non-finite logprobs {r.logprobs}"}
            return {"ok": True, "seconds": time.monotonic() - t0, "error": None}
        except (asyncio.TimeoutError, TimeoutError):
            return {"ok": False, "seconds": time.monotonic() - t0,
                    "error": f"a 1-token request did not finish within {self.probe_timeout_s} s (engine busy or hung)"}
        except Exception as e:  # noqa: BLE001 - reported in the health answer
            return {"ok": False, "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"}
