"""The bridge's edge: who may call it, how much they may send, what it may be made to read.

* :func:`check_bind`: loopback unless ``allow_remote`` with an API key (``serve()`` and the CLI).
* :func:`add_guards`: ASGI middleware, outermost first: ``Host`` checked against the allowed hosts
  (Starlette's ``TrustedHostMiddleware``: a DNS-rebinding page sends its own host name), a
  cross-site ``Origin`` refused (403), the API key checked before any body byte is read (401),
  and a body size limit (413, from ``Content-Length`` or while a chunked body streams in); innermost,
  a write timeout (:class:`WriteTimeoutMiddleware`: a response whose client stops reading is
  dropped after ``write_timeout_s``, so a stalled stream cannot hold weight updates hostage); and a
  body that cannot be decoded (invalid UTF-8) gets the route's documented shape naming ``body``
  (422 on the bridge's routes, 400 in OpenAI's shape on the OpenAI ones), not FastAPI's bare 400.
* :class:`WeightsRoots`: an update ``path`` must resolve (symlinks and ``..`` followed) to a file or
  folder inside one of the operator's ``--weights-dir`` folders; anything else, existing or not,
  gets the same answer, so a caller learns nothing about the rest of the disk.
* :func:`engine_field_errors`: prompt and sampling fields checked against the served model
  (vocabulary size, ``min_tokens`` against each prompt's ``max_tokens``, the max_tokens cap, seeds
  within int64, each prompt plus its ``max_tokens`` within the model's context).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from foursight.trainer_bridge.protocol import DEFAULT_WRITE_TIMEOUT_S, INT64_MAX, RolloutRequest

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: default request body limit (a rollout request of 65536 token-id prompts fits)
DEFAULT_MAX_BODY_BYTES = 32 << 20
#: (method, path) that need no API key: health, metrics and the current version (read-only)
OPEN_ROUTES = {("GET", "/v1/health"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/weights"), ("HEAD", "/v1/health"),
               ("HEAD", "/health")}


class BindError(ValueError):
    """``serve()`` was asked to bind where it must not."""


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, allow_remote: bool, api_key: str | None) -> None:
    """Loopback only, unless ``allow_remote`` and an API key (raises :class:`BindError`)."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise BindError(f"host {host} is not loopback; pass allow_remote=True (--allow-remote) and an API key to expose the bridge")
    if not api_key:
        raise BindError("allow_remote needs an API key (--api-key or FOURSIGHT_BRIDGE_API_KEY)")


def allowed_hosts_for(bind_host: str, extra: Iterable[str] = ()) -> list[str]:
    """Host names a request may name: loopback, the bind address, and the operator's list.
    A wildcard bind (``0.0.0.0``, ``::``) without an operator list allows any host (the API key,
    required there by :func:`check_bind`, is then the guard)."""
    extra = [h for h in extra if h]
    if bind_host in ("0.0.0.0", "::", "") and not extra:
        return ["*"]
    hosts = ["127.0.0.1", "localhost", "::1", "[::1]", *extra]
    if bind_host not in ("0.0.0.0", "::", ""):
        hosts.append(bind_host)
    return list(dict.fromkeys(hosts))


def _host_allowed(host: str, allowed: Sequence[str]) -> bool:
    if "*" in allowed:
        return True
    for pattern in allowed:
        if host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


def _json(status: int, error: str, **extra) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, **extra})


