"""Engine backends: vLLM over HTTP, SGLang over HTTP, an HF model in process.

These are FourSight's only clients of the engines. Each backend

* **generates**: one (prompt token ids, sampling params) -> one :class:`~foursight.trainer_bridge.protocol.Rollout`
  with the log-prob of every sampled token;
* **scores**: teacher-forces given completion tokens after a prompt and returns their log-probs
  (vLLM ``prompt_logprobs``, SGLang ``input_token_logprobs``, HF
  :func:`~foursight.trainer_bridge.scoring.teacher_forced_logprobs`);
* reports its health and applies a versioned BF16 weight update.

The bridge (server.py), ``foursight compare`` and ``foursight rl`` use them. The bridge owns
scheduling, version tagging and error events; backends only raise :class:`EngineError` (or let
httpx/asyncio errors through, which the bridge reports the same way).

Numerics of a FourSight-quantized model live in :mod:`foursight.layer` / :mod:`foursight.hf`;
the HF backend re-quantizes through ``FourSightLinear.set_weight`` and never duplicates them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import httpx

from foursight.trainer_bridge import connections
from foursight.trainer_bridge.protocol import Prompt, Rollout, SamplingParams


#: how VLLMHTTPEngine sends a weight update: vLLM's /collective_rpc with the FourSight worker
#: extension (any vLLM version), or vLLM's native weight-transfer API with the foursight_file
#: backend (vLLM >= 0.32); both need VLLM_SERVER_DEV_MODE=1 in vLLM 0.32 (docs/vllm.md)
WEIGHT_SYNC_ROUTES = ("collective_rpc", "native")


class EngineError(RuntimeError):
    """An engine refused or failed a call; the message says which engine and why."""


class LocalTokenizer:
    """Prompt -> token ids with a local HF tokenizer (chat template applied for ``messages``)."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self._lock = threading.Lock()  # HF fast tokenizers are not safe across threads

    def encode(self, prompt: Prompt) -> list[int]:
        with self._lock:
            if prompt.token_ids is not None:
                return list(prompt.token_ids)
            if prompt.text is not None:
                return list(self.tok.encode(prompt.text, add_special_tokens=True))
            msgs = [m.model_dump() for m in prompt.messages or []]
            out = self.tok.apply_chat_template(msgs, add_generation_prompt=prompt.add_generation_prompt, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(t) for t in out]

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        if self.tok.eos_token_id is not None:
            ids.add(int(self.tok.eos_token_id))
        return ids


def _config_vocab_size(folder: str | Path | None) -> int | None:
    """``vocab_size`` of the ``config.json`` in a model folder (the usual ``--tokenizer``), else None."""
    import json

    if folder is None:
        return None
    try:
        n = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


class Engine(ABC):
    """Abstract backend. ``name`` identifies the engine instance in events and metrics."""

    kind: str = "engine"
    name: str = "engine"
    #: what the engine's per-token logprobs are (see protocol.Rollout)
    logprobs_mode: str = "raw_logprobs"
    tokenizer: LocalTokenizer | None = None
    #: True when a failed ``update_weights`` leaves the previous weights untouched (checked before applied)
    atomic_updates: bool = False

    @property
    def vocab_size(self) -> int | None:
        """Size of the served model's vocabulary (token ids must be below it), None when unknown."""
        return None

    async def context_length(self) -> int | None:
        """The served model's context in tokens (a prompt plus its ``max_tokens`` must fit;
        ``guards.engine_field_errors``), None when unknown."""
        return None

    async def start(self) -> None:
        """Connect / load. Called once by the server at startup."""

    async def aclose(self) -> None:
        """Release connections."""

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Prompt -> token ids (local tokenizer by default)."""
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if self.tokenizer is None:
            raise EngineError(f"{self.name}: text/chat prompts need a tokenizer (pass --tokenizer or --model)")
        return await asyncio.to_thread(self.tokenizer.encode, prompt)

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                       request: str | None = None) -> Rollout:
        """Sample one continuation of ``prompt_ids`` with the sampled tokens' logprobs (the
        :class:`Rollout`'s bridge fields left at their defaults). ``request`` names the bridge
        request the sample belongs to: an engine that schedules in this process (the HF engine)
        shares its time between requests by it; engine servers schedule themselves and ignore it."""

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs (raw: log-softmax of the logits) of ``token_ids`` after ``prompt_ids``."""
        raise EngineError(f"{self.name}: this engine does not score teacher-forced")

    @abstractmethod
    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        """Load new BF16 weights (HF names, safetensors ``path``), re-quantize, return an ack dict with ``version``."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the engine answers."""

    async def served_state(self) -> dict[str, Any] | None:
        """What the engine itself reports it serves: ``{"boot_id": str, "version": int}`` (the boot
        id changes when the engine process restarts; the version is the one of its last weight
        update, 0 after a fresh start), or None when this engine cannot report it (then the bridge
        cannot detect a restart). Raises when the engine does not answer."""
        return None


