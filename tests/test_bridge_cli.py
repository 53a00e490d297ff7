"""`foursight bridge serve` option handling (typer app; the server itself is covered elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from foursight.cli_util import OptionError
from foursight.trainer_bridge.bridge_config import BridgeConfig
from foursight.trainer_bridge.cli import app, build_engines
from foursight.trainer_bridge.backends.hf import HFEngine
from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine


def test_serve_help_lists_options():
    r = CliRunner().invoke(app, ["serve", "--help"])
    assert r.exit_code == 0
    for opt in ("--engine", "--engine-url", "--model", "--api-key", "--max-queue", "--host"):
        assert opt in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--engine", "vllm"], "--engine-url"),
        (["serve", "--engine", "hf"], "--model"),
        (["serve", "--engine", "tpu", "--engine-url", "http://x"], "--engine"),
        (["serve", "--engine-url", "http://x", "--host", "0.0.0.0"], "--allow-remote"),
        (["serve", "--engine-url", "http://x", "--host", "0.0.0.0", "--allow-remote"], "--api-key"),
        (["serve", "--engine-url", "http://x", "--logprobs-mode", "weird"], "--logprobs-mode"),
    ],
)
def test_serve_rejects_bad_options(args, message, monkeypatch):
    monkeypatch.delenv("FOURSIGHT_BRIDGE_API_KEY", raising=False)
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code != 0
    text = " ".join(r.output.replace("│", " ").split())
    assert message in text, text


def test_build_engines(tiny_llama_dir):
    e = build_engines(BridgeConfig(engine="vllm", engine_urls=["http://127.0.0.1:1", "http://127.0.0.1:2"], tokenizer=tiny_llama_dir))
    assert [type(x) for x in e] == [VLLMHTTPEngine, VLLMHTTPEngine] and e[0].logprobs_mode == "raw_logprobs"
    h = build_engines(BridgeConfig(engine="hf", model=tiny_llama_dir))
    assert isinstance(h[0], HFEngine)
    with pytest.raises(OptionError, match="--engine-url"):
        build_engines(BridgeConfig(engine="hf", engine_urls=["http://x"], model=tiny_llama_dir))


def test_serve_passes_the_edge_options_to_serve(tmp_path, monkeypatch):
    """--weights-dir, --allowed-host, --max-body-bytes, --max-tokens-cap reach serve() in its BridgeConfig; a
    --weights-dir that is not a folder is refused naming the option."""
    import foursight.trainer_bridge.server as server

    got = []
    monkeypatch.setattr(server, "serve", lambda engines, cfg: got.append(cfg))
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--wait", "0", "--weights-dir", str(tmp_path),
                                 "--allowed-host", "bridge.internal", "--max-body-bytes", "4096", "--max-tokens-cap", "100",
                                 "--max-request-tokens", "5000"])
    assert r.exit_code == 0, r.output
    (cfg,) = got
    assert cfg.weights_dirs == [tmp_path] and cfg.allowed_hosts == ["bridge.internal"]
    assert cfg.max_body_bytes == 4096 and cfg.max_tokens_cap == 100 and cfg.allow_remote is False
    assert cfg.max_request_tokens == 5000
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--weights-dir", str(tmp_path / "nope")],
                           env={"COLUMNS": "300"})
    assert r.exit_code != 0 and "--weights-dir" in r.output and "is not a folder" in r.output


@pytest.mark.parametrize("args, want", [(["--write-timeout", "2.5"], 2.5), ([], "default")])
def test_write_timeout_flag_reaches_the_servers_write_timeout(monkeypatch, args, want):
    """--write-timeout (issue 28 item 6) is the limit the app's write-timeout middleware applies to
    each response write: CLI -> serve -> create_app -> guards (uvicorn itself is replaced)."""
    import uvicorn

    from foursight.trainer_bridge.guards import DEFAULT_WRITE_TIMEOUT_S, WriteTimeoutMiddleware

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--wait", "0", *args])
    assert r.exit_code == 0, r.output
    (mw,) = [m for m in apps[0].user_middleware if m.cls is WriteTimeoutMiddleware]
    assert mw.kwargs["timeout_s"] == (DEFAULT_WRITE_TIMEOUT_S if want == "default" else want)
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--wait", "0", "--write-timeout", "0"])
    assert r.exit_code == 2 and "--write-timeout" in r.output


def test_foursight_serve_binds_loopback_and_warns_about_dev_routes_off_it():
    """`foursight serve` gives vLLM --host 127.0.0.1 unless told otherwise (vLLM's own default is every
    interface); with VLLM_SERVER_DEV_MODE=1 a non-loopback --host gets a warning naming the unauthenticated routes."""
    from foursight.serve import dev_routes_warning, vllm_command

    argv, env = vllm_command("m", "127.0.0.1", 8000, [], env={"VLLM_SERVER_DEV_MODE": "1"}, cpu=True)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and dev_routes_warning(argv, env) is None
    argv, env = vllm_command("m", "0.0.0.0", 8000, [], env={"VLLM_SERVER_DEV_MODE": "1"}, cpu=True)
    assert "/collective_rpc" in dev_routes_warning(argv, env)
    argv, env = vllm_command("m", "0.0.0.0", 8000, [], env={}, cpu=True)
    assert dev_routes_warning(argv, env) is None


def test_a_bridge_without_an_api_key_says_its_routes_are_open(monkeypatch):
    """Issue 53 (low): a bridge without --api-key served open weight routes without a word."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--wait", "0"], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "no --api-key" in r.output and "weight updates and uploads" in r.output, r.output
    r = CliRunner().invoke(app, ["serve", "--engine-url", "http://127.0.0.1:1", "--wait", "0", "--api-key", "k"], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "no --api-key" not in r.output, r.output


def test_foursight_serve_mounts_the_dev_route_guard_once():
    """Issue 53 item 2: every `foursight serve` command gives vLLM `--middleware` with FourSight's guard of its dev
    routes (once, also when the user names it)."""
    from foursight.serve import DEV_GUARD, vllm_command

    guard = "foursight.quant_methods.weight_authority.DevRoutesGuard"
    assert DEV_GUARD == guard
    for extra in ([], ["--middleware", guard]):
        argv, _ = vllm_command("m", "127.0.0.1", 8000, extra, env={}, cpu=False)
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"] == [guard]


def test_a_busy_port_is_refused_before_anything_starts(tiny_llama_dir):
    """issue 53 item 8: ``foursight bridge serve`` and ``foursight serve`` (the installed command, as a user
    runs it) on a port something already listens on exit 2 with one line naming the port, before the
    bridge loads its engine or prints its banner, and before vLLM starts (before: the bridge printed its
    banner and failed after 39 s; ``foursight serve`` gave a 30-line vLLM traceback after 46 s)."""
    import socket
    import subprocess
    import sys
    import time

    exe = str(Path(sys.executable).parent / "foursight")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args in (["bridge", "serve", "--engine", "hf", "--model", str(tiny_llama_dir), "--port", str(port)],
                     ["serve", str(tiny_llama_dir), "--port", str(port)]):
            t0 = time.monotonic()
            r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)
            took = time.monotonic() - t0
            assert r.returncode == 2, (args, r.returncode, r.stderr[-2000:])
            assert f"--port {port}" in r.stderr and "already in use" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert "FourSight bridge on" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert took < 20, (args, took)
