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

Limit: vLLM's own dev-mode RPCs (``reload_weights``, ``reset_weights``, ``/update_weight_version``)
are reachable by anyone who reaches the engine's port, and nothing FourSight loads can stop them.
That is why every documented engine command binds ``127.0.0.1`` (docs/bridge.md, "Who can reach
the engine").
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from foursight.schema import ENV_SHM_DIR, ENV_WEIGHTS_DIR, ENV_WEIGHTS_TOKEN, REFUSED_PREFIX


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


def authorize_update(path: str | os.PathLike, token: str | None, env: dict | None = None) -> str:
    """The resolved path of an update file the caller may load, or :class:`WeightsRefused`.

    No check in an engine that does not serve its routes over HTTP (in-process ``vllm.LLM``: only the
    caller's process can reach it), whatever its environment holds: a shell that exported the token for
    a served engine must not break TRL colocate or ``foursight rl`` started from it."""
    env = os.environ if env is None else env
    if not served_over_http(env):
        return str(path)
    want = env.get(ENV_WEIGHTS_TOKEN) or None
    if want is None:
        raise WeightsRefused(f"{REFUSED_PREFIX}this engine serves its weight routes over HTTP (VLLM_SERVER_DEV_MODE=1) but has no "
                             f"{ENV_WEIGHTS_TOKEN}; start it with one and give the bridge the same (docs/bridge.md)")
    if not isinstance(token, str) or not hmac.compare_digest(token.encode(), want.encode()):
        raise WeightsRefused(f"{REFUSED_PREFIX}the call does not carry this engine's {ENV_WEIGHTS_TOKEN}")
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