# ---------------------------------------------------------------------------------------------
# vLLM (OpenAI-compatible server)
# ---------------------------------------------------------------------------------------------
class _HTTPEngine(Engine):
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
        self._vocab_size = _config_vocab_size(tokenizer)

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


class VLLMHTTPEngine(_HTTPEngine):
    """A vLLM OpenAI server: ``POST /v1/completions`` with token-id prompts and ``logprobs=0``.

    ``return_tokens_as_token_ids`` makes vLLM name each sampled token ``"token_id:<id>"``, so ids
    are exact (no detokenize/retokenize round trip). Weight updates go through vLLM's
    ``POST /collective_rpc`` (server started with ``VLLM_SERVER_DEV_MODE=1`` and the FourSight
    worker extension, see docs/vllm.md), then ``POST /reset_prefix_cache``.
    """

    kind = "vllm"

    def __init__(self, url: str, model: str | None = None, tokenizer: str | Path | None = None,
                 api_key: str | None = None, logprobs_mode: str = "raw_logprobs", max_connections: int = 512,
                 weight_sync: str = "collective_rpc"):
        super().__init__(url, "vllm", tokenizer, api_key, logprobs_mode, max_connections)
        if weight_sync not in WEIGHT_SYNC_ROUTES:
            raise EngineError(f"weight_sync must be one of {', '.join(WEIGHT_SYNC_ROUTES)}, got {weight_sync!r}")
        self.model = model
        self.weight_sync = weight_sync
        self._transfer_ready = False

    async def start(self) -> None:
        await super().start()
        if self.model is None:
            r = await self.client.get("/v1/models", timeout=30.0)
            if r.status_code != 200:
                raise EngineError(f"{self.name}: GET /v1/models -> {r.status_code} {r.text[:200]}")
            self.model = r.json()["data"][0]["id"]

    async def tokenize(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids is not None or self.tokenizer is not None:
            return await super().tokenize(prompt)
        body: dict[str, Any] = {"model": self.model}
        if prompt.text is not None:
            body["prompt"] = prompt.text
        else:
            body["messages"] = [m.model_dump() for m in prompt.messages or []]
            body["add_generation_prompt"] = prompt.add_generation_prompt
        r = await self.client.post("/tokenize", json=body)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /tokenize -> {r.status_code} {r.text[:200]}")
        return list(r.json()["tokens"])

    def completion_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
        """The exact ``/v1/completions`` body the bridge sends for one sample (tests reuse it)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "min_tokens": params.min_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "n": 1,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "ignore_eos": params.ignore_eos,
            "stream": False,
        }
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.stop:
            body["stop"] = list(params.stop)
        if params.min_p:
            body["min_p"] = params.min_p
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if seed is not None:
            body["seed"] = seed
        return body

    @staticmethod
    def parse_completion(data: dict[str, Any], name: str = "vllm", prompt_ids: list[int] | None = None) -> Rollout:
        """Sampled token ids and logprobs from a ``/v1/completions`` response (``logprobs=0``, token-id names)."""
        try:
            ch = data["choices"][0]
            lp = ch["logprobs"]
            ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
            vals = [float(v) for v in lp["token_logprobs"]]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{name}: malformed /v1/completions response ({type(e).__name__}: {e})") from None
        if len(ids) != len(vals):
            raise EngineError(f"{name}: {len(ids)} tokens but {len(vals)} logprobs")
        return Rollout(prompt_ids=list(prompt_ids or []), token_ids=ids, logprobs=vals, finish_reason=str(ch.get("finish_reason") or "unknown"))

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None) -> Rollout:
        r = await self.client.post("/v1/completions", json=self.completion_body(prompt_ids, params, max_tokens, seed))
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /v1/completions -> {r.status_code} {r.text[:300]}")
        out = self.parse_completion(r.json(), self.name, prompt_ids)
        return out.model_copy(update={"logprobs_mode": self.logprobs_mode, "temperature": params.temperature,
                                      "top_p": params.top_p, "top_k": params.top_k})

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """``prompt_logprobs`` of ``prompt_ids + token_ids`` (one generated token, discarded)."""
        full = list(prompt_ids) + list(token_ids)
        body = {"model": self.model, "prompt": full, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        r = await self.client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /v1/completions (prompt_logprobs) -> {r.status_code} {r.text[:300]}")
        try:
            plp = r.json()["choices"][0]["prompt_logprobs"]
            vals = []
            for t in range(len(prompt_ids), len(full)):
                entry, tok = plp[t], full[t]
                d = entry.get(str(tok)) or entry.get(tok)
                if d is None:
                    raise EngineError(f"{self.name}: prompt_logprobs lacks the scored token {tok} at position {t}")
                vals.append(float(d["logprob"] if isinstance(d, dict) else d))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"{self.name}: malformed prompt_logprobs response ({type(e).__name__}: {e})") from None
        return vals

    async def _post_ok(self, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
        r = await self.client.post(route, json=body or {})
        if r.status_code != 200:
            raise EngineError(f"{self.name}: {route} -> {r.status_code} {r.text[:300]}")
        return r

    async def _update_native(self, path: str, version: int) -> dict[str, Any]:
        """vLLM's native weight-transfer API with the ``foursight_file`` backend (vLLM >= 0.32)."""
        t0 = time.monotonic()
        if not self._transfer_ready:
            await self._post_ok("/init_weight_transfer_engine", {"init_info": {}})
            self._transfer_ready = True
        await self._post_ok("/start_weight_update")
        await self._post_ok("/update_weights", {"update_info": {"path": path}})
        await self._post_ok("/finish_weight_update", {"weight_version": str(version)})
        await self._post_ok("/reset_prefix_cache")
        r = await self.client.get("/weight_info")
        got = r.json().get("weight_version") if r.status_code == 200 else None
        if got != str(version):
            raise EngineError(f"{self.name}: after the update /weight_info reports version {got!r}, expected {str(version)!r}")
        return {"engine": self.name, "version": version, "route": "native", "seconds": time.monotonic() - t0}

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        if self.weight_sync == "native":
            return await self._update_native(path, version)
        t0 = time.monotonic()
        r = await self.client.post("/collective_rpc", json={"method": "foursight_update_weights", "args": [path, str(version)]})
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /collective_rpc foursight_update_weights -> {r.status_code} {r.text[:300]}")
        results = r.json().get("results", [])
        r2 = await self.client.post("/reset_prefix_cache")
        if r2.status_code != 200:
            raise EngineError(f"{self.name}: /reset_prefix_cache -> {r2.status_code} {r2.text[:200]}")
        r3 = await self.client.post("/collective_rpc", json={"method": "foursight_weight_version"})
        versions = [int(v) for v in r3.json().get("results", [])] if r3.status_code == 200 else []
        if not versions or any(v != version for v in versions):
            raise EngineError(f"{self.name}: after the update the workers report versions {versions}, expected {version}")
        return {"engine": self.name, "version": version, "route": "collective_rpc", "workers": results, "seconds": time.monotonic() - t0}

    async def _native_state(self) -> dict[str, Any]:
        """What an engine synced through vLLM's native weight-transfer API serves, from its ``GET /weight_info``:
        the version the bridge gave ``/finish_weight_update`` (vLLM starts at ``"default"``, read as 0, and comes
        back to it after a restart, which is how a restart is seen on this route: vLLM exposes no boot id)."""
        r = await self.client.get("/weight_info", timeout=10.0)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: GET /weight_info -> {r.status_code} {r.text[:200]}")
        got = r.json().get("weight_version")
        version = int(got) if isinstance(got, str) and got.isdigit() else 0
        return {"boot_id": "vllm-weight-info", "version": version}

    async def served_state(self) -> dict[str, Any] | None:
        """``foursight_engine_state`` of every worker (the FourSight worker extension): one boot id
        and one version for the engine. None when the server has no such RPC (no
        ``VLLM_SERVER_DEV_MODE`` or no extension: such an engine cannot take weight updates either), except on
        the native route (``weight_sync="native"``), whose engine reports its version through ``/weight_info``."""
        if self.weight_sync == "native":
            # never /collective_rpc here: vLLM 0.32's engine core dies when a worker lacks the method asked for,
            # and the native route needs no FourSight worker extension
            return await self._native_state()
        r = await self.client.post("/collective_rpc", json={"method": "foursight_engine_state"}, timeout=10.0)
        if r.status_code != 200:
            return None
        try:
            workers = [dict(w) for w in r.json().get("results", [])]
            boots = sorted({str(w["boot_id"]) for w in workers})
            versions = sorted({int(w["version"]) for w in workers})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise EngineError(f"{self.name}: malformed foursight_engine_state answer ({type(e).__name__}: {e})") from None
        if not workers:
            return None
        if len(versions) != 1:
            raise EngineError(f"{self.name}: the workers report different weight versions {versions}")
        return {"boot_id": ",".join(boots), "version": versions[0]}


# ---------------------------------------------------------------------------------------------
# SGLang (native /generate)
# ---------------------------------------------------------------------------------------------
class SGLangHTTPEngine(_HTTPEngine):
    """An SGLang server: ``POST /generate`` with ``input_ids`` and ``return_logprob``.

    ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, text|null], ...]``;
    ``meta_info.finish_reason`` is ``{"type": "stop"|"length"|"abort", ...}``. Weight updates use
    ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``, and the served
    version is read back from ``GET /get_model_info`` (:meth:`served_state`). Generation parsing is
    exercised against a recorded-format stand-in in the bridge tests, updates and the served version
    against a real SGLang CPU server in tests/sglang (docs/bridge.md).
    """

    kind = "sglang"

    def __init__(self, url: str, tokenizer: str | Path | None = None, api_key: str | None = None,
                 logprobs_mode: str = "processed_logprobs", max_connections: int = 512):
        super().__init__(url, "sglang", tokenizer, api_key, logprobs_mode, max_connections)

    def generate_body(self, prompt_ids, params: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": params.min_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "ignore_eos": params.ignore_eos,
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.stop:
            sp["stop"] = list(params.stop)
        if params.min_p:
            sp["min_p"] = params.min_p
        if params.repetition_penalty != 1.0:
            sp["repetition_penalty"] = params.repetition_penalty
        if seed is not None:
            sp["sampling_seed"] = seed
        return {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1}

    @staticmethod
    def parse_generate(data: dict[str, Any], name: str = "sglang", prompt_ids: list[int] | None = None) -> Rollout:
        try:
            meta = data["meta_info"]
            rows = meta["output_token_logprobs"]
            ids = [int(row[1]) for row in rows]
            vals = [float(row[0]) for row in rows]
            fr = meta.get("finish_reason")
            reason = fr.get("type") if isinstance(fr, dict) else str(fr)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{name}: malformed /generate response ({type(e).__name__}: {e})") from None
        if reason == "abort":
            raise EngineError(f"{name}: request aborted by the engine: {data['meta_info'].get('finish_reason')}")
        return Rollout(prompt_ids=list(prompt_ids or []), token_ids=ids, logprobs=vals, finish_reason=reason or "unknown")

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None) -> Rollout:
        r = await self.client.post("/generate", json=self.generate_body(prompt_ids, params, max_tokens, seed))
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /generate -> {r.status_code} {r.text[:300]}")
        out = self.parse_generate(r.json(), self.name, prompt_ids)
        return out.model_copy(update={"logprobs_mode": self.logprobs_mode, "temperature": params.temperature,
                                      "top_p": params.top_p, "top_k": params.top_k})

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """``input_token_logprobs`` of ``prompt_ids + token_ids`` from ``logprob_start_len=0``."""
        full = list(prompt_ids) + list(token_ids)
        body = {"input_ids": full, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}, "return_logprob": True,
                "logprob_start_len": 0}
        r = await self.client.post("/generate", json=body)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /generate (input_token_logprobs) -> {r.status_code} {r.text[:300]}")
        try:
            inp = r.json()["meta_info"]["input_token_logprobs"]
            return [float(inp[t][0]) for t in range(len(prompt_ids), len(full))]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{self.name}: malformed input_token_logprobs response ({type(e).__name__}: {e})") from None

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        t0 = time.monotonic()
        # SGLang's /update_weights_from_disk takes a *folder* of *.safetensors: wrap a single file
        # in a fresh folder (a symlink, no copy) so that nothing else beside it is loaded.
        model_path = Path(path)
        if model_path.is_file():
            import tempfile

            folder = Path(tempfile.mkdtemp(prefix="foursight-sglang-update-"))
            (folder / "model.safetensors").symlink_to(model_path.resolve())
            model_path = folder
        r = await self.client.post("/update_weights_from_disk", json={"model_path": str(model_path), "weight_version": str(version)})
        if r.status_code != 200 or not r.json().get("success", False):
            raise EngineError(f"{self.name}: /update_weights_from_disk -> {r.status_code} {r.text[:300]}")
        return {"engine": self.name, "version": version, "response": r.json(), "seconds": time.monotonic() - t0}

    async def served_state(self) -> dict[str, Any] | None:
        """The ``weight_version`` SGLang reports on ``GET /get_model_info``: the bridge sends its version
        with every update, and a restarted server is back at ``"default"`` (version 0), which is how
        the bridge sees the restart (SGLang exposes no boot id, so ``boot_id`` is constant). A
        server started with a non-numeric ``--weight-version`` cannot be tracked (None)."""
        r = await self.client.get("/get_model_info")
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /get_model_info -> {r.status_code} {r.text[:300]}")
        wv = r.json().get("weight_version")
        if wv in (None, "default"):
            return {"boot_id": "sglang", "version": 0}
        try:
            return {"boot_id": "sglang", "version": int(wv)}
        except (TypeError, ValueError):
            return None


