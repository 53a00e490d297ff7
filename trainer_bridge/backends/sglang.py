"""The SGLang backend: an SGLang server reached over HTTP (:class:`SGLangHTTPEngine`)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, AsyncIterator

from foursight.trainer_bridge import sse
from foursight.trainer_bridge.backends.base import Delta, EngineError, UpdateRefused
from foursight.trainer_bridge.backends.http import HTTPEngine, sampling_fields
from foursight.trainer_bridge.protocol import Rollout, SamplingParams


class SGLangHTTPEngine(HTTPEngine):
    """An SGLang server: ``POST /generate`` with ``input_ids`` and ``return_logprob``.

    ``meta_info.output_token_logprobs`` is ``[[logprob, token_id, text|null], ...]``;
    ``meta_info.finish_reason`` is ``{"type": "stop"|"length"|"abort", ...}``. Weight updates use
    ``POST /update_weights_from_disk`` with ``model_path`` and ``weight_version``, and the served
    version is read back from ``GET /get_model_info`` (:meth:`served_state`). Generation parsing is
    exercised against a recorded-format stand-in in the bridge tests, updates and the served version
    against a real SGLang CPU server in tests/sglang (docs/bridge.md).

    :meth:`generate_stream` streams token by token through ``/generate`` with ``stream: true``, with
    each token's top alternatives (``top_logprobs_num``: ``meta_info.output_top_logprobs``) and the
    prompt's logprobs (``logprob_start_len: 0``: ``input_token_logprobs`` / ``input_top_logprobs``)
    when asked, as SGLang's own OpenAI server asks for them; docs/openai.md.
    """

    kind = "sglang"

    def __init__(self, url: str, tokenizer: str | Path | None = None, api_key: str | None = None,
                 logprobs_mode: str = "processed_logprobs", max_connections: int = 512):
        super().__init__(url, "sglang", tokenizer, api_key, logprobs_mode, max_connections)

    def generate_body(self, prompt_ids, params: SamplingParams, max_tokens: int, seed: int | None) -> dict[str, Any]:
        sp = {"max_new_tokens": max_tokens, "min_new_tokens": params.min_tokens, **sampling_fields(params, seed, "sampling_seed")}
        rf = params.response_format
        if rf is not None and rf.type != "text":  # as SGLang's own OpenAI server turns response_format into json_schema
            sp["json_schema"] = json.dumps(rf.json_schema["schema"]) if rf.type == "json_schema" else '{"type": "object"}'
        body = {"input_ids": list(prompt_ids), "sampling_params": sp, "return_logprob": True,
                "logprob_start_len": 0 if params.prompt_logprobs is not None else -1}
        top = max(params.logprobs, params.prompt_logprobs or 0)
        if top:
            body["top_logprobs_num"] = top
        return body

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
        return await self.sample("/generate", self.generate_body(prompt_ids, params, max_tokens, seed),
                                 self.parse_generate, prompt_ids, params)

    async def generate_stream(self, prompt_ids, params, max_tokens, seed, request=None) -> AsyncIterator[Delta]:
        """One sample through ``POST /generate`` with ``stream: true``: a :class:`~.base.Delta` for each
        server-sent chunk, as SGLang sends them. A chunk carries the sample so far (``output_ids``
        and ``meta_info.output_token_logprobs`` cumulative) or, on a server started with
        ``--incremental-streaming-output``, only its new part; ``meta_info.completion_tokens`` counts
        the sample's tokens either way, so the new tokens are the last ones of the chunk. Closing
        this iterator closes the connection, and SGLang aborts the request."""
        body = {**self.generate_body(prompt_ids, params, max_tokens, seed), "stream": True}
        seen = 0
        finished = False
        async with contextlib.aclosing(sse.events(self.client, "/generate", body, self.name)) as chunks:
            async for chunk in chunks:
                d = self.parse_stream_chunk(chunk, seen, self.name, top=params.logprobs if params.logprobs else None,
                                            prompt=params.prompt_logprobs if seen == 0 else None)
                seen += len(d.token_ids)
                finished = d.finish_reason is not None
                yield d
                if finished:
                    break
        if not finished:
            raise EngineError(f"{self.name}: the /generate stream ended before the sample finished")

    @staticmethod
    def parse_stream_chunk(data: dict[str, Any], seen: int, name: str = "sglang", top: int | None = None,
                           prompt: int | None = None) -> Delta:
        """One server-sent chunk of a streamed ``/generate`` -> the :class:`~.base.Delta` of the tokens
        after the first ``seen``: with ``top`` k, each token's alternatives (the token itself first,
        then SGLang's k most likely others, as vLLM orders them); with ``prompt`` k, the prompt's
        logprobs with k alternatives each (``None`` for its first token). An ``{"error": ...}``
        chunk or an aborted sample raises :class:`EngineError`."""
        if "error" in data:
            err = data["error"]
            raise EngineError(f"{name}: the engine ended the stream with an error: {err.get('message', err) if isinstance(err, dict) else err}")
        try:
            meta = data["meta_info"]
            new = int(meta["completion_tokens"]) - seen
            rows = meta["output_token_logprobs"][len(meta["output_token_logprobs"]) - new:] if new > 0 else []
            ids = [int(row[1]) for row in rows]
            vals = [float(row[0]) for row in rows]
            fr = meta.get("finish_reason")
            alts = None
            if top is not None:
                tops = meta["output_top_logprobs"]
                tops = tops[len(tops) - new:] if new > 0 else []
                alts = [_alternatives(t, v, row, top) for t, v, row in zip(ids, vals, tops, strict=True)]
            prompt_lp = None
            if prompt is not None:
                inp, inp_top = meta["input_token_logprobs"], meta.get("input_top_logprobs") or [None] * len(meta["input_token_logprobs"])
                prompt_lp = [None] + [_alternatives(int(r[1]), float(r[0]), t or [], prompt) for r, t in zip(inp[1:], inp_top[1:], strict=True)]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"{name}: malformed /generate stream chunk ({type(e).__name__}: {e})") from None
        if len(ids) != max(new, 0):
            raise EngineError(f"{name}: a /generate stream chunk counts {new} new tokens but carries logprobs for {len(ids)}")
        reason = (fr.get("type") if isinstance(fr, dict) else str(fr)) if fr is not None else None
        if reason == "abort":
            raise EngineError(f"{name}: request aborted by the engine: {fr}")
        return Delta(token_ids=ids, logprobs=vals, top_logprobs=alts, prompt_logprobs=prompt_lp, finish_reason=reason)

    async def score(self, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
        """``input_token_logprobs`` of ``prompt_ids + token_ids`` from ``logprob_start_len=0``."""
        full = list(prompt_ids) + list(token_ids)
        body = {"input_ids": full, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}, "return_logprob": True,
                "logprob_start_len": 0}
        r = await self.post_ok("/generate", body, "/generate (input_token_logprobs)")
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
            from foursight.schema import REFUSED_PREFIX

            refused = r.status_code == 200 and str(r.json().get("message", "")).startswith(REFUSED_PREFIX)
            raise (UpdateRefused if refused else EngineError)(f"{self.name}: /update_weights_from_disk -> {r.status_code} {r.text[:300]}")
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


def _alternatives(token: int, logprob: float, top_rows: list, k: int) -> list[tuple[int, float]]:
    """One position's alternatives as the bridge keeps them (vLLM's order): the token itself first,
    then the first ``k`` of SGLang's ``[[logprob, token id, text], ...]`` (most likely first) but it."""
    return [(token, logprob)] + [(int(r[1]), float(r[0])) for r in top_rows[:k] if int(r[1]) != token]


def launch_server(model_dir: str | Path, *, log_path: Path, extra_args: list[str], max_model_len: int, python: str | None = None):
    """Start an SGLang CPU server for ``model_dir`` with the SGLang venv's ``python`` (``foursight compare``
    without ``--engine-url``); returns it started (its ``url``; ``stop()`` it). ``max_model_len`` is unused."""
    from foursight.trainer_bridge.launch import SGLangServer

    if not python or not Path(python).exists():
        raise FileNotFoundError(f"--sglang-python {python} does not exist (run scripts/setup.sh, or pass --engine-url)")
    return SGLangServer(model_dir, python, log_path=log_path, extra_args=extra_args).start(timeout_s=300)
