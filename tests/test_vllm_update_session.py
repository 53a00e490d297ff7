"""One weight update, one check (issue 54 item 4): every vLLM road (the in-memory ``apply_weight_update``, the
worker's file route ``foursight_update_weights``, the native ``foursight_file`` transfer) runs one
:class:`~foursight.quant_methods.vllm_weight_update.UpdateSession`, which reads each tensor once and checks it
once before anything loads. Before, the file route checked every tensor three times (the reader's float32
finiteness pass, the worker's ``check_update``, ``apply_weight_update``'s ``check_update`` again).

A small stand-in model (vLLM's name mapping, a ``load_weights`` that records what it was given) keeps this fast;
the real engines' roads are tests/test_vllm_load_weights.py, test_vllm_weight_transfer.py and
test_vllm_bf16_update.py. The spy counts every finiteness pass the roads can take: the reader's
(:func:`foursight.tensor_io.iter_safetensors` with ``check``) and the update check's
(:func:`foursight.schema.finite_flag`, through ``update_check``)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("vllm")

from foursight.quant_methods import update_check  # noqa: E402
from foursight.quant_methods.vllm_weight_sync import FourSightWorkerExtension  # noqa: E402
from foursight.quant_methods.vllm_weight_update import UpdateSession, apply_weight_update, run_update  # noqa: E402
from foursight.quant_methods.weight_authority import RefusedUpdate  # noqa: E402
from foursight.schema import REFUSED_PREFIX, CheckpointError  # noqa: E402
from foursight import tensor_io  # noqa: E402


class Model(torch.nn.Module):
    """Two plain parameters under HF names and a ``load_weights`` that copies and records."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16), requires_grad=False)
        self.model.embed = torch.nn.Module()
        self.model.embed.weight = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.bfloat16), requires_grad=False)
        self.loaded: list[list[str]] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        names = []
        for name, t in weights:
            params[name].data.copy_(t)
            names.append(name)
        self.loaded.append(names)
        return set(names)


def _update() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "model.embed.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16)}


@pytest.fixture
def passes(monkeypatch) -> Counter:
    """Finiteness passes per tensor (by its data pointer: the tensors a road read), both kinds counted."""
    count: Counter = Counter()
    real_flag, real_check = update_check.finite_flag, tensor_io.check_finite

    def flag(t):
        count[t.data_ptr()] += 1
        return real_flag(t)

    def check(name, t, where=""):
        count[t.data_ptr()] += 1
        return real_check(name, t, where)

    monkeypatch.setattr(update_check, "finite_flag", flag)
    monkeypatch.setattr(tensor_io, "check_finite", check)
    return count


def _worker(model):
    class Worker(FourSightWorkerExtension):
        def _foursight_model(self):
            return model

    return Worker()


def _file_engine(model):
    from foursight.quant_methods.vllm_weight_transfer import FourSightFileEngine

    return FourSightFileEngine(None, SimpleNamespace(parallel_config=None, model_config=None), torch.device("cpu"), model)


def _native(model, *paths) -> None:
    eng = _file_engine(model)
    eng.start_weight_update()
    for p in paths:
        eng.update_weights({"path": str(p)})
    eng.finish_weight_update()


def test_each_road_checks_each_tensor_once(tmp_path, passes):
    """The file route, the native transfer (two files) and apply_weight_update: every tensor passes one
    finiteness check, and what loads is what was read."""
    new = _update()
    path = tmp_path / "u.safetensors"
    save_file(new, str(path))
    save_file({"model.norm.weight": new["model.norm.weight"]}, str(tmp_path / "a.safetensors"))
    save_file({"model.embed.weight": new["model.embed.weight"]}, str(tmp_path / "b.safetensors"))
    roads = {
        "file": lambda m: _worker(m).foursight_update_weights(str(path), 3),
        "native": lambda m: _native(m, tmp_path / "a.safetensors", tmp_path / "b.safetensors"),
        "apply_weight_update": lambda m: apply_weight_update(m, [(n, t.clone()) for n, t in new.items()]),
    }
    for road, push in roads.items():
        passes.clear()
        model = Model()
        push(model)
        assert sorted(n for call in model.loaded for n in call) == sorted(new), road
        assert all(torch.equal(p, new[n]) for n, p in model.named_parameters()), road
        assert len(passes) == len(new) and set(passes.values()) == {1}, f"{road}: finiteness passes per tensor {dict(passes)}"


def test_the_file_route_refuses_a_nan_before_loading_naming_tensor_and_file(tmp_path):
    bad = _update()
    bad["model.embed.weight"][3, 4] = float("nan")
    path = tmp_path / "bad.safetensors"
    save_file(bad, str(path))
    model = Model()
    with pytest.raises(RefusedUpdate, match=rf"^{REFUSED_PREFIX}tensor model\.embed\.weight in .*bad\.safetensors holds 1 non-finite"):
        _worker(model).foursight_update_weights(str(path), 3)
    assert model.loaded == []
    with pytest.raises(RefusedUpdate, match=rf"^{REFUSED_PREFIX}.*truncated or unreadable"):
        trunc = tmp_path / "trunc.safetensors"
        trunc.write_bytes(path.read_bytes()[:100])
        _worker(model).foursight_update_weights(str(trunc), 3)
    assert model.loaded == []


def test_a_session_with_a_refused_part_loads_nothing(tmp_path):
    """The native transfer's road: a refused file refuses the whole update at its finish; the parts checked
    before it are not loaded."""
    new = _update()
    save_file({"model.norm.weight": new["model.norm.weight"]}, str(tmp_path / "a.safetensors"))
    save_file({"model.no_such.weight": new["model.norm.weight"]}, str(tmp_path / "b.safetensors"))
    model = Model()
    eng = _file_engine(model)
    eng.start_weight_update()
    eng.update_weights({"path": str(tmp_path / "a.safetensors")})
    with pytest.raises(RefusedUpdate, match=r"unexpected tensor model\.no_such\.weight"):
        eng.update_weights({"path": str(tmp_path / "b.safetensors")})
    with pytest.raises(RuntimeError, match=r"foursight_file: the update was refused, nothing of it is loaded \(.*no_such"):
        eng.finish_weight_update()
    assert model.loaded == []
    session = UpdateSession(model)
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        session.receive([("model.norm.weight", torch.ones(3, dtype=torch.bfloat16))])
    assert session.refused and session.parts == []
    with pytest.raises(RuntimeError, match="refused"):
        session.apply()
    assert model.loaded == []


def test_run_update_turns_a_refusal_into_the_callers_error():
    model = Model()
    bad = [("model.norm.weight", torch.full((64,), float("inf"), dtype=torch.bfloat16))]
    with pytest.raises(KeyError, match="model.norm.weight"):
        run_update(model, [bad], refusal=lambda e: KeyError(str(e)))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        run_update(model, [bad])
    assert model.loaded == []
    assert run_update(model, [_update().items()]) == {"updated_tensors": 2, "requantized_layers": 0}
