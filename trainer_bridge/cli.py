"""``foursight bridge ...`` commands (a ``typer.Typer`` named ``app``; the main CLI mounts it as ``bridge``).

Example::

    foursight bridge serve --engine vllm --engine-url http://127.0.0.1:8000 --tokenizer MODEL_DIR --port 8100 --wait 300
    foursight bridge serve --engine hf --model CKPT_DIR --api-key "$KEY"
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, get_args

import typer

from foursight.cli_config import typer_command
from foursight.cli_util import OptionError, guarded
from foursight.trainer_bridge.backends.registry import ENGINE_KINDS, EngineKindError, engine_kind, kinds_for, load
from foursight.trainer_bridge.bridge_config import BridgeConfig

app = typer.Typer(help="The FourSight rollout bridge (streaming rollouts with per-token logprobs, weight sync).", no_args_is_help=True)

@app.callback()
def _group() -> None:
    """The FourSight rollout bridge (keeps ``serve`` a sub-command even while it is the only one)."""


def check_options(cfg: BridgeConfig) -> None:
    """The checks the command line gets before any engine is made (an :class:`OptionError` naming the flag)."""
    from foursight.cli_util import check_port_free
    from foursight.trainer_bridge.backends.vllm import WEIGHT_SYNC_ROUTES
    from foursight.trainer_bridge.guards import BindError, check_bind
    from foursight.trainer_bridge.protocol import LogprobsMode

    if cfg.logprobs_mode not in (None, *get_args(LogprobsMode)):
        raise OptionError(f"--logprobs-mode must be raw_logprobs or processed_logprobs, got {cfg.logprobs_mode!r}")
    if cfg.weight_sync not in WEIGHT_SYNC_ROUTES:
        raise OptionError(f"--weight-sync must be one of {', '.join(WEIGHT_SYNC_ROUTES)}, got {cfg.weight_sync!r}")
    try:
        check_bind(cfg.host, cfg.allow_remote, cfg.api_key)
    except BindError as e:
        raise OptionError(f"--host {cfg.host}: {e}") from None
    for d in cfg.weights_dirs or []:
        if not d.is_dir():
            raise OptionError(f"--weights-dir {d} is not a folder")
    check_port_free(cfg.host, cfg.port)  # before any engine loads or is waited for


def build_engines(cfg: BridgeConfig) -> list:
    """Engine objects for the options (raises :class:`~foursight.cli_util.OptionError` naming the option): the
    kind's in-process engine on ``--model``, or its server engine once per ``--engine-url``
    (:data:`~foursight.trainer_bridge.backends.registry.ENGINE_KINDS`)."""
    try:
        row = engine_kind(cfg.engine, "bridge", "--engine")
    except EngineKindError as e:
        raise OptionError(str(e)) from None
    if row.in_process is not None:
        model = cfg.model
        if model is None:
            raise OptionError(f"--engine {row.name} needs --model DIR (a BF16 HF folder or a FourSight checkpoint)")
        if not (Path(model) / "config.json").is_file():
            raise OptionError(f"--model {model}: " + ("no config.json in that folder" if Path(model).is_dir() else "no such folder")
                              + f" (--engine {row.name} needs a BF16 HF folder or a FourSight checkpoint)")
        if cfg.engine_urls:
            raise OptionError(f"--engine-url is for --engine {'|'.join(k for k in kinds_for('bridge') if ENGINE_KINDS[k].server)}; "
                              f"--engine {row.name} runs the model in-process")
        return [load(row.in_process)(model, tokenizer=cfg.tokenizer, device=cfg.device)]
    if not cfg.engine_urls:
        raise OptionError(f"--engine {row.name} needs at least one --engine-url URL")
    server = load(row.server)
    kw = {name: getattr(cfg, name) for name in row.server_options}
    if cfg.logprobs_mode is not None:  # otherwise the engine's own default (vLLM raw, SGLang processed)
        kw["logprobs_mode"] = cfg.logprobs_mode
    return [server(u, tokenizer=cfg.tokenizer or cfg.model, api_key=cfg.engine_api_key, **kw) for u in cfg.engine_urls]


def wait_for_engines(urls: list[str], timeout_s: float, api_key: Optional[str] = None, interval_s: float = 2.0) -> None:
    """Poll each engine's ``GET /health`` until it answers 200, at most ``timeout_s`` seconds in all
    (an engine started together with the bridge may still be loading its model). Raises
    :class:`~foursight.cli_util.OptionError` naming the engines that did not answer."""
    import time

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    waiting = list(urls)
    said = False
    while True:
        for u in list(waiting):
            try:
                if httpx.get(u.rstrip("/") + "/health", headers=headers, timeout=5.0).status_code == 200:
                    waiting.remove(u)
            except httpx.HTTPError:
                pass
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise OptionError(f"--engine-url {', '.join(waiting)}: no answer from /health within --wait {timeout_s:g} s "
                              "(is the engine running? start it first, or raise --wait)")
        if not said:
            typer.echo(f"waiting up to {timeout_s:g} s for {', '.join(waiting)} to answer /health ...", err=True)
            said = True
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def check_engines(engines: list, kind: str) -> None:
    """Each engine server started once, its weight state read and what its weight updates need checked
    (``Engine.check_updatable``: the server flag ``--weight-sync`` needs, the weights token), in a throwaway event
    loop, then closed again (an engine opens its connections in ``start`` and closes them in ``aclose``, so the
    server's own start reopens them): a wrong ``--engine`` kind, key, route, missing flag or token is one
    :class:`~foursight.cli_util.OptionError` naming the engine, not a server traceback at startup or a 502 at the
    first update."""
    import asyncio

    import httpx

    from foursight.trainer_bridge.backends.base import EngineError

    async def check() -> None:
        for e in engines:
            try:
                await e.start()
                await asyncio.wait_for(e.served_state(), 30.0)
            except (EngineError, httpx.HTTPError, asyncio.TimeoutError, TimeoutError) as err:
                await e.aclose()
                why = str(err) or f"{type(err).__name__} (no answer within its timeout)"
                where = "" if e.url in why else f"--engine-url {e.url}: "
                raise OptionError(f"{where}{why} (is --engine-url a {kind} server, and --engine-api-key right?)") from None
            try:  # an engine no update could reach would serve until the first update, then be stale for good
                await e.check_updatable()
            except (EngineError, httpx.HTTPError) as err:
                raise OptionError(f"--engine-url {e.url}: the bridge could never update its weights: {err}") from None
            finally:
                await e.aclose()

    asyncio.run(check())


def serve(cfg: BridgeConfig) -> None:
    """Run the rollout bridge in front of engine servers (or an in-process HF model)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check_options(cfg)
    engines = build_engines(cfg)
    if cfg.engine_urls and cfg.wait > 0:
        wait_for_engines(cfg.engine_urls, cfg.wait, cfg.engine_api_key)
        check_engines(engines, cfg.engine)
    if not cfg.weights_dirs:
        typer.echo("warning: no --weights-dir given: a weight update may name any file this process can read", err=True)
    if not cfg.api_key:
        typer.echo("warning: no --api-key (FOURSIGHT_BRIDGE_API_KEY): every route, weight updates and uploads included, answers "
                   f"anyone who reaches {cfg.host}:{cfg.port}, every user and process of this host on loopback", err=True)
    for line in dict.fromkeys(w for e in engines for w in e.startup_warnings()):
        typer.echo(f"warning: {line}", err=True)
    from foursight.trainer_bridge import server

    typer.echo(f"FourSight bridge on http://{cfg.host}:{cfg.port} -> {', '.join(e.name for e in engines)}"
               f"{' (API key required)' if cfg.api_key else ''}", err=True)
    server.serve(engines, cfg)


app.command("serve")(guarded(typer_command(BridgeConfig, serve)))
