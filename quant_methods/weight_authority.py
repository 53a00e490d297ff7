"""Who may load weights into a serving vLLM engine, and from where (issue 38 item 1).

vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc`` and the weight-transfer
routes) take no API key, not even vLLM's own ``--api-key``. FourSight's two update routes inside
the engine, the worker extension's ``foursight_update_weights`` (:mod:`.vllm_weight_sync`) and the
native ``foursight_file`` backend (:mod:`.vllm_weight_transfer`), therefore call
:func:`authorize_update` before they open any file:

* **The token.** ``FOURSIGHT_WEIGHTS_TOKEN`` in the engine's environment (every vLLM process
  inherits it); each update must carry the same string (the bridge reads the same variable and
  sends it: ``token`` in the RPC's kwargs or in ``update_info``). An engine that serves its routes
  over HTTP (``VLLM_SERVER_DEV_MODE=1``) and has no token refuses every update. An engine in the
  caller's own process (``vllm.LLM``: TRL colocate, verl, ``foursight rl``) needs none: only that
  process can call it.
* **The folder.** Wherever the routes are served over HTTP, the file must
  resolve (symlinks, ``..``) inside one of ``FOURSIGHT_WEIGHTS_DIR`` (``os.pathsep``-separated;
  default: the shared-memory folder ``$FOURSIGHT_SHM_DIR`` or ``/dev/shm``, where the TRL client
  writes). The bridge's ``--weights-dir`` is the same folder.
* **One answer.** A refusal names no path outside the weights folders and says the same for "outside",
  "missing" and "unreadable", so the route tells a caller nothing about the engine's files.

The update also carries the bridge's **weights id** (a nonce per push) which the engine reports
back (``foursight_engine_state``; ``/weight_info`` on the native route): the bridge compares it
before it tags samples, so weights it did not push make the engine stale (``trainer_bridge/liveness``).

**The routes themselves** (issue 53). vLLM's own dev-mode methods (``reload_weights``, ``reset_weights``,
``/update_weight_version``, ``/sleep``) were reachable by anyone who reached the engine's port, a web page
in the operator's browser included (a ``text/plain`` form post needs no CORS preflight). :class:`DevRoutesGuard`
is an ASGI middleware for vLLM's API server (``--middleware foursight.quant_methods.weight_authority.DevRoutesGuard``;
``foursight serve`` adds it) that refuses every request to ``/collective_rpc``, the weight-transfer routes and
the other state-changing dev routes (:data:`GUARDED_DEV_ROUTES`) unless it carries the engine's token in
:data:`~foursight.schema.WEIGHTS_TOKEN_HEADER`, has a JSON body (``Content-Type: application/json``) and no
cross-origin ``Origin``. The bridge sends the header on every engine call. Loopback is still the first wall
(every documented engine command binds ``127.0.0.1``: docs/bridge.md, "Who can reach the engine").
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from urllib.parse import urlsplit

from foursight.schema import ENV_SHM_DIR, ENV_WEIGHTS_DIR, ENV_WEIGHTS_TOKEN, REFUSED_PREFIX, WEIGHTS_TOKEN_HEADER


class RefusedUpdate(RuntimeError):
    """An engine route refused a weight update before loading any of it (the message starts with
    :data:`foursight.schema.REFUSED_PREFIX`, which the bridge reads as "the update is at fault": 422, the engine in sync)."""


class WeightsRefused(RefusedUpdate):
    """An update without the engine's token, or from outside its weights folders: nothing was opened."""


def served_over_http(env: dict | None = None) -> bool:
    """True when vLLM mounts its development routes (``/collective_rpc``, the weight-transfer routes)."""
    env = os.environ if env is None else env
    return env.get("VLLM_SERVER_DEV_MODE", "0").strip().lower() not in ("", "0", "false", "no")


def weights_dirs(env: dict | None = None) -> list[Path]:
    """The folders an update may be read from: ``FOURSIGHT_WEIGHTS_DIR`` or the shared-memory folder."""
    env = os.environ if env is None else env
    raw = env.get(ENV_WEIGHTS_DIR) or env.get(ENV_SHM_DIR, "/dev/shm")
    return [Path(d).resolve() for d in raw.split(os.pathsep) if d]