# ---------------------------------------------------------------------------------------------
# In-process Hugging Face model (BF16, or a FourSight checkpoint through foursight.hf)
# ---------------------------------------------------------------------------------------------
def read_safetensors(path: str | Path) -> dict[str, Any]:
    """All tensors of a safetensors file, or of every ``*.safetensors`` file in a folder, each
    checked finite (:func:`foursight.schema.iter_safetensors`; EngineError names the file or tensor)."""
    from foursight.schema import CheckpointError, iter_safetensors

    try:
        return dict(iter_safetensors(path))
    except CheckpointError as e:
        raise EngineError(str(e)) from None


class _HFSample:
    """One sample of the HF engine's round-robin scheduler: its own KV cache and RNG."""

    def __init__(self, prompt_ids, params, max_tokens, seed, eos, cancel, decode=None, group: Any = None):
        import random

        import torch

        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params = params
        self.max_tokens = int(max_tokens)
        self.eos = eos
        self.cancel = cancel
        self.decode = decode  # token ids -> text, for stop strings
        # the scheduler's round-robin is over groups (bridge requests), then over a group's samples;
        # a sample without a request is a group of its own
        self.group = group if group is not None else ("sample", id(self))
        # a per-sample generator: the draws of one sample do not depend on the others
        self.gen = torch.Generator(device="cpu").manual_seed(int(seed) if seed is not None else random.getrandbits(63))
        self.cache: Any = None
        self.next_logits: Any = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.future: concurrent.futures.Future = concurrent.futures.Future()


