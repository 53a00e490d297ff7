"""Server-sent events of an engine's streamed answer, read as JSON objects (:func:`events`).

vLLM's OpenAI ``/v1/completions`` and SGLang's ``/generate`` stream the same way when asked with
``stream: true``: ``data: <json>`` lines, then ``data: [DONE]``. The engine backends read both with
:func:`events` and turn each object into a :class:`~foursight.trainer_bridge.backends.base.Delta`.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import httpx

from foursight.trainer_bridge.backends.base import EngineError


async def events(client: httpx.AsyncClient, route: str, body: dict[str, Any], name: str) -> AsyncIterator[dict[str, Any]]:
    """``POST route`` with ``body`` and yield each ``data:`` object as it arrives, until ``[DONE]``.
    A status other than 200 or a line that is not JSON raises :class:`EngineError` naming the engine
    ``name`` and the route. Closing the iterator closes the connection (the engine aborts the request)."""
    async with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise EngineError(f"{name}: {route} -> {r.status_code} {text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                yield json.loads(data)
            except ValueError as e:
                raise EngineError(f"{name}: malformed {route} stream chunk ({e})") from None
