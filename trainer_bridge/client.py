"""Python client of the rollout bridge (httpx, sync and async).

>>> client = RolloutClient("http://127.0.0.1:8100", api_key="...")
>>> for r in client.stream(["Hello"], {"max_tokens": 32, "temperature": 1.0}, n=4):
...     print(r.prompt_index, r.sample_index, len(r.token_ids), r.weight_version)

``stream`` yields each :class:`~foursight.trainer_bridge.protocol.Rollout` as soon as the bridge
sends it. A failed sample raises :class:`RolloutError` (after the stream's end event, so that the
error lists every failed sample), or, with ``raise_on_error=False``, is yielded as an
:class:`~foursight.trainer_bridge.protocol.ErrorEvent`. A stream that ends without its end event
raises :class:`RolloutStreamError`: nothing is ever silently short.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, AsyncIterator, Iterable, Iterator

import httpx

from foursight.trainer_bridge import connections
from foursight.trainer_bridge.protocol import (
    EndEvent,
    ErrorEvent,
    Prompt,
    Rollout,
    RolloutRequest,
    SamplingParams,
    parse_event,
)

PromptLike = str | list[int] | list[dict] | dict | Prompt


class BridgeHTTPError(RuntimeError):
    """The bridge answered with a non-200 status (message and status attached)."""

    def __init__(self, status: int, body: Any):
        self.status = status
        self.body = body
        msg = body.get("error") or body.get("detail") if isinstance(body, dict) else body
        super().__init__(f"HTTP {status}: {msg}")


class RolloutStreamError(RuntimeError):
    """The stream was cut before its end event (connection lost / bridge died)."""

    def __init__(self, message: str, received: int):
        self.received = received
        super().__init__(message)


class RolloutError(RuntimeError):
    """One or more samples failed; ``errors`` lists their :class:`ErrorEvent` and ``end`` the end event."""

    def __init__(self, errors: list[ErrorEvent], end: EndEvent | None):
        self.errors = errors
        self.end = end
        first = errors[0].error if errors else "?"
        super().__init__(f"{len(errors)} sample(s) failed (first: prompt {errors[0].prompt_index if errors else '?'}, "
                         f"sample {errors[0].sample_index if errors else '?'}: {first})")


def to_prompt(p: PromptLike) -> Prompt:
    """str -> text prompt; list[int] -> token ids; list[dict] -> chat messages; dict/Prompt as is."""
    if isinstance(p, Prompt):
        return p
    if isinstance(p, str):
        return Prompt(text=p)
    if isinstance(p, dict):
        return Prompt.model_validate(p)
    if isinstance(p, list) and (not p or isinstance(p[0], int)):
        return Prompt(token_ids=list(p))
    if isinstance(p, list) and isinstance(p[0], dict):
        return Prompt(messages=p)
    raise TypeError(f"cannot make a prompt from {type(p).__name__}")


def build_request(prompts: Iterable[PromptLike], params: SamplingParams | dict | None, n: int, **extra) -> dict[str, Any]:
    sp = params if isinstance(params, SamplingParams) else SamplingParams.model_validate(params or {})
    req = RolloutRequest(prompts=[to_prompt(p) for p in prompts], n=n, sampling=sp, **extra)
    return req.model_dump(exclude_none=True)


class EventTracker:
    """Shared event handling of the sync and async clients."""

    def __init__(self, raise_on_error: bool):
        self.raise_on_error = raise_on_error
        self.errors: list[ErrorEvent] = []
        self.end: EndEvent | None = None
        self.received = 0

    def handle(self, line: str):
        line = line.strip()
        if not line:
            return None
        if line.startswith("event:"):
            return None
        if line.startswith("data:"):
            line = line[5:].strip()
        ev = parse_event(json.loads(line))
        if isinstance(ev, EndEvent):
            self.end = ev
            return None
        self.received += 1
        if isinstance(ev, ErrorEvent):
            self.errors.append(ev)
            return None if self.raise_on_error else ev
        return Rollout.model_validate(ev.model_dump(exclude={"type"}))

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around the reading of one stream: a cut connection raises :class:`RolloutStreamError`;
        at its end, :meth:`finish`."""
        try:
            yield
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise RolloutStreamError(f"the rollout stream was cut after {self.received} sample event(s): {e}", self.received) from e
        self.finish()

    def finish(self) -> None:
        if self.end is None:
            raise RolloutStreamError(f"the rollout stream ended without its end event after {self.received} sample event(s)", self.received)
        if self.errors and self.raise_on_error:
            raise RolloutError(self.errors, self.end)
        if self.end.status != "ok" and not self.errors and self.raise_on_error:
            raise RolloutError([], self.end)