def _settle(fut: Any, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete a sample's future unless its caller already cancelled it."""
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _hf_sample_step(model: Any, s: _HFSample, n_tokens: int) -> None:
    """Advance one sample by up to ``n_tokens`` tokens (the first call also runs the prefill) with
    the model's own forward and its KV cache (``past_key_values``); sets ``finish_reason`` when done.
    The same prompt, parameters and seed give the same tokens and logprobs however the sample's
    steps are interleaved with other samples'."""
    import torch
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    p = s.params
    if s.max_tokens <= 0:
        s.finish_reason = "length"
        return
    dev = next(model.parameters()).device
    if s.cache is None:
        out = model(input_ids=torch.tensor([s.prompt_ids], device=dev), use_cache=True)
        s.cache, s.next_logits = out.past_key_values, out.logits[:, -1, :]
    for _ in range(n_tokens):
        if s.cancel is not None and s.cancel.is_set():
            return
        raw = s.next_logits.float()
        scores = raw.clone()
        # transformers' own processors, in generate()'s order: repetition penalty over prompt and
        # completion, the min_tokens EOS mask, then temperature, top-k, top-p, min-p
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([s.prompt_ids + s.token_ids], device=scores.device)
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, scores)
        if len(s.token_ids) < p.min_tokens and s.eos:
            scores[:, sorted(s.eos)] = -float("inf")
        if p.temperature > 0:
            scores = TemperatureLogitsWarper(p.temperature)(None, scores)
            if p.top_k > 0:
                scores = TopKLogitsWarper(p.top_k)(None, scores)
            if p.top_p < 1.0:
                scores = TopPLogitsWarper(p.top_p)(None, scores)
            if p.min_p > 0:
                scores = MinPLogitsWarper(p.min_p)(None, scores)
            tok = int(torch.multinomial(torch.softmax(scores, -1).cpu(), 1, generator=s.gen)[0, 0])
        else:
            tok = int(scores.argmax(-1)[0])
        s.token_ids.append(tok)
        s.logprobs.append(float(torch.log_softmax(raw, -1)[0, tok]))
        if tok in s.eos:
            s.finish_reason = "stop"
            return
        if p.stop and s.decode is not None and any(x in s.decode(s.token_ids) for x in p.stop):
            s.finish_reason = "stop"  # the token that completes a stop string is kept (vLLM semantics)
            return
        if len(s.token_ids) >= s.max_tokens:
            s.finish_reason = "length"
            return
        out = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=s.cache, use_cache=True)
        s.cache, s.next_logits = out.past_key_values, out.logits[:, -1, :]


