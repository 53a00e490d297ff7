"""The broadcast road (TRL's / vLLM's NCCL weight transfer) into FourSight's re-quantization, on the CPU with
Gloo in place of NCCL (:mod:`foursight.quant_methods.weight_broadcast`; the communicator is the only part
that differs, docs/scale-out.md).

A learner process (``helpers/broadcast_learner.py``) is rank 0 of the group and broadcasts each update
packed as vLLM's producer packs it; the in-process vLLM CPU engine (``vllm.LLM`` with the FourSight worker
extension, as users write it) receives it through both entry points: vLLM 0.32's weight-transfer API with
the ``foursight_nccl`` backend, and the worker extension's ``foursight_broadcast_*`` methods (the route of
vLLM 0.26 on the device). Oracles: a FRESH engine on a folder holding the new weights (bit-for-bit
teacher-forced logprobs), and the engine's own logprobs before a refused update (unchanged, bit for bit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.calibration import builtin_texts  # noqa: E402
from foursight.quant_methods.weight_broadcast import (  # noqa: E402
    BroadcastInitInfo, BroadcastUpdateInfo, packed_chunks, update_info_of)
from helpers.checkpoints import folder_with  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from helpers.vllm_engine import close, fresh_logprobs, make_llm  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = pytest.mark.vllm

LEARNER = Path(__file__).parent / "helpers" / "broadcast_learner.py"
#: small chunks, so that an update travels in several broadcasts and tensors straddle no chunk bound by luck
BUFFER = 1 << 16


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_receivers_chunks_are_vllms_producers():
    """The receiver cuts an update into the chunks vLLM's packed producer sends (its own ``pack_tensors``), for
    several buffer sizes, tensors larger than a buffer included: else the two ends would split the stream differently."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.randn(s, generator=g).to(dt)) for i, (s, dt) in enumerate(
        [((3, 5), torch.bfloat16), ((100,), torch.float32), ((7, 7), torch.bfloat16), ((2000,), torch.bfloat16), ((1,), torch.float16),
         ((64, 3), torch.float32)])]
    meta = BroadcastUpdateInfo.parse(update_info_of(named)).metadata()
    for size in (1, 50, 300, 4000, 1 << 20):
        it, sent = iter(named), []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vLLM warns of a tensor larger than the buffer: that case is meant here
            while (chunk := pack_tensors(it, lambda item: item[1], size)) is not None:
                sent.append((chunk.names, int(chunk.packed_tensor.numel())))
        got = [([c[0] for c in ch], sum(c[3] for c in ch)) for ch in packed_chunks(meta, size)]
        assert got == sent, size
        assert len(sent) > 1 or size == 1 << 20


def test_malformed_messages_are_refused_naming_the_field():
    ok = {"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 2}
    assert BroadcastInitInfo.parse(json.dumps(ok)).world_size == 2
    for bad, field in (({**ok, "world_size": 0}, "init_info.world_size"), ({**ok, "colour": 1}, "init_info.colour"),
                       ({**ok, "communicator": "mpi"}, "init_info.communicator"),
                       ({"nccl_unique_id_b64": "AAAA", "rank_offset": 1, "world_size": 2}, "init_info.nccl_unique_id_b64"),
                       ({k: v for k, v in ok.items() if k != "master_port"}, "master_port")):
        with pytest.raises(ValueError, match=field):
            BroadcastInitInfo.parse(bad)
    info = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}
    assert [m[2] for m in BroadcastUpdateInfo.parse(info).metadata()] == [torch.bfloat16, torch.float32]
    for bad, what in (({**info, "shapes": [[2, 3]]}, "2 names, 2 dtype_names and 1 shapes"), ({**info, "shapes": [[2, -3], [4]]}, "tensor a"),
                      ({**info, "dtype_names": ["bfloat16", "floaty"]}, "tensor b: 'floaty'")):
        with pytest.raises(ValueError, match=what):
            BroadcastUpdateInfo.parse(bad).metadata()


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))
    return {"file": str(path), "names": list(tensors)}


