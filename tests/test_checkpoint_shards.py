"""Sharded checkpoints: written by huggingface_hub's splitter with the index transformers reads,
and read back through the index only (one strict reader, tensor_io.iter_safetensors).

Oracles: the same checkpoint written as one file, and transformers' own sharded loading."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from foursight import tensor_io
from foursight.checkpoint import quantize_model
from foursight.quantize_config import QuantizeConfig
from foursight.schema import CheckpointError
from foursight.tensor_io import SAFETENSORS_INDEX, iter_safetensors, read_tensors


@pytest.fixture(scope="module")
def single_and_sharded(tiny_llama_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("shards")
    one = quantize_model(tiny_llama_dir, base / "one", QuantizeConfig(channels="16"), progress=False).out_dir
    mp = pytest.MonkeyPatch()
    mp.setattr(tensor_io, "SHARD_BYTES", 200_000)
    try:
        many = quantize_model(tiny_llama_dir, base / "many", QuantizeConfig(channels="16"), progress=False).out_dir
    finally:
        mp.undo()
    return one, many


def test_large_checkpoints_are_sharded_with_an_index_and_read_back_equal(single_and_sharded):
    one, many = single_and_sharded
    files = sorted(p.name for p in many.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((many / SAFETENSORS_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    a, b = read_tensors(one), read_tensors(many)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for f in files:  # every shard says what it is
        from safetensors import safe_open

        with safe_open(str(many / f), framework="pt") as h:
            assert h.metadata()["quant_method"] == "foursight"


def test_transformers_loads_the_sharded_checkpoint_like_the_single_file(single_and_sharded):
    from transformers import AutoModelForCausalLM

    import foursight  # noqa: F401 - the quantizer

    one, many = single_and_sharded
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(one).eval()(ids).logits
        lb = AutoModelForCausalLM.from_pretrained(many).eval()(ids).logits
    assert torch.equal(la, lb)


def test_the_reader_follows_the_index_and_names_what_is_wrong(single_and_sharded, tmp_path):
    _, many = single_and_sharded
    d = tmp_path / "ck"
    shutil.copytree(many, d)
    # a stray file the index does not list is not read (transformers does not read it either)
    save_file({"junk": torch.full((2,), float("nan"))}, str(d / "stray.safetensors"))
    assert "junk" not in dict(iter_safetensors(d))
    index = json.loads((d / SAFETENSORS_INDEX).read_text())
    name, fname = next(iter(index["weight_map"].items()))
    # a tensor in a listed file that the index does not know: a stale or mixed-up shard
    sd = load_file(str(d / fname))
    save_file({**sd, "extra.weight": torch.zeros(2)}, str(d / fname))
    with pytest.raises(CheckpointError, match=r"tensor extra\.weight .* is not in model\.safetensors\.index\.json"):
        read_tensors(d)
    save_file(sd, str(d / fname))
    # the index puts a tensor in a file that lacks it
    index["weight_map"]["model.ghost.weight"] = fname
    (d / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tensor model\.ghost\.weight: .* does not hold it"):
        read_tensors(d)
    # a listed file that does not exist
    index["weight_map"]["model.ghost.weight"] = "model-00099-of-00099.safetensors"
    (d / SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"lists model-00099-of-00099\.safetensors \(tensor model\.ghost\.weight\), which does not exist"):
        read_tensors(d)
    (d / SAFETENSORS_INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable safetensors index"):
        read_tensors(d)