class HFEngine(Engine):
    """A Hugging Face causal LM in this process (CPU or CUDA); requests share it round-robin.

    One scheduler thread serves the active requests in turn and, within a request, its samples in
    turn, ``slice_tokens`` decode steps per turn, each sample with its own KV cache and seeded
    ``torch.Generator`` (:meth:`_run`): a request gets an equal share of the model whatever the
    others ask for (one with ``n=64`` long samples does not slow a one-sample request 64-fold),
    none is starved, and a sample's result does not depend on the others.

    Loads ``model_dir`` as BF16, or, when its ``config.json`` has a FourSight
    ``quantization_config``, as the FourSight reference model (:func:`foursight.hf.load_reference_model`).
    Logprobs are the raw ones (log-softmax of the unprocessed logits, ``raw_logprobs``).
    A weight update copies BF16 tensors in and re-quantizes FourSight layers via ``FourSightLinear.set_weight``.
    """

    kind = "hf"
    atomic_updates = True

    def __init__(self, model_dir: str | Path | None = None, model: Any = None, tokenizer: str | Path | None = None, device: str = "cpu",
                 slice_tokens: int = 4):
        if (model_dir is None) == (model is None):
            raise EngineError("HFEngine: give exactly one of model_dir, model")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.model = model
        self.device = device
        self.name = f"hf@{self.model_dir.name if self.model_dir else type(model).__name__}"
        tok = tokenizer or self.model_dir
        self.tokenizer = LocalTokenizer(tok) if tok else None
        self._lock = threading.Lock()  # the model: one forward (a scheduler turn, a score, an update) at a time
        self._cv = threading.Condition()
        #: active samples by group (bridge request), in round-robin order of the groups
        self._groups: dict[Any, collections.deque[_HFSample]] = {}
        self._current: _HFSample | None = None
        self._worker: threading.Thread | None = None
        #: tokens a sample generates per scheduler turn before the next active sample's turn
        self.slice_tokens = max(1, int(slice_tokens))
        self.logprobs_mode = "raw_logprobs"
        #: weight version of the last update applied in this process (0 after a load)
        self.version = 0
        self.boot_id = uuid.uuid4().hex

    def _load(self) -> None:
        import json

        import torch
        from transformers import AutoModelForCausalLM

        cfg = json.loads((self.model_dir / "config.json").read_text())
        qc = cfg.get("quantization_config") or {}
        if qc.get("quant_method") == "foursight":
            from foursight.hf import load_reference_model

            self.model = load_reference_model(self.model_dir, device=self.device)
            self.name = f"hf-foursight@{self.model_dir.name}"
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16).to(self.device).eval()
        # a (re)load serves the folder's weights: a new boot, version 0
        self.version, self.boot_id = 0, uuid.uuid4().hex

    async def start(self) -> None:
        if self.model is None:
            await asyncio.to_thread(self._load)

    def _eos_ids(self) -> set[int]:
        ids = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        e = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
        return ids

    def _push(self, s: _HFSample) -> None:
        """Queue ``s`` at the end of its group (a new group goes to the end of the rotation); under ``_cv``."""
        self._groups.setdefault(s.group, collections.deque()).append(s)

    def _pop(self) -> _HFSample:
        """The next turn: the first sample of the first group; the group moves to the end of the rotation. Under ``_cv``."""
        key = next(iter(self._groups))
        q = self._groups.pop(key)
        s = q.popleft()
        if q:
            self._groups[key] = q
        return s

    def _submit(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                cancel: threading.Event | None, request: str | None = None) -> _HFSample:
        eos = self._eos_ids() | set(params.stop_token_ids) if not params.ignore_eos else set(params.stop_token_ids)
        if params.stop and self.tokenizer is None:
            raise EngineError(f"{self.name}: stop strings need a tokenizer (pass --tokenizer or --model)")
        decode = self.tokenizer.tok.decode if self.tokenizer is not None else None
        s = _HFSample(prompt_ids, params, max_tokens, seed, eos, cancel, decode, group=request)
        with self._cv:
            self._push(s)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._run, name=f"{self.name}-scheduler", daemon=True)
                self._worker.start()
            self._cv.notify()
        return s

    @property
    def active_samples(self) -> int:
        """Samples submitted and not yet finished, failed or cancelled (the scheduler's queue)."""
        with self._cv:
            return sum(len(q) for q in self._groups.values()) + (self._current is not None)

    def active_progress(self) -> list[int]:
        """Tokens generated so far by each active sample (the one in its turn first, then the queue)."""
        with self._cv:
            queued = [x for q in self._groups.values() for x in q]
            return [len(s.token_ids) for s in ([self._current] if self._current is not None else []) + queued]

    def _run(self) -> None:
        """The scheduler: round-robin over the active requests and, within one, over its samples,
        ``slice_tokens`` tokens per turn.

        A sample takes its turn (prefill + first tokens, or the next slice) under the engine lock
        and goes back to the end of its request's queue, the request to the end of the rotation; a
        cancelled one is dropped before its next turn or at its next token. So a request waits at
        most one slice of each other active request per turn, and a short request does not wait
        for a long one to end."""
        import torch

        while True:
            with self._cv:
                while not self._groups:
                    self._cv.wait()
                s = self._current = self._pop()
            try:
                if s.future.cancelled() or (s.cancel is not None and s.cancel.is_set()):
                    _settle(s.future, exc=EngineError(f"{self.name}: cancelled after {len(s.token_ids)} tokens"))
                    continue
                try:
                    with self._lock, torch.no_grad():
                        _hf_sample_step(self.model, s, self.slice_tokens)
                except Exception as e:  # noqa: BLE001 - goes to the caller
                    _settle(s.future, exc=e if isinstance(e, EngineError) else EngineError(f"{self.name}: {type(e).__name__}: {e}"))
                    continue
                if s.future.cancelled() or (s.cancel is not None and s.cancel.is_set()):
                    _settle(s.future, exc=EngineError(f"{self.name}: cancelled after {len(s.token_ids)} tokens"))
                elif s.finish_reason is not None:
                    s.cache = s.next_logits = None
                    p = s.params
                    _settle(s.future, result=Rollout(prompt_ids=s.prompt_ids, token_ids=s.token_ids, logprobs=s.logprobs,
                                                finish_reason=s.finish_reason, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k))
                else:
                    with self._cv:  # back in the queue and no longer current in one step: never counted twice
                        self._push(s)
                        self._current = None
            finally:
                with self._cv:
                    self._current = None

    def generate_sync(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None,
                      cancel: threading.Event | None = None, request: str | None = None) -> Rollout:
        """Blocking generation through the round-robin scheduler (:meth:`_run`).

        ``cancel`` set (the caller went away or timed out) stops it at its next token, or before its
        next turn; it then raises :class:`EngineError`.
        """
        return self._submit(prompt_ids, params, max_tokens, seed, cancel, request).future.result()

    async def generate(self, prompt_ids, params, max_tokens, seed, request=None) -> Rollout:
        """The sample joins the scheduler's round-robin; when this call is cancelled (client
        disconnect, the bridge's per-sample timeout) the sample is dropped at its next token."""
        cancel = threading.Event()
        s = self._submit(prompt_ids, params, max_tokens, seed, cancel, request)
        try:
            return await asyncio.wrap_future(s.future)
        except asyncio.CancelledError:
            cancel.set()
            raise

    def score_sync(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        import torch

        from foursight.trainer_bridge.scoring import teacher_forced_logprobs

        with self._lock, torch.no_grad():
            lp, _ = teacher_forced_logprobs(self.model, [prompt_ids], [token_ids])
        return [float(v) for v in lp[0, : len(token_ids)]]

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        return await asyncio.to_thread(self.score_sync, prompt_ids, token_ids)

    def update_weights_sync(self, path: str, version: int) -> dict[str, Any]:
        """Load the BF16 tensors (HF names) of a safetensors file or folder (:meth:`load_tensors_sync`)."""
        return self.load_tensors_sync(read_safetensors(path), version)

    def load_tensors_sync(self, tensors: dict[str, Any], version: int) -> dict[str, Any]:
        """The one HF weight sync: copy tensors (HF names) into the model; a FourSight layer's
        ``weight`` is re-quantized with its channel set (``FourSightLinear.set_weight``), an FP8
        rowwise layer's by ``Fp8Linear.set_weight``. All are
        checked (name, shape, finiteness of every floating tensor) before any is applied."""
        import torch

        from foursight.fp8 import Fp8Linear
        from foursight.hf import FourSightLinear
        from foursight.schema import CheckpointError, check_finite

        t0 = time.monotonic()
        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        plan: list[tuple[str, Any, Any]] = []
        for name, t in tensors.items():
            if not t.is_floating_point():  # an int32 tensor would be applied truncated (issue 28)
                raise EngineError(f"tensor {name} has dtype {t.dtype}, expected a floating-point weight")
            try:
                check_finite(name, t)
            except CheckpointError as e:
                raise EngineError(str(e)) from None
            prefix, _, leaf = name.rpartition(".")
            mod = modules.get(prefix)
            if isinstance(mod, (FourSightLinear, Fp8Linear)) and leaf == "weight":
                if tuple(t.shape) != (mod.out_features, mod.in_features):
                    raise EngineError(f"tensor {name} has shape {list(t.shape)}, expected {[mod.out_features, mod.in_features]}")
                plan.append(("requant", mod, t))
            elif name in params or name in buffers:
                dst = params.get(name, buffers.get(name))
                if tuple(dst.shape) != tuple(t.shape):
                    raise EngineError(f"tensor {name} has shape {list(t.shape)}, expected {list(dst.shape)}")
                plan.append(("copy", dst, t))
            else:
                raise EngineError(f"tensor {name} does not match any parameter of the model")
        with self._lock, torch.no_grad():
            n_req = 0
            for op, dst, t in plan:
                if op == "requant":
                    dst.set_weight(t.to(torch.bfloat16))
                    n_req += 1
                else:
                    dst.copy_(t.to(dst.dtype))
            self.version = int(version)
        return {"engine": self.name, "version": version, "updated_tensors": len(plan), "requantized_layers": n_req, "seconds": time.monotonic() - t0}

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.update_weights_sync, path, version)

    async def health(self) -> bool:
        return self.model is not None

    @property
    def vocab_size(self) -> int | None:
        n = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return int(n) if n else None

    async def context_length(self) -> int | None:
        """The model's ``max_position_embeddings`` (its positions end there)."""
        n = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(n) if n else None

    async def served_state(self) -> dict[str, Any] | None:
        return {"boot_id": self.boot_id, "version": self.version} if self.model is not None else None


def hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int = -1, min_new_tokens: int = 0, eos_ids: list[int] | tuple[int, ...] = (), seed: int | None = None,
                cancel: threading.Event | None = None, min_p: float = 0.0, repetition_penalty: float = 1.0,
                stop: list[str] | tuple[str, ...] = (), tokenizer: Any = None) -> list[Rollout]:
    """FourSight's one HF generation: a left-padded batch of prompts, ``temperature=0`` greedy.

    Each :class:`Rollout` holds the raw log-prob (log-softmax of the unprocessed logits, before
    any logits processor: temperature, top-p/k, ``min_p``, ``repetition_penalty``) of every
    sampled token; a completion ends at its first token in ``eos_ids`` (``finish_reason`` "stop"),
    with the token that completes one of the ``stop`` strings (decoded with ``tokenizer``; "stop"),
    or after ``max_new_tokens`` ("length"). When ``cancel`` is set, generation stops after the
    current token (a stopping criterion checked every step).
    """
    import torch

    p0 = next(model.parameters(), None)
    dev = p0.device if p0 is not None else next(model.buffers()).device
    eos = list(eos_ids)
    pad = eos[0] if eos else 0
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    att = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(list(p))
        att[b, L - len(p):] = 1
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None, do_sample=temperature > 0,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=eos or None, pad_token_id=pad)
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0, min_p=min_p or None)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    if cancel is not None:
        from transformers import StoppingCriteria, StoppingCriteriaList

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device)

        kw["stopping_criteria"] = StoppingCriteriaList([_Cancelled()])
    if repetition_penalty != 1.0:
        kw["repetition_penalty"] = repetition_penalty
    if stop:
        if tokenizer is None:
            raise ValueError("hf_generate: stop strings need a tokenizer")
        kw.update(stop_strings=list(stop), tokenizer=tokenizer)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids.to(dev), attention_mask=att.to(dev), **kw)
    new = out.sequences[:, L:]
    logits = torch.stack(out.logits, 1).float()  # [B, T, V] raw logits
    lp = torch.log_softmax(logits, -1).gather(-1, new[:, : logits.shape[1], None])[..., 0].cpu()
    new = new.cpu()
    eos_set = set(eos)
    res = []
    for b, p in enumerate(prompts):
        toks = new[b].tolist()
        reason, n = "length", len(toks)
        for i, t in enumerate(toks):  # HF pads finished sequences: a completion stops at its first EOS
            if t in eos_set:
                n, reason = i + 1, "stop"
                break
        if stop:  # or with the token that completes a stop string (HF pads after it too)
            for i in range(n):
                if any(s in tokenizer.decode(toks[: i + 1]) for s in stop):
                    n, reason = i + 1, "stop"
                    break
        res.append(Rollout(prompt_ids=[int(t) for t in p], token_ids=[int(t) for t in toks[:n]],
                           logprobs=[float(v) for v in lp[b, :n]], finish_reason=reason))
    return res


def shm_path(name: str) -> str:
    """Path of a shared-memory weights file (``/dev/shm/<name>``)."""
    base = os.environ.get("FOURSIGHT_SHM_DIR", "/dev/shm")
    return str(Path(base) / name)
