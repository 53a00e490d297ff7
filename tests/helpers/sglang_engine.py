"""SGLang in the tests (the SGLang venv): engine settings for CPU, servers (started, refused at load),
teacher-forced logprobs from SGLang and from the PyTorch reference model, and the noise-floor rule.

Engine settings on a CPU-only machine (see docs/sglang.md): ``SGLANG_USE_CPU_ENGINE=1``,
``device="cpu"``, ``attention_backend="torch_native"``; SGLang's CPU kernel package is replaced
by the test-harness stand-in in tests/sglang_harness (installed by scripts/setup_sglang.sh).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import torch

from foursight.trainer_bridge.launch import free_port

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Keyword arguments of ``sglang.Engine`` for this CPU machine (small KV pool, no graphs).
#: On CPU SGLang sizes the KV pool from *free system memory* (available − (1 − fraction)·before
#: loading), which other processes change under it: a generous fraction plus a hard cap of
#: ``max_total_tokens`` keeps the pool small and the start robust.
#: ``enable_fp32_lm_head``: logits in float32 (the reference does the same), so that BF16
#: rounding of logits (step ~0.03-0.06 at |logit| ~ 8) does not mask the comparison.
ENGINE_KW = dict(
    device="cpu",
    attention_backend="torch_native",
    log_level="error",
    mem_fraction_static=0.5,
    max_total_tokens=4096,
    disable_cuda_graph=True,
    random_seed=0,
    enable_fp32_lm_head=True,
    # an idle SGLang scheduler polls its sockets without sleeping: the session's shared server held 0.66
    # of the 2 CI cores for its whole life (ps, 2026-12-08) while the other suites ran beside it
    sleep_on_idle=True,
)

#: The same as ``python -m sglang.launch_server`` flags.
SERVER_ARGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--log-level", "error",
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "4096",
    "--disable-cuda-graph",
    "--random-seed", "0",
    "--enable-fp32-lm-head",
    "--sleep-on-idle",
]


def prompt_ids(model_dir: str | Path, n: int = 4, max_len: int = 48) -> list[list[int]]:
    """Token ids of ``n`` built-in texts (BOS first), truncated to ``max_len`` tokens."""
    from transformers import AutoTokenizer

    from foursight.calibration import builtin_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for text in builtin_texts()[:n]:
        ids = tok(text, add_special_tokens=False)["input_ids"][: max_len - 1]
        bos = tok.bos_token_id if tok.bos_token_id is not None else ids[0]
        out.append([bos] + ids)
    return out


def sglang_prompt_logprobs(meta_info: dict) -> list[float]:
    """Teacher-forced logprobs of prompt tokens 1..L-1 from SGLang's ``meta_info``
    (``return_logprob=True, logprob_start_len=0``; entry 0 is ``[None, bos, None]``)."""
    lp = meta_info["input_token_logprobs"]
    if lp[0][0] is not None:
        raise AssertionError(f"expected no logprob for the first prompt token, got {lp[0]}")
    return [float(x[0]) for x in lp[1:]]


def engine_prompt_logprobs(engine, prompts: list[list[int]]) -> list[list[float]]:
    """Teacher-forced prompt logprobs from an ``sglang.Engine`` (one greedy token generated)."""
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    return [sglang_prompt_logprobs(o["meta_info"]) for o in outs]


def hf_prompt_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[float]]:
    """Teacher-forced logprobs ``log p(t_i | t_<i)``, i = 1..L-1, of an HF causal LM
    (:func:`foursight.trainer_bridge.scoring.sequence_logprobs`): the final hidden states in the
    model's dtype (BF16), the LM head and the softmax in float32, as SGLang's with ``enable_fp32_lm_head``.
    """
    from foursight.trainer_bridge.scoring import sequence_logprobs

    return [lp.tolist() for lp in sequence_logprobs(model, prompts, fp32_head=True)]


def reference_model(ckpt_dir: str | Path) -> torch.nn.Module:
    """The PyTorch reference model of a FourSight checkpoint (HF model, FourSight linears)."""
    from foursight.hf import load_reference_model

    return load_reference_model(ckpt_dir)


def bf16_model(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()


def abs_diffs(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    """Flat |a - b| over all positions of all prompts (lengths must match)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y):
            raise AssertionError(f"prompt {i}: {len(x)} vs {len(y)} logprobs")
    return torch.tensor([abs(p - q) for x, y in zip(a, b) for p, q in zip(x, y)])


def set_eager_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch an HF model to the eager (non-SDPA) attention implementation, in place."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = "eager"
    return model


def noise_floor(model: torch.nn.Module, prompts: list[list[int]], sdpa_logprobs: list[list[float]]) -> torch.Tensor:
    """|Δ| between two equally valid BF16 implementations of the *same* model: HF with SDPA
    attention (``sdpa_logprobs``) vs HF with eager attention. Modifies ``model`` (eager after).

    This is the spread that BF16 rounding alone produces in this model; with W4A4 it is large
    because a rounding difference in a layer input can move an activation across an FP4
    rounding boundary. An engine implementing the checkpoint correctly lands at this floor.
    """
    return abs_diffs(sdpa_logprobs, hf_prompt_logprobs(set_eager_attention(model), prompts))