def test_a_learner_broadcasts_over_gloo_into_the_engine(tiny_llama_dir, tiny_ckpt, tmp_path):
    """Online mode (the BF16 folder, ``quantization="foursight"``, the checkpoint's channels). Through vLLM's
    weight-transfer API (``foursight_nccl``): the new weights -> the engine equals a fresh engine on them, bit for
    bit; a NaN and a mis-shaped tensor are refused at ``update_weights`` naming the tensor, and the engine keeps
    serving those logprobs bit for bit. Through the worker extension's ``collective_rpc`` methods: the original
    weights back -> bit-identical to the engine before any update, tagged with the version given; a NaN refused,
    version and logprobs unchanged, and its finish refused."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    from foursight.quant_methods.config import foursight_layers
    from foursight.trainer_bridge.launch import free_port

    src = Path(tiny_llama_dir)
    os.environ["FOURSIGHT_CHANNELS_FILE"] = str(Path(tiny_ckpt) / "foursight_channels.json")
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(src), builtin_texts()[:3], 32)
    orig = load_file(str(src / "model.safetensors"))
    new = {**orig, **perturbed_state(src, seed=11)}
    last = "model.layers.1.mlp.down_proj.weight"  # the last tensor bad: a road applying tensor by tensor would have changed the engine
    nan = {**new, last: new[last].clone()}
    nan[last][2, 3] = float("nan")
    shape = {**new, last: new[last][:, :-16]}
    nan_norm = {**orig, "model.norm.weight": torch.full_like(orig["model.norm.weight"], float("inf"))}
    ref_new = fresh_logprobs(folder_with(src, tmp_path / "new", new), seqs, quantization="foursight")

    p_native, p_rpc = free_port(), free_port()
    updates = {k: _write(tmp_path / f"{k}.safetensors", t) for k, t in
               (("new", new), ("nan", nan), ("shape", shape), ("orig", orig), ("nan_norm", nan_norm))}
    spec = {"phases": [{"port": p_native, "world_size": 2, "buffer_size_bytes": BUFFER, "updates": [updates[k] for k in ("new", "nan", "shape")]},
                       {"port": p_rpc, "world_size": 2, "buffer_size_bytes": BUFFER, "updates": [updates[k] for k in ("orig", "nan_norm")]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    learner = subprocess.Popen([sys.executable, str(LEARNER), str(tmp_path / "spec.json")], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    def init_info(port: int) -> dict:
        return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "packed": True,
                "packed_buffer_size_bytes": BUFFER}

    def announce(key: str) -> dict:
        sd = load_file(updates[key]["file"])
        return update_info_of((n, sd[n]) for n in updates[key]["names"])

    llm = make_llm(src, quantization="foursight", weight_transfer_config={"backend": "foursight_nccl"})
    try:
        before = engine_prompt_logprobs(llm, seqs)
        # vLLM 0.32's weight-transfer API, the messages TRL and vLLM's NCCL trainer engine send
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info(p_native)))
        llm.start_weight_update()
        llm.update_weights(WeightTransferUpdateRequest(update_info=announce("new")))
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        after = engine_prompt_logprobs(llm, seqs)
        assert _same(after, ref_new), "the broadcast update differs from a fresh engine on the new weights"
        assert not _same(after, before)
        for key, match in (("nan", rf"{last}.*non-finite"), ("shape", rf"{last}.*shape")):
            llm.start_weight_update()
            with pytest.raises(Exception, match=match):
                llm.update_weights(WeightTransferUpdateRequest(update_info=announce(key)))
            llm.reset_prefix_cache()
            assert _same(engine_prompt_logprobs(llm, seqs), after), f"the refused {key} update changed the engine"
        # the worker extension's methods (any vLLM with the extension): a second group
        ranks = llm.collective_rpc("foursight_broadcast_init", args=(json.dumps(init_info(p_rpc)),))
        assert ranks == [{"rank": 1, "world_size": 2, "communicator": "gloo"}]
        llm.collective_rpc("foursight_broadcast_start")
        assert llm.collective_rpc("foursight_broadcast_receive", args=(json.dumps(announce("orig")),)) == [{"received": len(orig)}]
        done = llm.collective_rpc("foursight_broadcast_finish", args=("5",), kwargs={"weights_id": "w5"})
        layers = llm.apply_model(lambda m: len(foursight_layers(m)))[0]
        assert done[0]["version"] == 5 and done[0]["updated_tensors"] == len(orig) and done[0]["requantized_layers"] == layers > 0
        llm.reset_prefix_cache()
        assert _same(engine_prompt_logprobs(llm, seqs), before), "back on the original weights, the engine differs from itself before"
        assert llm.collective_rpc("foursight_engine_state")[0]["weights_id"] == "w5"
        llm.collective_rpc("foursight_broadcast_start")
        with pytest.raises(Exception, match=r"model\.norm\.weight.*non-finite"):
            llm.collective_rpc("foursight_broadcast_receive", args=(json.dumps(announce("nan_norm")),))
        with pytest.raises(Exception, match="refused, nothing of it is loaded"):
            llm.collective_rpc("foursight_broadcast_finish", args=("6",))
        llm.reset_prefix_cache()
        assert llm.collective_rpc("foursight_weight_version") == [5]
        assert _same(engine_prompt_logprobs(llm, seqs), before)
        llm.collective_rpc("foursight_broadcast_close")
    finally:
        close(llm)
        try:
            out, _ = learner.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            learner.kill()
            out, _ = learner.communicate()
    assert learner.returncode == 0 and "LEARNER DONE" in out, out[-3000:]


def test_a_join_is_refused_before_any_connection(monkeypatch):
    """What the engine refuses at ``init`` before it connects anywhere (each answer names the cause and starts
    with the refusal prefix, which the bridge answers 422): a served engine (``VLLM_SERVER_DEV_MODE=1``) without
    its token or with another, NCCL on a CPU engine, and a world with no rank left for the worker."""
    from foursight.quant_methods.weight_authority import RefusedUpdate
    from foursight.quant_methods.weight_broadcast import BroadcastReceiver
    from foursight.schema import ENV_WEIGHTS_TOKEN, REFUSED_PREFIX

    info = {"master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2}  # port 9: nothing listens
    from foursight.quant_methods.vllm_weight_update import UpdateSession

    r = BroadcastReceiver("cpu", UpdateSession)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv(ENV_WEIGHTS_TOKEN, "secret")
    for given, match in ((None, ENV_WEIGHTS_TOKEN), ("wrong", ENV_WEIGHTS_TOKEN)):
        with pytest.raises(RefusedUpdate, match=match) as ei:
            r.init({**info, "token": given}, 0)
        assert str(ei.value).startswith(REFUSED_PREFIX)
    for bad, worker, match in (({**info, "communicator": "nccl"}, 0, "nccl needs a CUDA engine"),
                               (info, 1, "init_info.world_size: 2 leaves no rank"), ({**info, "world_size": "2"}, 0, "init_info.world_size")):
        with pytest.raises(RefusedUpdate, match=match):
            r.init({**bad, "token": "secret"}, worker)
    assert r.comm is None
    with pytest.raises(RuntimeError, match="before init_weight_transfer_engine"):
        r.receive(torch.nn.Linear(1, 1), {"names": [], "dtype_names": [], "shapes": []})