class OriginMiddleware:
    """Refuse (403) a request whose ``Origin`` names a host outside the allowed ones: a web page of
    another site may send requests to a loopback bridge, but its browser always says where from."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str], on_reject: Callable[[str], None] = lambda kind: None):
        self.app, self.allowed, self.on_reject = app, list(allowed_hosts), on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = dict(scope["headers"]).get(b"origin")
            if origin is not None:
                host = urlsplit(origin.decode("latin-1")).hostname or ""
                if origin == b"null" or not _host_allowed(host, self.allowed) and not _host_allowed(f"[{host}]", self.allowed):
                    self.on_reject("origin")
                    await _json(403, f"cross-origin request refused: Origin {origin.decode('latin-1')!r} is not an allowed host")(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """The API key (``Authorization: Bearer KEY`` or ``X-API-Key``) on every route but the open ones,
    checked in constant time before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str | None, on_reject: Callable[[str], None] = lambda kind: None):
        self.app, self.key, self.on_reject = app, api_key, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get(b"x-api-key", b"").decode("latin-1")
        if not given or not secrets.compare_digest(given.encode(), self.key.encode()):
            self.on_reject("unauthorized")
            resp = JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                                content={"error": "missing or wrong API key (Authorization: Bearer KEY or X-API-Key)",
                                         "detail": "missing or wrong API key (Authorization: Bearer KEY or X-API-Key)"})
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: at once from ``Content-Length``, or as soon as a chunked
    body passes the limit (nothing beyond it is buffered)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[str], None] = lambda kind: None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    def _too_large(self) -> JSONResponse:
        self.on_reject("bad_request")
        return _json(413, f"request body larger than {self.max_bytes} bytes", limit_bytes=self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                await _json(400, "invalid Content-Length")(scope, receive, send)
                return
            if n > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        seen = 0
        rejected = False

        async def limited_receive():
            # past the limit: answer 413 ourselves and tell the app the client went away (the app
            # is still reading the body, so it has sent nothing; whatever it sends later is dropped)
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    rejected = True
                    await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            if not rejected:
                await send(msg)

        await self.app(scope, limited_receive, guarded_send)


class WriteTimeoutMiddleware:
    """Each ``send`` of a response may wait at most ``timeout_s`` for the client to take the bytes
    (the server's write buffer drains only as fast as the client reads). Past it the response is
    abandoned: the send raises ``TimeoutError`` inside the app (a rollout stream then closes its
    generator: its engine calls are cancelled and its hold on the version gate released), later
    sends are dropped, and the server closes the connection, as for a response the app left
    incomplete. ``timeout_s`` None reads :data:`DEFAULT_WRITE_TIMEOUT_S` at each request."""

    def __init__(self, app: ASGIApp, timeout_s: float | None = None, on_reject: Callable[[str], None] = lambda kind: None):
        self.app, self.timeout_s, self.on_reject = app, timeout_s, on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        import anyio

        limit = self.timeout_s if self.timeout_s is not None else DEFAULT_WRITE_TIMEOUT_S
        dropped = False

        async def timed_send(msg):
            nonlocal dropped
            if dropped:
                raise TimeoutError(f"response dropped: the client read nothing for {limit} s")
            try:
                with anyio.fail_after(limit):
                    await send(msg)
            except TimeoutError:
                dropped = True
                self.on_reject("write_timeout")
                raise TimeoutError(f"response dropped: the client read nothing for {limit} s") from None

        await self.app(scope, receive, timed_send)


#: what FastAPI answers (400) when a body cannot be decoded at all (e.g. invalid UTF-8)
_UNPARSABLE_BODY = "There was an error parsing the body"
#: the OpenAI routes, whose errors have the OpenAI shape
_OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


async def _unparsable_body(request, exc):
    """FastAPI's 400 for a body it cannot decode, in the documented 422 shape (naming ``body``)
    of the route (the bridge's, or the OpenAI one); every other HTTP error as FastAPI answers it."""
    from fastapi.exception_handlers import http_exception_handler

    if exc.status_code != 400 or exc.detail != _UNPARSABLE_BODY:
        return await http_exception_handler(request, exc)
    cause = exc.__cause__
    why = f"not decodable as JSON ({type(cause).__name__}: {cause})" if cause is not None else "not decodable as JSON"
    return invalid_request(request.url.path, [{"field": "body", "message": why}])


def openai_error(status: int, message: str, type_: str, param: str | None = None, **extra) -> JSONResponse:
    """An error answer in OpenAI's (and vLLM's) shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param, "code": status, **extra}})


def bad_request(fields: list[dict[str, str]]) -> JSONResponse:
    """The OpenAI routes' ``400`` naming every bad field (``param`` is the first, as vLLM names one;
    ``fields`` lists them all)."""
    msg = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return openai_error(400, f"invalid request: {msg}", "BadRequestError", fields[0]["field"] if fields else None, fields=fields)


def invalid_request(path: str, fields: list[dict[str, str]]) -> JSONResponse:
    """The documented answer to a request the route could not validate, in the route's shape: the
    bridge's 422 ``{"error": str, "fields"}`` or, on the OpenAI routes, vLLM's 400
    ``{"error": {"message", "type", "param", "code", "fields"}}`` (:func:`bad_request`)."""
    if path in _OPENAI_PATHS:
        return bad_request(fields)
    msg = "invalid request: " + "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return JSONResponse(status_code=422, content={"error": msg, "fields": fields})


def add_guards(app, *, api_key: str | None, allowed_hosts: Sequence[str], max_body_bytes: int,
               on_reject: Callable[[str], None], write_timeout_s: float | None = None) -> None:
    """Install the edge middleware on a FastAPI/Starlette app (added last = runs first) and the
    undecodable-body handler."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app.add_exception_handler(StarletteHTTPException, _unparsable_body)
    app.add_middleware(WriteTimeoutMiddleware, timeout_s=write_timeout_s, on_reject=on_reject)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_reject=on_reject)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, on_reject=on_reject)
    app.add_middleware(OriginMiddleware, allowed_hosts=allowed_hosts, on_reject=on_reject)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))


