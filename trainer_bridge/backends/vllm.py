"""The vLLM backend: a vLLM OpenAI server reached over HTTP (:class:`VLLMHTTPEngine`).

Samples are ``POST /v1/completions`` with token-id prompts, scores ``prompt_logprobs``; weight
updates go through the FourSight worker extension (``/collective_rpc``) or vLLM's native
weight-transfer API (docs/vllm.md). Every update carries the engine's ``FOURSIGHT_WEIGHTS_TOKEN``
and a new weights id, which the engine reports back (:mod:`foursight.quant_methods.weight_authority`);
an update the engine refuses before loading any of it is :class:`~.base.UpdateRefused` (the bridge
answers 422 and the engine stays in sync). vLLM in this process (``foursight rl``) is
:mod:`foursight.trainer_bridge.backends.vllm_inprocess`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from foursight.schema import ENV_WEIGHTS_TOKEN, REFUSED_PREFIX, WEIGHTS_TOKEN_HEADER
from foursight.trainer_bridge.backends.base import EngineError, UpdateRefused
from foursight.trainer_bridge.backends.http import HTTPEngine, sampling_fields
from foursight.trainer_bridge.protocol import Prompt, Rollout, SamplingParams

#: how VLLMHTTPEngine sends a weight update: vLLM's /collective_rpc with the FourSight worker
#: extension (any vLLM version), or vLLM's native weight-transfer API with the foursight_file
#: backend (vLLM >= 0.32); both need VLLM_SERVER_DEV_MODE=1 in vLLM 0.32 (docs/vllm.md)
WEIGHT_SYNC_ROUTES = ("collective_rpc", "native")


class _WeightsTokenHeader(httpx.Auth):
    """The engine's weights token in :data:`~foursight.schema.WEIGHTS_TOKEN_HEADER` on every call (read at each
    request): a ``foursight serve`` engine lets its dev routes (``/collective_rpc``, the weight-transfer routes,
    ``/reset_prefix_cache``) answer only with it (:class:`foursight.quant_methods.weight_authority.DevRoutesGuard`)."""

    def __init__(self, engine: "VLLMHTTPEngine"):
        self.engine = engine

    def auth_flow(self, request: httpx.Request):
        if self.engine.weights_token:
            request.headers[WEIGHTS_TOKEN_HEADER] = self.engine.weights_token
        yield request


class VLLMHTTPEngine(HTTPEngine):
    """A vLLM OpenAI server: ``POST /v1/completions`` with token-id prompts and ``logprobs=0``.

    ``return_tokens_as_token_ids`` makes vLLM name each sampled token ``"token_id:<id>"``, so ids
    are exact (no detokenize/retokenize round trip). Weight updates go through vLLM's
    ``POST /collective_rpc`` (server started with ``VLLM_SERVER_DEV_MODE=1`` and the FourSight
    worker extension, see docs/vllm.md), then ``POST /reset_prefix_cache``. ``weights_token`` is the
    engine's ``FOURSIGHT_WEIGHTS_TOKEN`` (default: this process's).
    """

    kind = "vllm"

    def __init__(self, url: str, model: str | None = None, tokenizer: str | Path | None = None,
                 api_key: str | None = None, logprobs_mode: str = "raw_logprobs", max_connections: int = 512,
                 weight_sync: str = "collective_rpc", weights_token: str | None = None):
        super().__init__(url, "vllm", tokenizer, api_key, logprobs_mode, max_connections)
        self.weights_token = weights_token if weights_token is not None else os.environ.get(ENV_WEIGHTS_TOKEN)
        if weight_sync not in WEIGHT_SYNC_ROUTES:
            raise EngineError(f"weight_sync must be one of {', '.join(WEIGHT_SYNC_ROUTES)}, got {weight_sync!r}")
        self.model = model
        self.weight_sync = weight_sync
        self._transfer_ready = False

    def startup_warnings(self) -> list[str]:
        if self.weights_token:
            return []
        return [f"no {ENV_WEIGHTS_TOKEN} in the environment: a vLLM engine served with VLLM_SERVER_DEV_MODE=1 refuses every weight "
                "update without it (docs/bridge.md, 'Who can reach the engine')"]

    async def start(self) -> None:
        await super().start()
        self.client.auth = _WeightsTokenHeader(self)
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
            body["messages"] = [m.template_dict() for m in prompt.messages or []]
            body["add_generation_prompt"] = prompt.add_generation_prompt
        return list((await self.post_ok("/tokenize", body)).json()["tokens"])

    def completion_body(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
        """The exact ``/v1/completions`` body the bridge sends for one sample (tests reuse it)."""
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "min_tokens": params.min_tokens,
                "n": 1, "logprobs": 0, "return_tokens_as_token_ids": True, "stream": False, **sampling_fields(params, seed, "seed")}
        if params.response_format is not None and params.response_format.type != "text":
            body["response_format"] = params.response_format.model_dump(exclude_none=True)
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
        return await self.sample("/v1/completions", self.completion_body(prompt_ids, params, max_tokens, seed),
                                 self.parse_completion, prompt_ids, params)

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """``prompt_logprobs`` of ``prompt_ids + token_ids`` (one generated token, discarded)."""
        full = list(prompt_ids) + list(token_ids)
        body = {"model": self.model, "prompt": full, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        r = await self.post_ok("/v1/completions", body, "/v1/completions (prompt_logprobs)")
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

    def _refusal(self, r: httpx.Response, what: str) -> EngineError:
        """The error of a failed weight-update call: :class:`UpdateRefused` when the engine says it
        refused the update before loading any of it (its answer carries ``schema.REFUSED_PREFIX``)."""
        return (UpdateRefused if REFUSED_PREFIX in r.text else EngineError)(f"{self.name}: {what} -> {r.status_code} {r.text[:400]}")

    async def _update_call(self, route: str, body: dict[str, Any], what: str | None = None) -> httpx.Response:
        r = await self.client.post(route, json=body)
        if r.status_code != 200:
            raise self._refusal(r, what or route)
        return r

    async def _update_native(self, path: str, version: int) -> dict[str, Any]:
        """vLLM's native weight-transfer API with the ``foursight_file`` backend (vLLM >= 0.32). The
        weights id rides in vLLM's weight version (``"<version>-<id>"``, read back from ``/weight_info``)."""
        t0 = time.monotonic()
        if not self._transfer_ready:
            await self.post_ok("/init_weight_transfer_engine", {"init_info": {}})
            self._transfer_ready = True
        await self.post_ok("/start_weight_update")
        await self._update_call("/update_weights", {"update_info": {"path": path, "token": self.weights_token}})
        return await self._native_finish(version, t0, "native")

    # ---- the broadcast road (TRL's NCCL group, passed through by the bridge: foursight.quant_methods.weight_broadcast) ----

    async def broadcast_workers(self) -> int | None:
        """The engine's workers (ranks in the trainer's group), or None when it cannot join one: on the native
        route, an engine whose weight-transfer backend is not ``foursight_nccl``; on ``collective_rpc``, one without
        the FourSight worker extension (its ``foursight_engine_state`` answers once per worker)."""
        from foursight.quant_methods.weight_broadcast import BACKEND

        if self.weight_sync == "native":
            r = await self.client.get("/server_info", params={"config_format": "json"}, timeout=60.0)
            cfg = r.json().get("vllm_config") if r.status_code == 200 else None
            backend = ((cfg or {}).get("weight_transfer_config") or {}).get("backend") if isinstance(cfg, dict) else None
            if backend != BACKEND:
                return None
            r = await self.client.get("/get_world_size", timeout=30.0)
            return int(r.json()["world_size"]) if r.status_code == 200 else None
        r = await self.client.post("/collective_rpc", json={"method": "foursight_engine_state"}, timeout=30.0)
        results = r.json().get("results") if r.status_code == 200 else None
        return len(results) if isinstance(results, list) and results else None

    async def _rpc(self, method: str, *args: str, **kwargs: str) -> list[Any]:
        r = await self.client.post("/collective_rpc", json={"method": method, "args": list(args), "kwargs": kwargs}, timeout=None)
        if r.status_code != 200:
            raise self._refusal(r, f"/collective_rpc {method}")
        return r.json().get("results", []) if r.content else []

    async def broadcast_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """Join the group (blocks until the trainer and every worker joined), with this engine's weights token."""
        if self.weight_sync == "native":
            r = await self.client.post("/init_weight_transfer_engine", json={"init_info": {**init_info, "token": self.weights_token}},
                                       timeout=None)
            if r.status_code != 200:
                raise self._refusal(r, "/init_weight_transfer_engine")
            return {"engine": self.name, "route": "native"}
        workers = await self._rpc("foursight_broadcast_init", json.dumps(init_info), token=self.weights_token or "")
        return {"engine": self.name, "route": "collective_rpc", "workers": workers}

    async def broadcast_start(self) -> None:
        if self.weight_sync == "native":
            await self._update_call("/start_weight_update", {})
        else:
            await self._rpc("foursight_broadcast_start")

    async def broadcast_receive(self, update_info: dict[str, Any]) -> dict[str, Any]:
        if self.weight_sync == "native":
            r = await self.client.post("/update_weights", json={"update_info": update_info}, timeout=None)
            if r.status_code != 200:
                raise self._refusal(r, "/update_weights")
            return {"engine": self.name}
        return {"engine": self.name, "workers": await self._rpc("foursight_broadcast_receive", json.dumps(update_info))}

    async def broadcast_finish(self, version: int) -> dict[str, Any]:
        """Apply the received update as ``version`` (re-quantizing), then check what the engine reports, as :meth:`update_weights` does."""
        t0 = time.monotonic()
        if self.weight_sync == "native":
            return await self._native_finish(version, t0, "broadcast-native")
        results = await self._rpc("foursight_broadcast_finish", str(version), weights_id=uuid.uuid4().hex)
        await self.post_ok("/reset_prefix_cache")
        await self._check_worker_versions(version)
        return {"engine": self.name, "version": version, "route": "broadcast-collective_rpc", "workers": results,
                "seconds": time.monotonic() - t0}

    async def broadcast_close(self) -> None:
        if self.weight_sync == "native":
            await self.client.post("/shutdown_weight_transfer_engine", json={}, timeout=60.0)
        else:
            await self._rpc("foursight_broadcast_close")

    async def _native_finish(self, version: int, t0: float, route: str) -> dict[str, Any]:
        """``/finish_weight_update`` with the version tag ``"<version>-<weights id>"``, the prefix cache reset, and the
        tag read back from ``/weight_info``."""
        tag = f"{version}-{uuid.uuid4().hex}"
        await self._update_call("/finish_weight_update", {"weight_version": tag})
        await self.post_ok("/reset_prefix_cache")
        r = await self.client.get("/weight_info")
        got = r.json().get("weight_version") if r.status_code == 200 else None
        if got != tag:
            raise EngineError(f"{self.name}: after the update /weight_info reports version {got!r}, expected {tag!r}")
        return {"engine": self.name, "version": version, "route": route, "seconds": time.monotonic() - t0}

    async def _check_worker_versions(self, version: int) -> None:
        r3 = await self.client.post("/collective_rpc", json={"method": "foursight_weight_version"})
        versions = [int(v) for v in r3.json().get("results", [])] if r3.status_code == 200 else []
        if not versions or any(v != version for v in versions):
            raise EngineError(f"{self.name}: after the update the workers report versions {versions}, expected {version}")

    async def update_weights(self, path: str, version: int) -> dict[str, Any]:
        if self.weight_sync == "native":
            return await self._update_native(path, version)
        t0 = time.monotonic()
        weights_id = uuid.uuid4().hex
        r = await self._update_call("/collective_rpc", {"method": "foursight_update_weights", "args": [path, str(version)],
                                                        "kwargs": {"token": self.weights_token or "", "weights_id": weights_id}},
                                    "/collective_rpc foursight_update_weights")
        results = r.json().get("results", [])
        await self.post_ok("/reset_prefix_cache")
        await self._check_worker_versions(version)
        return {"engine": self.name, "version": version, "route": "collective_rpc", "workers": results, "seconds": time.monotonic() - t0}

    async def check_updatable(self) -> None:
        """The server flags this bridge's ``weight_sync`` route needs, read from vLLM's ``GET /server_info`` (a dev
        route: ``VLLM_SERVER_DEV_MODE=1``): the FourSight worker extension (``collective_rpc``) or the
        ``foursight_file`` weight-transfer backend (``native``); and, where the engine guards its dev routes
        (``foursight serve``), that it takes this bridge's weights token. :class:`EngineError` naming the flag."""
        r = await self.client.get("/server_info", params={"config_format": "json"}, timeout=60.0)
        if r.status_code == 404:
            raise EngineError(f"{self.name}: no /server_info: start the engine with VLLM_SERVER_DEV_MODE=1 (vLLM mounts its "
                              "weight routes only in dev mode; docs/vllm.md)")
        if r.status_code != 200:
            raise EngineError(f"{self.name}: GET /server_info -> {r.status_code} {r.text[:200]}")
        cfg = r.json().get("vllm_config") or {}
        if self.weight_sync == "native":
            backend = ((cfg.get("weight_transfer_config") or {}) if isinstance(cfg, dict) else {}).get("backend")
            if backend not in ("foursight_file", "foursight_nccl"):
                raise EngineError(f"{self.name} has weight-transfer backend {backend!r}; --weight-sync native needs the engine "
                                  "started with --weight-transfer-config '{\"backend\": \"foursight_file\"}' (files) or "
                                  "'{\"backend\": \"foursight_nccl\"}' (TRL's broadcast group only)")
        else:
            ext = ((cfg.get("parallel_config") or {}) if isinstance(cfg, dict) else {}).get("worker_extension_cls") or ""
            if not str(ext).endswith("FourSightWorkerExtension"):
                raise EngineError(f"{self.name} has no FourSight worker extension; --weight-sync collective_rpc needs the engine "
                                  "started with --worker-extension-cls foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension")
        r = await self.client.post("/reset_prefix_cache", json={})  # a guarded dev route that changes no weights
        if r.status_code in (401, 403):
            raise EngineError(f"{self.name} refuses this bridge's {ENV_WEIGHTS_TOKEN} ({r.status_code}: {r.text[:200]}): give the "
                              "bridge the engine's token")

    async def _native_state(self) -> dict[str, Any]:
        """What an engine synced through vLLM's native weight-transfer API serves, from its ``GET /weight_info``:
        the ``"<version>-<weights id>"`` the bridge gave ``/finish_weight_update`` (vLLM starts at ``"default"``,
        read as version 0, and comes back to it after a restart, which is how a restart is seen on this route:
        vLLM exposes no boot id). Anything else (a version set by another caller) is version -1: stale."""
        r = await self.client.get("/weight_info", timeout=10.0)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: GET /weight_info -> {r.status_code} {r.text[:200]}")
        got = r.json().get("weight_version")
        if got in (None, "default"):
            return {"boot_id": "vllm-weight-info", "version": 0, "weights_id": None}
        head, _, wid = str(got).partition("-")
        if not head.isdigit() or not wid:
            return {"boot_id": "vllm-weight-info", "version": -1, "weights_id": str(got)}
        return {"boot_id": "vllm-weight-info", "version": int(head), "weights_id": wid}

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
        ids = sorted({str(w.get("weights_id")) for w in workers})
        return {"boot_id": ",".join(boots), "version": versions[0], "weights_id": None if ids == ["None"] else ",".join(ids)}


def launch_server(model_dir: str | Path, *, log_path: Path, extra_args: list[str], max_model_len: int, python: str | None = None):
    """Start a vLLM OpenAI server for ``model_dir`` in a child process (``foursight compare`` without
    ``--engine-url``); returns it started (its ``url``; ``stop()`` it). ``python`` is unused (vLLM runs in this venv)."""
    from foursight.trainer_bridge.launch import VLLMServer

    return VLLMServer(model_dir, max_model_len=max_model_len, extra_args=extra_args, log_path=log_path).start()