def _error_body(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _answer(r: httpx.Response) -> Any:
    """The JSON body of a 200 answer; any other status raises :class:`BridgeHTTPError`."""
    if r.status_code != 200:
        raise BridgeHTTPError(r.status_code, _error_body(r))
    return r.json()


def weight_update_body(version: int, path: str | None = None, shm_name: str | None = None, **extra) -> dict[str, Any]:
    """The ``POST /v1/weights`` body (:class:`~foursight.trainer_bridge.protocol.WeightUpdateRequest`):
    the new version and the file, as ``path`` or ``shm_name``."""
    body = {"version": version, **extra}
    if path is not None:
        body["path"] = str(path)
    if shm_name is not None:
        body["shm_name"] = shm_name
    return body


class RolloutClient:
    """Client of a FourSight rollout bridge. Use as a context manager or call :meth:`close`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout, connect=10.0)
        self._client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=self.timeout,
                                    transport=connections.transport())

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def stream(self, prompts: Iterable[PromptLike], params: SamplingParams | dict | None = None, n: int = 1,
               raise_on_error: bool = True, **extra) -> Iterator[Rollout | ErrorEvent]:
        """Yield each finished sample as a :class:`Rollout` (see the module doc for errors)."""
        body = build_request(prompts, params, n, **extra)
        tr = EventTracker(raise_on_error)
        with tr.reading(), self._client.stream("POST", "/v1/rollouts", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise BridgeHTTPError(r.status_code, _error_body(r))
            for line in r.iter_lines():
                if (out := tr.handle(line)) is not None:
                    yield out

    def generate(self, prompts: Iterable[PromptLike], params: SamplingParams | dict | None = None, n: int = 1, **extra) -> list[Rollout]:
        """All samples, sorted by (prompt_index, sample_index)."""
        out = list(self.stream(prompts, params, n, **extra))
        return sorted(out, key=lambda r: (r.prompt_index, r.sample_index))

    def update_weights(self, version: int, path: str | None = None, shm_name: str | None = None, **extra) -> dict[str, Any]:
        return _answer(self._client.post("/v1/weights", json=weight_update_body(version, path, shm_name, **extra)))

    def weight_version(self) -> int:
        return int(self._client.get("/v1/weights").json()["version"])

    def health(self) -> dict[str, Any]:
        return self._client.get("/v1/health").json()


class AsyncRolloutClient:
    """Async twin of :class:`RolloutClient`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None,
                 max_connections: int = 256):
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                         transport=connections.async_transport(max_connections))

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def stream(self, prompts: Iterable[PromptLike], params: SamplingParams | dict | None = None, n: int = 1,
                     raise_on_error: bool = True, **extra) -> AsyncIterator[Rollout | ErrorEvent]:
        body = build_request(prompts, params, n, **extra)
        tr = EventTracker(raise_on_error)
        with tr.reading():
            async with self._client.stream("POST", "/v1/rollouts", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise BridgeHTTPError(r.status_code, _error_body(r))
                async for line in r.aiter_lines():
                    if (out := tr.handle(line)) is not None:
                        yield out

    async def generate(self, prompts, params=None, n: int = 1, **extra) -> list[Rollout]:
        out = [r async for r in self.stream(prompts, params, n, **extra)]
        return sorted(out, key=lambda r: (r.prompt_index, r.sample_index))

    async def update_weights(self, version: int, path: str | None = None, shm_name: str | None = None, **extra) -> dict[str, Any]:
        return _answer(await self._client.post("/v1/weights", json=weight_update_body(version, path, shm_name, **extra)))
