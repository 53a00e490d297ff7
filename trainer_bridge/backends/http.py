"""What the engines reached over HTTP (vLLM, SGLang) share: the connection, health, context
length, the served model's name, the one flow of a sample (post the engine's request, check the
status, parse its answer, tag the rollout with the sampling parameters), and the token stream of an
OpenAI-shaped ``/v1/completions`` (:meth:`HTTPEngine.generate_stream`: server-sent events with
token-id names, read as :class:`~.base.Delta` pieces as the engine sends them; closing the stream
closes the connection, and the engine aborts the request).

Connections retry a refused connect and expire keep-alives below the engine's
(:mod:`foursight.trainer_bridge.connections`); health and the context probe answer at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx

from foursight.schema import CheckpointError, read_config
from foursight.trainer_bridge import connections, sse
from foursight.trainer_bridge.backends.base import Delta, Engine, EngineError, LocalTokenizer
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
    if params.presence_penalty:
        out["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        out["frequency_penalty"] = params.frequency_penalty
    if params.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in params.logit_bias.items()}  # JSON keys: vLLM and SGLang read them back as ids
    if seed is not None:
        out[seed_key] = seed
    return out


def _token_id(name: str) -> int:
    """A token named ``"token_id:<id>"`` (``return_tokens_as_token_ids``) -> its id."""
    return int(name.split(":", 1)[1])


def _alternatives(entry: dict[str, Any]) -> list[tuple[int, float]]:
    """One position's ``{"token_id:<id>": logprob}`` of a completion's ``top_logprobs``, in the engine's order."""
    return [(_token_id(k), float(v)) for k, v in entry.items()]


def _prompt_alternatives(entry: dict[str, Any] | None) -> list[tuple[int, float]] | None:
    """One position of vLLM's ``prompt_logprobs`` (``{"<id>": {"logprob": ...}}``, the prompt token first)."""
    if entry is None:
        return None
    return [(int(k), float(v["logprob"] if isinstance(v, dict) else v)) for k, v in entry.items()]


def parse_completion_chunk(data: dict[str, Any], name: str, first: bool) -> Delta:
    """One server-sent chunk of a streamed ``/v1/completions`` (one choice, ``logprobs`` set,
    ``return_tokens_as_token_ids``) -> its :class:`Delta`. An ``{"error": ...}`` chunk (the engine
    failed mid-stream) raises :class:`EngineError`."""
    if "error" in data:
        err = data["error"]
        raise EngineError(f"{name}: the engine ended the stream with an error: {err.get('message', err) if isinstance(err, dict) else err}")
    try:
        (ch,) = data["choices"]
        lp = ch.get("logprobs") or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        ids = [_token_id(t) for t in lp["tokens"]]
        vals = [float(v) for v in lp["token_logprobs"]]
        top = [_alternatives(e or {}) for e in (lp.get("top_logprobs") or [])]
        prompt = [_prompt_alternatives(e) for e in ch["prompt_logprobs"]] if first and ch.get("prompt_logprobs") else None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise EngineError(f"{name}: malformed /v1/completions stream chunk ({type(e).__name__}: {e})") from None
    if len(ids) != len(vals):
        raise EngineError(f"{name}: {len(ids)} tokens but {len(vals)} logprobs in a stream chunk")
    return Delta(token_ids=ids, logprobs=vals, top_logprobs=top if len(top) == len(ids) else None, prompt_logprobs=prompt,
                 finish_reason=ch.get("finish_reason"))


class HTTPEngine(Engine):
    """Shared connection handling of the engines reached over HTTP (vLLM, SGLang)."""

    #: :meth:`generate_stream` reads OpenAI-shaped ``/v1/completions`` streams with top alternatives
    returns_top_logprobs = True
    #: vLLM's ``/v1/completions`` and SGLang's ``/generate`` take the penalties, ``logit_bias`` and
    #: structured output (``response_format``; SGLang's ``json_schema``)
    sampling_extras = frozenset({"presence_penalty", "frequency_penalty", "logit_bias", "response_format"})

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
        self._served: str | None = None

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    async def context_length(self) -> int | None:
        """``max_model_len`` of the server's ``GET /v1/models`` (vLLM and SGLang both report it),
        asked once; None when the server does not say (it then checks the length itself)."""
        if getattr(self, "_context", None) is None:
            try:
                r = await self._probe.get("/v1/models")
                if r.status_code == 200 and isinstance(r.json()["data"][0].get("id"), str):
                    self._served = r.json()["data"][0]["id"]
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

    def served_model(self) -> str:
        """The name the engine server serves (vLLM's ``--served-model-name``, by default its ``--model``),
        as its ``GET /v1/models`` lists it (read at start or with the context length)."""
        return getattr(self, "model", None) or self._served or self.name

    def completion_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
        """The engine's ``/v1/completions`` body for one sample (the vLLM backend's; see :meth:`generate_stream`)."""
        raise EngineError(f"{self.name}: this engine has no /v1/completions body")

    async def generate_stream(self, prompt_ids, params, max_tokens, seed, request=None) -> AsyncIterator[Delta]:
        """One sample through the engine's OpenAI-shaped ``POST /v1/completions`` with ``stream: true``:
        :meth:`completion_body` with ``logprobs`` = ``params.logprobs`` (the sampled token's logprob and
        that many alternatives), ``prompt_logprobs`` when asked, and token-id names, so ids are exact.
        Each server-sent chunk is yielded as it arrives. Closing this iterator (the client left, the
        per-sample timeout) closes the connection, and the engine aborts the request."""
        body = {**self.completion_body(prompt_ids, params, max_tokens, seed), "stream": True, "logprobs": params.logprobs,
                "return_tokens_as_token_ids": True}
        body.pop("stream_options", None)
        prompt = None
        if params.prompt_logprobs is not None:
            # vLLM computes prompt logprobs only without streaming: one more (prefix-cached) request, 1 token
            only = {**body, "stream": False, "max_tokens": 1, "min_tokens": 0, "logprobs": None, "prompt_logprobs": params.prompt_logprobs}
            r = await self.post_ok("/v1/completions", only, "/v1/completions (prompt_logprobs)")
            try:
                prompt = [_prompt_alternatives(e) for e in r.json()["choices"][0]["prompt_logprobs"]]
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                raise EngineError(f"{self.name}: malformed prompt_logprobs response ({type(e).__name__}: {e})") from None
        first = True
        finished = False
        async with contextlib.aclosing(sse.events(self.client, "/v1/completions", body, self.name)) as chunks:
            async for chunk in chunks:
                d = parse_completion_chunk(chunk, self.name, first)
                if first and prompt is not None:
                    d.prompt_logprobs = prompt
                first = False
                finished = d.finish_reason is not None
                yield d
        if not finished:
            raise EngineError(f"{self.name}: the /v1/completions stream ended before the sample finished")

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