class WeightsRoots:
    """The folders a weight update may be read from (``--weights-dir``, repeatable).

    ``None`` roots means no confinement (the library default, kept for in-process use; the CLI
    warns). Shared memory (``shm_name``) is always confined to ``$FOURSIGHT_SHM_DIR``
    (``/dev/shm``) by the name's pattern.
    """

    NOT_ALLOWED = "not an allowed weights file or folder (it does not exist, cannot be read, or lies outside the weights folders)"

    def __init__(self, roots: Sequence[str | Path] | None):
        self.roots = None if roots is None else [Path(r).resolve() for r in roots]
        for r in self.roots or []:
            if not r.is_dir():
                raise ValueError(f"weights folder {r} is not a folder")

    def resolve(self, path: str) -> Path | None:
        """The resolved file or folder, or None when it is not allowed (one answer for every reason)."""
        try:
            p = Path(path).resolve(strict=True)
        except (OSError, RuntimeError, ValueError):
            return None
        if self.roots is not None and not any(p == r or p.is_relative_to(r) for r in self.roots):
            return None
        if not (p.is_file() or p.is_dir()) or not os.access(p, os.R_OK):
            return None
        return p


def engine_field_errors(req: RolloutRequest, prompt_ids: Sequence[Sequence[int]] | None, vocab_size: int | None,
                        max_tokens_cap: int | None, max_request_tokens: int | None = None,
                        context_length: int | None = None) -> list[dict[str, Any]]:
    """Fields of a parsed request that the served model cannot take, each ``{"field", "message"}``.

    ``max_request_tokens`` is the per-request token budget: the completion tokens the request may
    ask for in all (``n`` times the sum of every prompt's ``max_tokens``). ``context_length`` is the
    served model's context (``Engine.context_length``): a prompt's tokens plus its ``max_tokens``
    must fit (the HF engine would otherwise run a 12k-token prompt past its positions). With
    ``prompt_ids`` None only the fields known before tokenization are checked.
    """
    errs: list[dict[str, Any]] = []
    sp = req.sampling
    total = len(req.prompts) * req.n
    if sp.seed is not None and sp.seed + total - 1 > INT64_MAX:
        errs.append({"field": "sampling.seed", "message": f"seed + len(prompts) * n - 1 = {sp.seed + total - 1} exceeds int64 ({INT64_MAX})"})
    if max_tokens_cap is not None and sp.max_tokens > max_tokens_cap:
        errs.append({"field": "sampling.max_tokens", "message": f"{sp.max_tokens} exceeds the server's cap {max_tokens_cap}"})
    for i, p in enumerate(req.prompts):
        if p.max_tokens is None:
            continue  # sampling.min_tokens <= sampling.max_tokens is checked by SamplingParams
        if max_tokens_cap is not None and p.max_tokens > max_tokens_cap:
            errs.append({"field": f"prompts[{i}].max_tokens", "message": f"{p.max_tokens} exceeds the server's cap {max_tokens_cap}"})
        if sp.min_tokens > p.max_tokens:
            errs.append({"field": f"prompts[{i}].max_tokens", "message": f"{p.max_tokens} is less than sampling.min_tokens {sp.min_tokens}"})
    if max_request_tokens is not None:
        asked = req.n * sum(p.max_tokens if p.max_tokens is not None else sp.max_tokens for p in req.prompts)
        if asked > max_request_tokens:
            errs.append({"field": "n", "message": f"n * sum of max_tokens over the prompts = {asked} exceeds the server's "
                                                  f"per-request token budget {max_request_tokens}"})
    if context_length is not None:
        for i, (p, ids) in enumerate(zip(req.prompts, prompt_ids or [])):
            mt, field = (p.max_tokens, f"prompts[{i}].max_tokens") if p.max_tokens is not None else (sp.max_tokens, "sampling.max_tokens")
            if len(ids) >= context_length:
                errs.append({"field": f"prompts[{i}]", "message": f"{len(ids)} tokens, not below the model's context of {context_length} tokens"})
            elif len(ids) + mt > context_length:
                errs.append({"field": field, "message": f"prompts[{i}] has {len(ids)} tokens; with max_tokens {mt} that is "
                                                        f"{len(ids) + mt}, beyond the model's context of {context_length} tokens"})
    if vocab_size is not None:
        for j, t in enumerate(sp.stop_token_ids):
            if t >= vocab_size:
                errs.append({"field": f"sampling.stop_token_ids[{j}]", "message": f"token id {t} is outside the vocabulary (size {vocab_size})"})
        bad_bias = sorted(t for t in sp.logit_bias or {} if t >= vocab_size)
        if bad_bias:
            errs.append({"field": "sampling.logit_bias", "message": f"token id(s) {bad_bias} are outside the vocabulary (size {vocab_size})"})
        for i, ids in enumerate(prompt_ids or []):
            bad = next(((k, t) for k, t in enumerate(ids) if t >= vocab_size), None)
            if bad is not None:
                errs.append({"field": f"prompts[{i}].token_ids[{bad[0]}]", "message": f"token id {bad[1]} is outside the vocabulary (size {vocab_size})"})
    return errs


def field_name(err: dict[str, Any]) -> str:
    """The field a pydantic/FastAPI validation error names, as the error bodies spell it
    (``prompts[0].token_ids[1]``, ``sampling.top_p``); ``body`` for a body that is not JSON at all
    (FastAPI reports that at ``("body", <byte offset>)``, which would read as a list index)."""
    if err.get("type") == "json_invalid":
        return "body"
    out = ""
    for p in err.get("loc", ()):
        if p == "body":
            continue
        out += f"[{p}]" if isinstance(p, int) else (("." if out else "") + str(p))
    return out or "<body>"


def unprocessable(errs: list[dict[str, Any]], **extra) -> JSONResponse:
    msg = "; ".join(f"{e['field']}: {e['message']}" for e in errs)
    return JSONResponse(status_code=422, content={"error": f"invalid request: {msg}", "fields": errs, **extra})

