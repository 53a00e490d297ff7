"""Fixtures of the SGLang suite (run in the SGLang venv: `.venv-sglang/bin/python -m pytest tests/sglang`).

In a venv without SGLang (the vLLM/main one) the whole folder is skipped at collection.
The FourSight checkpoints are written once per session by tests/conftest.py's ``quantize_tiny``; the
suite's helpers are in tests/helpers/sglang_engine.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")



def _sglang_installed() -> bool:
    """True if the real SGLang is importable. (This folder is itself named ``sglang`` and
    ``tests/`` is on sys.path, so a bare ``find_spec`` would find it as a namespace package.)"""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


if not _sglang_installed():
    collect_ignore_glob = ["test_*.py"]

#: tests that stop the session's shared SGLang server on purpose (the dead-engine ones): run after
#: every other test, so that the server is started once for the session, not once more after them
STOPS_SHARED = "stops_shared_server"


#: tests that look at the shared server after every other test used it (and before those that stop it)
AFTER_THE_REST = "after_the_rest"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{STOPS_SHARED}: stops the session's shared SGLang server; runs last")
    config.addinivalue_line("markers", f"{AFTER_THE_REST}: runs after every other test but those that stop the shared server")


def _rank(item) -> int:
    return 2 if item.get_closest_marker(STOPS_SHARED) else 1 if item.get_closest_marker(AFTER_THE_REST) else 0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: the rest keep their order

# tiny_ckpt (FourSight k=16 of the tiny Llama) and the quantize_tiny builder are in tests/conftest.py.


@pytest.fixture(scope="session")
def tiny_nvfp4_ckpt(quantize_tiny, tiny_llama_dir) -> Path:
    """Plain NVFP4 checkpoint (k=0) of the tiny Llama: the baseline FourSight must differ from."""
    return quantize_tiny(tiny_llama_dir, channels="0").out_dir


@pytest.fixture(scope="session")
def tiny_llama_b_dir(tmp_path_factory) -> Path:
    """A second tiny Llama (other random weights, same shapes): the 'new policy' of weight updates."""
    from foursight.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-b") / "model", arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_ckpt_b(quantize_tiny, tiny_llama_b_dir) -> Path:
    """FourSight checkpoint (k=16) of the second tiny Llama."""
    return quantize_tiny(tiny_llama_b_dir).out_dir


@pytest.fixture(scope="module")
def ckpt_engine(tiny_ckpt):
    """An in-process ``sglang.Engine`` serving the tiny FourSight checkpoint (one per test module)."""
    from helpers.sglang_engine import running_engine

    with running_engine(tiny_ckpt) as eng:
        yield eng


@pytest.fixture(scope="session")
def shared_sglang(tiny_ckpt, tmp_path_factory):
    """``python -m sglang.launch_server`` on the tiny FourSight checkpoint (``helpers.sglang_engine.SERVER_ARGS``),
    one for the session (:class:`helpers.shared_servers.SharedServer`; ``.running()`` gives ``url``, ``proc``,
    ``log``): test_server.py, test_bridge_stream.py and test_atomic_updates.py share it, one start (30-60 s on
    2 cores) instead of one per file. A test that updates its weights puts ``tiny_ckpt`` back before it ends."""
    from types import SimpleNamespace

    from helpers.sglang_engine import free_port, launch_server, stop_server, wait_ready
    from helpers.shared_servers import SharedServer

    logs = tmp_path_factory.mktemp("sglang-shared")

    def start(n: int):
        port, log = free_port(), logs / f"server{n}.log"
        proc = launch_server(tiny_ckpt, port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(proc, url, log)
        except BaseException:
            stop_server(proc)
            raise
        return SimpleNamespace(url=url, proc=proc, log=log)

    shared = SharedServer(start, alive=lambda s: s.proc.poll() is None, stop=lambda s: stop_server(s.proc))
    yield shared
    shared.close()
