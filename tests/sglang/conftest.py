"""Fixtures of the SGLang suite (run in the SGLang venv: `.venv-sglang/bin/python -m pytest tests/sglang`).

In a venv without SGLang (the vLLM/main one) the whole folder is skipped at collection.
The FourSight checkpoints are written once per session with ``foursight.checkpoint.quantize_model``.
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

K_TINY = "16"  # BF16 channels per layer of the tiny model (K = 128 / 256)


def _quantize(model_dir: Path, out: Path, channels: str) -> Path:
    from foursight.checkpoint import quantize_model

    return quantize_model(model_dir, out, channels=channels, progress=False).out_dir


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_llama_dir, tmp_path_factory) -> Path:
    """FourSight checkpoint (k=16) of the tiny Llama."""
    return _quantize(tiny_llama_dir, tmp_path_factory.mktemp("fs-ckpt") / "ckpt", K_TINY)


@pytest.fixture(scope="session")
def tiny_nvfp4_ckpt(tiny_llama_dir, tmp_path_factory) -> Path:
    """Plain NVFP4 checkpoint (k=0) of the tiny Llama: the baseline FourSight must differ from."""
    return _quantize(tiny_llama_dir, tmp_path_factory.mktemp("fp4-ckpt") / "ckpt", "0")


@pytest.fixture(scope="session")
def tiny_llama_b_dir(tmp_path_factory) -> Path:
    """A second tiny Llama (other random weights, same shapes): the 'new policy' of weight updates."""
    from foursight.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-b") / "model", arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_ckpt_b(tiny_llama_b_dir, tmp_path_factory) -> Path:
    return _quantize(tiny_llama_b_dir, tmp_path_factory.mktemp("fs-ckpt-b") / "ckpt", K_TINY)
