"""``foursight bridge ...`` commands (a ``typer.Typer`` named ``app``; the main CLI mounts it as ``bridge``).

Example::

    foursight bridge serve --engine vllm --engine-url http://127.0.0.1:8000 --tokenizer MODEL_DIR --port 8100 --wait 300
    foursight bridge serve --engine hf --model CKPT_DIR --api-key "$KEY"
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from foursight.cli_util import OptionError, guarded
from foursight.trainer_bridge.protocol import DEFAULT_WRITE_TIMEOUT_S

app = typer.Typer(help="The FourSight rollout bridge (streaming rollouts with per-token logprobs, weight sync).", no_args_is_help=True)

ENGINES = ("vllm", "sglang", "hf")


@app.callback()
def _group() -> None:
    """The FourSight rollout bridge (keeps ``serve`` a sub-command even while it is the only one)."""


def build_engines(engine: str, engine_urls: list[str], model: Optional[Path], tokenizer: Optional[Path],
                  engine_api_key: Optional[str], logprobs_mode: Optional[str], device: str = "cpu",
                  weight_sync: str = "collective_rpc") -> list:
    """Engine objects for the CLI options (raises :class:`~foursight.cli_util.OptionError` naming the option)."""
    from foursight.trainer_bridge.backends.hf import HFEngine
    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine

    if engine not in ENGINES:
        raise OptionError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    tok = tokenizer or model
    if engine == "hf":
        if model is None:
            raise OptionError("--engine hf needs --model DIR (a BF16 HF folder or a FourSight checkpoint)")
        if not (Path(model) / "config.json").is_file():
            raise OptionError(f"--model {model}: " + ("no config.json in that folder" if Path(model).is_dir() else "no such folder")
                              + " (--engine hf needs a BF16 HF folder or a FourSight checkpoint)")
        if engine_urls:
            raise OptionError("--engine-url is for --engine vllm|sglang; --engine hf runs the model in-process")
        return [HFEngine(model, tokenizer=tokenizer, device=device)]
    if not engine_urls:
        raise OptionError(f"--engine {engine} needs at least one --engine-url URL")
    if engine == "vllm":
        from foursight.trainer_bridge.backends.vllm import WEIGHT_SYNC_ROUTES

        if weight_sync not in WEIGHT_SYNC_ROUTES:
            raise OptionError(f"--weight-sync must be one of {', '.join(WEIGHT_SYNC_ROUTES)}, got {weight_sync!r}")
        return [VLLMHTTPEngine(u, tokenizer=tok, api_key=engine_api_key, logprobs_mode=logprobs_mode or "raw_logprobs",
                               weight_sync=weight_sync) for u in engine_urls]
    return [SGLangHTTPEngine(u, tokenizer=tok, api_key=engine_api_key, logprobs_mode=logprobs_mode or "processed_logprobs") for u in engine_urls]


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


@app.command()
@guarded
def serve(
    engine: str = typer.Option("vllm", "--engine", help="vllm | sglang | hf"),
    engine_url: list[str] = typer.Option([], "--engine-url", help="engine server URL (repeat for several engines)"),
    model: Optional[Path] = typer.Option(None, "--model", help="model folder (hf engine; also the tokenizer by default)"),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="tokenizer folder for text/chat prompts"),
    host: str = typer.Option("127.0.0.1", "--host", help="bind address (loopback by default)"),
    port: int = typer.Option(8100, "--port", min=1, max=65535),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="FOURSIGHT_BRIDGE_API_KEY",
                                          help="required on /v1/rollouts and /v1/weights (header Authorization: Bearer KEY)"),
    engine_api_key: Optional[str] = typer.Option(None, "--engine-api-key", envvar="FOURSIGHT_ENGINE_API_KEY"),
    max_concurrency: int = typer.Option(64, "--max-concurrency", min=1, help="engine calls in flight at once"),
    max_queue: int = typer.Option(256, "--max-queue", min=1, help="per-stream window: samples of one stream running or finished-but-unsent (backpressure)"),
    sample_timeout: float = typer.Option(600.0, "--sample-timeout", min=0.001, help="seconds per sample before an error event"),
    write_timeout: float = typer.Option(DEFAULT_WRITE_TIMEOUT_S, "--write-timeout", min=0.001,
                                        help="seconds one response write may wait for a client that stopped reading; then the "
                                             "response is dropped (its engine calls cancelled, its hold on weight updates released)"),
    logprobs_mode: Optional[str] = typer.Option(None, "--logprobs-mode", help="what the engine's logprobs are: raw_logprobs | processed_logprobs"),
    initial_version: int = typer.Option(0, "--initial-version", min=0),
    device: str = typer.Option("cpu", "--device", help="hf engine device"),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="allow a non-loopback --host (requires --api-key)"),
    weights_dir: list[Path] = typer.Option([], "--weights-dir", help="folder a weight update path must lie in (repeat for several; "
                                            "none: any path, with a warning)"),
    allowed_host: list[str] = typer.Option([], "--allowed-host", help="Host/Origin name accepted besides loopback and --host "
                                           "(repeat; '*.example.com' patterns)"),
    max_body_bytes: int = typer.Option(32 << 20, "--max-body-bytes", min=1024, help="request body limit (413 beyond it)"),
    max_tokens_cap: Optional[int] = typer.Option(None, "--max-tokens-cap", min=1, help="largest max_tokens a request may ask for"),
    max_request_tokens: Optional[int] = typer.Option(None, "--max-request-tokens", min=1,
                                                     help="per-request token budget: n times the sum of the prompts' max_tokens"),
    wait: float = typer.Option(300.0, "--wait", min=0.0, help="seconds to wait for every --engine-url to answer /health "
                               "before serving (an engine still loading its model); 0: do not wait or check"),
    weight_sync: str = typer.Option("collective_rpc", "--weight-sync",
                                    help="vllm engine weight updates: collective_rpc (FourSight worker extension) or native "
                                         "(vLLM >= 0.32, --weight-transfer-config '{\"backend\": \"foursight_file\"}')"),
) -> None:
    """Run the rollout bridge in front of engine servers (or an in-process HF model)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if logprobs_mode not in (None, "raw_logprobs", "processed_logprobs"):
        raise OptionError(f"--logprobs-mode must be raw_logprobs or processed_logprobs, got {logprobs_mode!r}")
    from foursight.trainer_bridge.guards import BindError, check_bind

    try:
        check_bind(host, allow_remote, api_key)
    except BindError as e:
        raise OptionError(f"--host {host}: {e}") from None
    for d in weights_dir:
        if not d.is_dir():
            raise OptionError(f"--weights-dir {d} is not a folder")
    engines = build_engines(engine, engine_url, model, tokenizer, engine_api_key, logprobs_mode, device, weight_sync)
    if engine != "hf" and wait > 0:
        wait_for_engines(engine_url, wait, engine_api_key)
    if not weights_dir:
        typer.echo("warning: no --weights-dir given: a weight update may name any file this process can read", err=True)
    if engine == "vllm" and not os.environ.get("FOURSIGHT_WEIGHTS_TOKEN"):
        typer.echo("warning: no FOURSIGHT_WEIGHTS_TOKEN in the environment: a vLLM engine served with VLLM_SERVER_DEV_MODE=1 "
                   "refuses every weight update without it (docs/bridge.md, 'Who can reach the engine')", err=True)
    from foursight.trainer_bridge.server import serve as _serve

    typer.echo(f"FourSight bridge on http://{host}:{port} -> {', '.join(e.name for e in engines)}"
               f"{' (API key required)' if api_key else ''}", err=True)
    _serve(engines, host=host, port=port, allow_remote=allow_remote, allowed_hosts=allowed_host, api_key=api_key,
           max_concurrency=max_concurrency, max_queue=max_queue, sample_timeout_s=sample_timeout, initial_version=initial_version,
           weights_dirs=[str(d) for d in weights_dir] or None, max_body_bytes=max_body_bytes, max_tokens_cap=max_tokens_cap,
           max_request_tokens=max_request_tokens, write_timeout_s=write_timeout)
