"""Issue 28, class 3 on the HF engine: an int32 tensor in a weight update pushed through the bridge's
real HTTP route (``POST /v1/weights`` -> ``HFEngine``) is refused naming the tensor, and the engine is
bit-identical afterwards (every parameter and buffer, and the logprobs it serves); a later valid
update carries nothing of the refused one.

Before issue 28 the HF engine copied the int32 values into the BF16 parameter (``copy_`` casts),
so an int32 ``model.norm.weight`` was served truncated to whole numbers.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient
from foursight.trainer_bridge.backends.hf import HFEngine
from foursight.trainer_bridge.launch import BridgeThread
from foursight.trainer_bridge.server import create_app
from helpers.weights import perturbed_state


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> list[str]:
    """Names whose tensors differ bit for bit (or are missing on one side)."""
    assert a.keys() == b.keys()
    return [n for n in a if n not in skip and not (a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]))]


def test_an_int32_update_through_the_bridge_is_refused_naming_it_and_changes_nothing(tiny_llama_dir, tmp_path):
    engine = HFEngine(tiny_llama_dir)
    bridge = BridgeThread(create_app([engine], sample_timeout_s=120)).start()
    try:
        with RolloutClient(bridge.url) as c:
            params = {"max_tokens": 8, "seed": 4, "temperature": 0.0}
            before = c.generate([[5, 6, 7]], params)
            weights = _snapshot(engine.model)

            # a whole new policy (every linear moved) with model.norm.weight as int32 (values 1 and 0,
            # what a truncating copy would serve); the engine must refuse it before copying anything
            state = perturbed_state(tiny_llama_dir)
            norm = weights["model.norm.weight"]
            state["model.norm.weight"] = (norm.float() * 1.7).to(torch.int32)
            save_file(state, str(tmp_path / "int32.safetensors"))
            with pytest.raises(BridgeHTTPError) as ei:
                c.update_weights(version=1, path=str(tmp_path / "int32.safetensors"))
            msg = str(ei.value)
            # the engine refused it before applying anything: the request is at fault (422), the engine is fine
            assert ei.value.status == 422, msg
            assert "tensor model.norm.weight" in msg and "int32" in msg, msg
            assert c.weight_version() == 0
            assert _same(weights, _snapshot(engine.model)) == [], "the refused update changed the engine"
            after = c.generate([[5, 6, 7]], params)
            assert after[0].token_ids == before[0].token_ids and after[0].logprobs == before[0].logprobs
            assert {r.weight_version for r in after} == {0}

            # a later valid update of the norm alone: only the norm changes (no linear of the refused update)
            new_norm = (norm.float() * 1.25).to(norm.dtype)
            save_file({"model.norm.weight": new_norm}, str(tmp_path / "norm.safetensors"))
            c.update_weights(version=2, path=str(tmp_path / "norm.safetensors"))
            now = _snapshot(engine.model)
            assert _same(weights, now, skip=("model.norm.weight",)) == [], "a refused update's tensors are served after a valid one"
            assert torch.equal(now["model.norm.weight"], new_norm)
    finally:
        bridge.stop()
