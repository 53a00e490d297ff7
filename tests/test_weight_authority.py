"""quant_methods/weight_authority.py without an engine (issue 38 item 1): who may load an update into a
served vLLM engine, and from where. The engine-side behaviour through vLLM's own routes is in
tests/test_bridge_vllm_authority.py and tests/test_vllm_weight_transfer.py."""

from __future__ import annotations

import pytest

from foursight.quant_methods.weight_authority import WeightsRefused, authorize_update
from foursight.schema import REFUSED_PREFIX


def test_only_the_token_and_only_the_weights_folder_on_a_served_engine(tmp_path):
    folder, outside = tmp_path / "policy", tmp_path / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    (folder / "step1.safetensors").write_bytes(b"x")
    (outside / "secret.safetensors").write_bytes(b"x")
    (folder / "link.safetensors").symlink_to(outside / "secret.safetensors")  # inside by name, outside once resolved
    served = {"VLLM_SERVER_DEV_MODE": "1", "FOURSIGHT_WEIGHTS_TOKEN": "t0k", "FOURSIGHT_WEIGHTS_DIR": str(folder)}
    assert authorize_update(folder / "step1.safetensors", "t0k", served) == str((folder / "step1.safetensors").resolve())
    answers = {}
    for what, (path, token, env) in {
        "no token": (folder / "step1.safetensors", None, served),
        "wrong token": (folder / "step1.safetensors", "t0K", served),
        "engine without a token": (folder / "step1.safetensors", "t0k", {**served, "FOURSIGHT_WEIGHTS_TOKEN": ""}),
        "outside": (outside / "secret.safetensors", "t0k", served),
        "missing": (outside / "missing.safetensors", "t0k", served),
        "symlink out": (folder / "link.safetensors", "t0k", served),
        "dotdot": (folder / ".." / "elsewhere" / "secret.safetensors", "t0k", served),
        "a folder": (folder, "t0k", served),
    }.items():
        with pytest.raises(WeightsRefused) as ei:
            authorize_update(path, token, env)
        assert str(ei.value).startswith(REFUSED_PREFIX) and str(outside) not in str(ei.value), what
        answers[what] = str(ei.value)
    # one answer for every file the caller may not load: nothing is learnt about the engine's files
    assert len({answers[w] for w in ("outside", "missing", "symlink out", "dotdot", "a folder")}) == 1


def test_an_in_process_engine_needs_no_token_whatever_its_environment(tmp_path):
    """vllm.LLM in the caller's process (TRL colocate, verl, foursight rl) is reachable by that process only:
    no check, even in a shell that exported the token for a served engine."""
    f = tmp_path / "u.safetensors"
    assert authorize_update(f, None, {}) == str(f)
    assert authorize_update(f, None, {"FOURSIGHT_WEIGHTS_TOKEN": "t0k", "VLLM_SERVER_DEV_MODE": "0"}) == str(f)