def authorize_token(token: str | None, env: dict | None = None) -> None:
    """Refuse (:class:`WeightsRefused`) a call without the engine's ``FOURSIGHT_WEIGHTS_TOKEN`` where the engine
    serves its weight routes over HTTP; nothing to check in an in-process engine. The token half of
    :func:`authorize_update`, and all of what the broadcast road's group join needs (it opens no file)."""
    env = os.environ if env is None else env
    if not served_over_http(env):
        return
    want = env.get(ENV_WEIGHTS_TOKEN) or None
    if want is None:
        raise WeightsRefused(f"{REFUSED_PREFIX}this engine serves its weight routes over HTTP (VLLM_SERVER_DEV_MODE=1) but has no "
                             f"{ENV_WEIGHTS_TOKEN}; start it with one and give the bridge the same (docs/bridge.md)")
    if not isinstance(token, str) or not hmac.compare_digest(token.encode(), want.encode()):
        raise WeightsRefused(f"{REFUSED_PREFIX}the call does not carry this engine's {ENV_WEIGHTS_TOKEN}")


def authorize_update(path: str | os.PathLike, token: str | None, env: dict | None = None) -> str:
    """The resolved path of an update file the caller may load, or :class:`WeightsRefused`.

    No check in an engine that does not serve its routes over HTTP (in-process ``vllm.LLM``: only the
    caller's process can reach it), whatever its environment holds: a shell that exported the token for
    a served engine must not break TRL colocate or ``foursight rl`` started from it."""
    env = os.environ if env is None else env
    if not served_over_http(env):
        return str(path)
    authorize_token(token, env)
    roots = weights_dirs(env)
    try:
        p = Path(path).resolve(strict=True)
        ok = any(p == r or p.is_relative_to(r) for r in roots) and p.is_file() and os.access(p, os.R_OK)
    except (OSError, RuntimeError, ValueError, TypeError):
        ok = False
    if not ok:
        raise WeightsRefused(f"{REFUSED_PREFIX}not a readable file inside this engine's weights folders "
                             f"({ENV_WEIGHTS_DIR}: {os.pathsep.join(map(str, roots))})")
    return str(p)


#: vLLM 0.32's development routes that change the engine (``VLLM_SERVER_DEV_MODE=1``: its RPC, RL and sleep
#: routers): :class:`DevRoutesGuard` lets a request to one of them through only with the weights token
GUARDED_DEV_ROUTES = frozenset({
    "/collective_rpc",
    "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_checker",
    "/pause", "/resume", "/abort_requests",
    "/sleep", "/wake_up", "/release_kv_cache_memory",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
})


def dev_route_refusal(method: str, headers: dict[str, str], token: str | None) -> tuple[int, str] | None:
    """Why a request to a guarded dev route is refused, as ``(HTTP status, message)``, or None when it may pass:
    a cross-origin ``Origin`` (403: a web page's request; its browser names the page's site), no or another token
    than the engine's (401; 403 for every request when the engine has no token), a body that is not JSON (415: a
    form post needs no CORS preflight, a JSON one does). ``headers`` are lower-case names."""
    origin = headers.get("origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower()):
        return 403, f"cross-origin request refused: Origin {origin!r} is not this engine"
    if not token:
        return 403, (f"this engine has no {ENV_WEIGHTS_TOKEN}, so its development routes are closed; start it with one and give "
                     "the bridge the same (docs/bridge.md, 'Who can reach the engine')")
    given = headers.get(WEIGHTS_TOKEN_HEADER.lower(), "")
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        return 401, f"this route needs the engine's {ENV_WEIGHTS_TOKEN} in the {WEIGHTS_TOKEN_HEADER} header"
    if method in ("POST", "PUT", "PATCH"):
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return 415, f"this route takes a JSON body (Content-Type: application/json), not {ctype or 'none'!r}"
    return None


class DevRoutesGuard:
    """ASGI middleware for vLLM's API server: the development routes of :data:`GUARDED_DEV_ROUTES` behind the
    engine's weights token (:func:`dev_route_refusal`; the module docstring says why). The token is this
    process's ``FOURSIGHT_WEIGHTS_TOKEN`` (``token`` overrides it). Every other route passes untouched."""

    def __init__(self, app, token: str | None = None):
        self.app = app
        self.token = token if token is not None else (os.environ.get(ENV_WEIGHTS_TOKEN) or None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].rstrip("/") in GUARDED_DEV_ROUTES:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refusal = dev_route_refusal(scope["method"], headers, self.token)
            if refusal is not None:
                import json

                status, message = refusal
                body = json.dumps({"error": message, "detail": message}).encode()
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