class FloorCheck(NamedTuple):
    d: torch.Tensor  #: |Δ| of the engine's logprobs against the reference's, flat
    ok: bool  #: within the floor (:func:`within_floor`)
    msg: str
    ref: list[list[float]]  #: the reference model's logprobs


def floor_check(got: list[list[float]], ref_model: torch.nn.Module, prompts: list[list[int]]) -> FloorCheck:
    """An engine's teacher-forced logprobs ``got`` against the reference model's, by the rule of
    :func:`within_floor` (the floor measured on ``ref_model``, which is left on eager attention)."""
    ref = hf_prompt_logprobs(ref_model, prompts)
    d = abs_diffs(got, ref)
    ok, msg = within_floor(d, noise_floor(ref_model, prompts, ref))
    return FloorCheck(d, ok, msg, ref)


def within_floor(d: torch.Tensor, floor: torch.Tensor) -> tuple[bool, str]:
    """The acceptance rule of the engine-vs-reference tests (see docs/sglang.md):
    mean |Δ| ≤ 2·mean(floor) + 0.01 and max |Δ| ≤ 2·max(floor) + 0.05."""
    mean_tol = 2.0 * float(floor.mean()) + 0.01
    max_tol = 2.0 * float(floor.max()) + 0.05
    ok = float(d.mean()) <= mean_tol and float(d.max()) <= max_tol
    msg = (f"mean |Δ| {float(d.mean()):.5f} (tol {mean_tol:.5f}), max |Δ| {float(d.max()):.5f} (tol {max_tol:.5f}); "
           f"floor sdpa-vs-eager mean {float(floor.mean()):.5f} max {float(floor.max()):.5f}; {d.numel()} tokens")
    return ok, msg


@contextlib.contextmanager
def running_engine(model: str | Path, **kw):
    """An in-process ``sglang.Engine(model_path=model, quantization="foursight")`` with :data:`ENGINE_KW`
    (``kw`` adds or overrides); shut down on exit."""
    import psutil
    import sglang as sgl

    before = {p.pid for p in psutil.Process().children()}
    eng = sgl.Engine(model_path=str(model), **{"quantization": "foursight", **ENGINE_KW, **kw})
    own = {p.pid for p in psutil.Process().children()} - before  # its scheduler and detokenizer
    try:
        yield eng
    finally:
        with _killing_only(own):
            eng.shutdown()


@contextlib.contextmanager
def _killing_only(own: set[int]):
    """``sglang.Engine.shutdown`` ends with ``kill_process_tree(os.getpid(), include_parent=False)``: it
    SIGKILLs *every* child of this process, among them the session's shared SGLang server
    (conftest.py's ``shared_sglang``), which then had to start again (60-75 s) in the next file or, when
    the kill had not finished yet, looked alive and dropped the bridge's first connection (CI of
    49526c8). While the engine shuts down, that call kills only ``own``, the children the engine
    started (a server a test started while the engine was up is not one of them)."""
    import psutil
    from sglang.srt.entrypoints import engine as engine_module

    kill_tree = engine_module.kill_process_tree

    def own_children_only(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid != os.getpid() or include_parent:
            return kill_tree(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)
        for child in psutil.Process().children():
            if child.pid in own and child.pid != skip_pid:
                kill_tree(child.pid, include_parent=True, wait_timeout=wait_timeout)

    engine_module.kill_process_tree = own_children_only
    try:
        yield
    finally:
        engine_module.kill_process_tree = kill_tree


# ---- SGLang HTTP servers (python -m sglang.launch_server --quantization foursight) -------------

STARTUP_TIMEOUT = 240


def launch_server(model: Path, port: int, log: Path, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--quantization", "foursight",
           "--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS, *extra]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def refused_at_load(model: Path, log: Path) -> tuple[int, str]:
    """Start a server on a checkpoint it must refuse and wait for it to exit (AssertionError if it is
    still up after ``STARTUP_TIMEOUT``). Returns its exit code and its log."""
    proc = launch_server(model, free_port(), log)
    try:
        t0 = time.time()
        proc.wait(STARTUP_TIMEOUT)
        print(f"bad checkpoint {model.name}: server exited after {time.time() - t0:.0f} s")
    except subprocess.TimeoutExpired:
        stop_server(proc)
        raise AssertionError(f"server with a bad checkpoint ({model}) did not exit:\n{log.read_text()[-3000:]}") from None
    finally:
        stop_server(proc)
    return proc.returncode, log.read_text()


@contextlib.contextmanager
def running_server(model: Path, log: Path):
    """An SGLang server on ``model`` (a free port), ready: yields its URL, stopped on exit."""
    port = free_port()
    proc = launch_server(model, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        stop_server(proc)


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    t0 = time.time()
    while time.time() - t0 < STARTUP_TIMEOUT:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"server not ready after {STARTUP_TIMEOUT}s:\n{log.read_text()[-4000:]}")


def generate_logprobs(url: str, ids: list[int], max_new_tokens: int = 1, start: int = 0) -> dict:
    r = httpx.post(
        f"{url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
              "return_logprob": True, "logprob_start_len": start},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def server_prompt_logprobs(url: str, prompts: list[list[int]]) -> list[list[float]]:
    return [sglang_prompt_logprobs(generate_logprobs(url, ids)["meta_info"]) for ids in prompts]


