"""Issue 28, class 3: every SGLang weight update FourSight serves is checked WHOLE before anything of it
is applied, on a real SGLang CPU engine.

Routes: ``Engine.update_weights_from_tensor`` (what verl's and slime's SGLang rollouts call, inside a
``begin_weight_update`` / ``end_weight_update`` session) and ``/update_weights_from_disk`` reached
through the bridge's real HTTP route (``POST /v1/weights`` -> ``SGLangHTTPEngine``).

Each refused update carries good tensors first (all of policy B's layer 1, the bait) and one bad tensor
last: a NaN, an int32 tensor, a wrong shape or a name the model has no parameter for. Oracle:

* the refusal names the bad tensor;
* the teacher-forced prompt logprobs afterwards are bit-identical to those before (the bait was not
  applied either), and SGLang's served ``weight_version`` did not move;
* a later valid update gives exactly the logprobs the same update gave before any refused one
  (nothing of a refused update is served later).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch

from helpers.sglang_engine import engine_prompt_logprobs, prompt_ids, server_prompt_logprobs

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

Q0 = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj"


def _session(engine, items):
    """One ``update_weights_from_tensor`` call inside a begin/end session; (ok, message) of the update."""
    ok, msg = engine.begin_weight_update()
    assert ok, msg
    try:
        return engine.update_weights_from_tensor(items)
    finally:
        ok_end, msg_end = engine.end_weight_update()
        assert ok_end, msg_end


def _bad_tensor_cases(b: dict[str, torch.Tensor]):
    """(what, bad (name, tensor), words the refusal must hold) of the tensor route."""
    norm = b["model.norm.weight"]
    nan = norm.clone()
    nan[3] = float("nan")
    down = b[f"{DOWN1}.weight"]
    return [
        ("NaN", ("model.norm.weight", nan), ("model.norm.weight", "non-finite")),
        ("unknown name", ("model.layers.1.mlp.extra_proj.weight", down.clone()), ("model.layers.1.mlp.extra_proj.weight",)),
        ("int32", ("model.norm.weight", torch.ones_like(norm, dtype=torch.int32)), ("model.norm.weight", "int32")),
        ("wrong shape", (f"{DOWN1}.weight", torch.zeros(down.shape[0], down.shape[1] + 1, dtype=down.dtype)),
         (f"{DOWN1}.weight", "shape")),
        ("wrong norm shape", ("model.norm.weight", torch.ones(norm.shape[0] + 1, dtype=norm.dtype)), ("model.norm.weight", "shape")),
        ("Inf embedding row", ("model.embed_tokens.weight", _with(b["model.embed_tokens.weight"], (5,), float("inf"))),
         ("model.embed_tokens.weight", "non-finite")),
        ("NaN q_proj", (Q0, _with(b[Q0], (2, 3), float("nan"))), (Q0, "non-finite")),
    ]


def _with(t: torch.Tensor, index, value) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


@pytest.mark.timeout(900)
def test_a_refused_update_from_tensor_changes_nothing_and_is_never_served_later(ckpt_engine, tiny_ckpt, tiny_llama_dir, tiny_llama_b_dir):
    from safetensors.torch import load_file

    prompts = prompt_ids(tiny_ckpt, n=3)
    a = load_file(str(tiny_llama_dir / "model.safetensors"))
    b = load_file(str(tiny_llama_b_dir / "model.safetensors"))
    good = [(Q0, b[Q0])]  # the later valid update: q_proj of layer 0 from B

    start = engine_prompt_logprobs(ckpt_engine, prompts)
    ok, msg = _session(ckpt_engine, good)
    assert ok, msg
    on_good = engine_prompt_logprobs(ckpt_engine, prompts)
    assert on_good != start  # the valid update moves the logprobs (else the last check could not fail)
    ok, msg = _session(ckpt_engine, [(Q0, a[Q0])])
    assert ok, msg
    before = engine_prompt_logprobs(ckpt_engine, prompts)

    bait = [(k, v) for k, v in b.items() if k.startswith("model.layers.1.")]
    for what, bad, words in _bad_tensor_cases(b):
        ok, msg = _session(ckpt_engine, bait + [bad])
        assert not ok, f"{what}: the update was accepted: {msg}"
        for w in words:
            assert w in msg, f"{what}: the refusal does not say {w!r}: {msg}"
        after = engine_prompt_logprobs(ckpt_engine, prompts)
        assert after == before, f"{what}: the refused update moved the logprobs"

    ok, msg = _session(ckpt_engine, good)
    assert ok, msg
    assert engine_prompt_logprobs(ckpt_engine, prompts) == on_good, "a refused update's tensors are served after a valid one"


def _bad_folder(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _bad_folder_cases():
    """(what, edit of B's checkpoint tensors, words the refusal must hold) of the disk route."""

    def extra(t):
        t["model.layers.1.mlp.extra_proj.weight"] = t[f"{DOWN1}.weight_bf16"].clone()

    def int32_packed(t):
        t[f"{DOWN1}.weight_packed"] = t[f"{DOWN1}.weight_packed"].to(torch.int32)

    def short_scale(t):
        t[f"{DOWN1}.weight_scale"] = t[f"{DOWN1}.weight_scale"][:, :-1].clone()

    def long_norm(t):
        t["model.norm.weight"] = torch.ones(t["model.norm.weight"].shape[0] + 1, dtype=t["model.norm.weight"].dtype)

    return [
        ("unknown name", extra, ("model.layers.1.mlp.extra_proj.weight",)),
        ("int32 weight_packed", int32_packed, (f"{DOWN1}.weight_packed", "int32")),
        ("wrong shape", short_scale, (f"{DOWN1}.weight_scale", "shape")),
        ("wrong norm shape", long_norm, ("model.norm.weight", "shape")),
    ]


@pytest.mark.timeout(1200)
def test_a_refused_update_from_disk_through_the_bridge_changes_nothing(shared_sglang, tiny_ckpt, tiny_ckpt_b, tmp_path):
    """On the session's SGLang server (conftest.py's ``shared_sglang``, on ``tiny_ckpt``), put back on
    ``tiny_ckpt`` at the end for the next file that uses it."""
    from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient
    from foursight.trainer_bridge.backends.sglang import SGLangHTTPEngine
    from foursight.trainer_bridge.launch import BridgeThread
    from foursight.trainer_bridge.server import create_app

    url = shared_sglang.running().url
    bridge = None
    prompts = prompt_ids(tiny_ckpt, n=3)
    first = server_prompt_logprobs(url, prompts)
    try:
        bridge = BridgeThread(create_app([SGLangHTTPEngine(url)])).start()
        with RolloutClient(bridge.url) as c:
            c.update_weights(version=1, path=str(tiny_ckpt_b))
            on_b = server_prompt_logprobs(url, prompts)
            c.update_weights(version=2, path=str(tiny_ckpt))
            before = server_prompt_logprobs(url, prompts)
            assert on_b != before
            for i, (what, edit, words) in enumerate(_bad_folder_cases()):
                bad = _bad_folder(tiny_ckpt_b, tmp_path / f"bad{i}", edit)
                with pytest.raises(BridgeHTTPError) as ei:
                    c.update_weights(version=3 + i, path=str(bad))
                for w in words:
                    assert w in str(ei.value), f"{what}: the refusal does not say {w!r}: {ei.value}"
                info = httpx.get(f"{url}/get_model_info", timeout=60).json()
                assert info["weight_version"] == "2", f"{what}: SGLang's weight version moved: {info}"
                assert server_prompt_logprobs(url, prompts) == before, f"{what}: the refused update moved the logprobs"
            c.update_weights(version=10, path=str(tiny_ckpt_b))
            assert server_prompt_logprobs(url, prompts) == on_b, "a refused update's tensors are served after a valid one"
    finally:
        if bridge is not None:
            bridge.stop()
        # the shared server serves tiny_ckpt again, as it started
        httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tiny_ckpt)}, timeout=300)
    assert server_prompt_logprobs(url, prompts) == first
