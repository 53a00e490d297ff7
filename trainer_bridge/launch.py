"""Process helpers: start a vLLM OpenAI server and run a bridge app in a background thread.

Used by the tests and handy in scripts. Servers bind 127.0.0.1 on a free port; callers stop them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import httpx


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str | Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) if path else ""
    except OSError:
        return ""


def wait_http_ok(url: str, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "server",
                 log_path: str | Path | None = None) -> None:
    """Poll ``url`` until it answers 200; raise ``RuntimeError`` on timeout or if ``proc`` exits (with the
    tail of ``log_path``, the process's log, so the cause survives the log's folder)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_tail(log_path)
            raise RuntimeError(f"{what} exited with code {proc.returncode} before becoming healthy"
                               + (f"; the end of {log_path}:\n{tail}" if tail else ""))
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not healthy at {url} after {timeout_s} s")


#: every server started in this process, oldest first (the tests attach the log tails of the
#: servers a failed test started to its report: tests/conftest.py)
STARTED: list["ServerProcess"] = []


class ServerProcess:
    """An engine server as a child process in its own process group, polled on ``/health``.

    Subclasses build ``cmd`` and ``env``; :meth:`start` waits until healthy, :meth:`stop` and
    :meth:`kill` end the whole group (API server, engine core and workers).
    """

    what = "server"

    def __init__(self, cmd: Sequence[str], env: dict[str, str], port: int, log_path: str | Path | None = None):
        self.cmd = list(cmd)
        self.env = env
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240.0):
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        STARTED.append(self)
        try:
            wait_http_ok(self.url + "/health", timeout_s, self.proc, what=f"{self.what} ({self.log_path or 'no log'})",
                         log_path=self.log_path)
        except Exception:
            self.stop()
            raise
        return self

    def log_tail(self, max_lines: int = 60) -> str:
        """The last ``max_lines`` lines of the server's log and how the process ended ("" without a log)."""
        tail = log_tail(self.log_path, max_lines)
        if not tail:
            return ""
        code = None if self.proc is None else self.proc.poll()
        state = "running" if code is None else f"exited with code {code}"
        return f"{self.what} {self.url} ({state}), {self.log_path}:\n" + tail

    def kill(self) -> None:
        """SIGKILL the whole server process group (engine core and workers too)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL after 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            self.kill()


class VLLMServer(ServerProcess):
    """``python -m vllm.entrypoints.openai.api_server`` as a child process (own process group), on 127.0.0.1.

    Args:
        model: model folder.
        extra_args: more CLI args (e.g. ``["--quantization", "foursight"]``).
        env: extra environment (``VLLM_CPU_KVCACHE_SPACE=1`` and ``VLLM_SERVER_DEV_MODE=1`` are set by default).
        log_path: where stdout/stderr go (default: DEVNULL).
        weights_token: the engine's ``FOURSIGHT_WEIGHTS_TOKEN`` (default: a new random one, ``self.weights_token``;
            give it to the bridge's engine: ``VLLMHTTPEngine(url, weights_token=...)``).
        weights_dir: the folder(s) the engine loads weight updates from (``FOURSIGHT_WEIGHTS_DIR``; default: the
            shared-memory folder).
    """

    what = "vLLM server"

    def __init__(self, model: str | Path, port: int | None = None, max_model_len: int = 512, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log_path: str | Path | None = None, python: str = sys.executable,
                 weights_token: str | None = None, weights_dir: str | Path | Sequence[str | Path] | None = None):
        import secrets

        from foursight.schema import ENV_WEIGHTS_DIR, ENV_WEIGHTS_TOKEN

        self.model = str(model)
        self.weights_token = weights_token or secrets.token_hex(16)
        port = port or free_port()
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
               "--port", str(port), "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
               *extra_args]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_SERVER_DEV_MODE": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", ENV_WEIGHTS_TOKEN: self.weights_token, **(env or {})}
        if weights_dir is not None:
            dirs = [weights_dir] if isinstance(weights_dir, (str, Path)) else list(weights_dir)
            full_env[ENV_WEIGHTS_DIR] = os.pathsep.join(str(Path(d).resolve()) for d in dirs)
        super().__init__(cmd, full_env, port, log_path)


class SGLangServer(ServerProcess):
    """``python -m sglang.launch_server`` on the CPU, with the SGLang venv's ``python`` (docs/sglang.md).
    ``--sleep-on-idle``: an idle scheduler otherwise polls without sleeping, holding a CPU core."""

    what = "SGLang server"

    def __init__(self, model: str | Path, python: str, port: int | None = None, log_path: str | Path | None = None,
                 extra_args: Sequence[str] = ()):
        port = port or free_port()
        cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16", "--mem-fraction-static", "0.05",
               "--disable-cuda-graph", "--random-seed", "0", "--sleep-on-idle", *extra_args]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        super().__init__(cmd, env, port, log_path)


class BridgeThread:
    """Run a FastAPI app with uvicorn in a daemon thread on 127.0.0.1 (tests, notebooks)."""

    def __init__(self, app, port: int | None = None, host: str = "127.0.0.1"):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 60.0) -> "BridgeThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("bridge server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
