"""What the engines reached over HTTP (vLLM, SGLang) share: the connection, health, context
length and the one flow of a sample (post the engine's request, check the status, parse its answer,
tag the rollout with the sampling parameters).

Connections retry a refused connect and expire keep-alives below the engine's
(:mod:`foursight.trainer_bridge.connections`); health and the context probe answer at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import httpx

from foursight.schema import CheckpointError, read_config
from foursight.trainer_bridge import connections
from foursight.trainer_bridge.backends.base import Engine, EngineError, LocalTokenizer
from foursight.trainer_bridge.protocol import Rollout, SamplingParams


def config_vocab_size(folder: str | Path | None) -> int | None:
    """``vocab_size`` of the ``config.json`` in a model folder (the usual ``--tokenizer``), else None."""
    if folder is None:
        return None
    try:
        n = read_config(folder).get("vocab_size")
    except CheckpointError:
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


def sampling_fields(params: SamplingParams, seed: int | None, seed_key: str) -> dict[str, Any]:
    """The sampling fields that vLLM's ``/v1/completions`` and SGLang's ``sampling_params`` name alike
    (optional ones only when set); the seed goes under ``seed_key``."""
    out: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                           "top_k": params.top_k if params.top_k > 0 else -1, "ignore_eos": params.ignore_eos}
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.min_p:
        out["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = params.repetition_penalty
    if seed is not None:
        out[seed_key] = seed
    return out


class HTTPEngine(Engine):
    """Shared connection handling of the engines reached over HTTP (vLLM, SGLang)."""

    def __init__(self, url: str, name_prefix: str, tokenizer: str | Path | None, api_key: str | None,
                 logprobs_mode: str, max_connections: int):
        self.url = url.rstrip("/")
        self.name = f"{name_prefix}@{self.url}"
        self.logprobs_mode = logprobs_mode
        self.tokenizer = LocalTokenizer(tokenizer) if tokenizer else None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self.client: httpx.AsyncClient | None = None
        self._vocab_size = config_vocab_size(tokenizer)

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    async def context_length(self) -> int | None:
        """``max_model_len`` of the server's ``GET /v1/models`` (vLLM and SGLang both report it),
        asked once; None when the server does not say (it then checks the length itself)."""
        if getattr(self, "_context", None) is None:
            try:
                r = await self._probe.get("/v1/models")
                n = r.json()["data"][0].get("max_model_len") if r.status_code == 200 else None
                self._context = int(n) if isinstance(n, int) and n > 0 else 0
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError):
                return None  # asked again next time
        return self._context or None

    async def start(self) -> None:
        # connect retries and a keep-alive expiry below the engine's (foursight.trainer_bridge.connections)
        self.client = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=httpx.Timeout(None, connect=10.0),
                                        transport=connections.async_transport(self._max_connections))
        # health answers at once: a dead engine is reported, not waited for through the retries
        self._probe = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=5.0, limits=connections.limits(4))

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            await self._probe.aclose()

    async def health(self) -> bool:
        try:
            r = await self._probe.get("/health")
            return r.status_code == 200
        except httpx.HTTPError:
            return False


    async def post_ok(self, route: str, body: dict[str, Any] | None = None, what: str | None = None) -> httpx.Response:
        """``POST route`` with ``body``; EngineError naming the engine and ``what`` (default: the route) unless 200."""
        r = await self.client.post(route, json=body or {})
        if r.status_code != 200:
            raise EngineError(f"{self.name}: {what or route} -> {r.status_code} {r.text[:300]}")
        return r

    async def sample(self, route: str, body: dict[str, Any], parse: Callable[..., Rollout], prompt_ids: list[int],
                     params: SamplingParams) -> Rollout:
        """One sample: ``POST route`` with the engine's request ``body``, its answer read by
        ``parse(data, name, prompt_ids)``, the rollout tagged with this engine's logprobs mode and ``params``."""
        out = parse((await self.post_ok(route, body)).json(), self.name, prompt_ids)
        return out.model_copy(update={"logprobs_mode": self.logprobs_mode, "temperature": params.temperature,
                                      "top_p": params.top_p, "top_k": params.top_k})
