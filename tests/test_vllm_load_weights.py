"""A trainer's BF16 weight sync through vLLM's own ``model.load_weights``, into a FourSight engine.

This is the road TRL colocate and verl take (``llm.apply_model(lambda m: m.load_weights(...))``
with the learner's HF-named BF16 tensors; /work notes: trainer-loops): TRL one tensor at a time
and no post-load step, verl per bucket and then vLLM's ``process_weights_after_loading`` once.
Before this road existed, an online-mode engine accepted every tensor and kept serving the old
weights, and a checkpoint-mode engine failed inside vLLM.

Oracle: a FRESH engine loaded on the updated weights, compared bit for bit on teacher-forced
prompt logprobs (vLLM CPU is deterministic run to run here: a fresh engine reproduces its own
logprobs exactly, checked below, so the floor is 0):

* online mode (a BF16 folder with ``quantization="foursight"`` and the checkpoint's channels
  file): a fresh online engine on a BF16 folder holding the new weights;
* checkpoint mode: a fresh engine on a FourSight checkpoint whose modules are
  ``quantize_weight(new W, the checkpoint's channels)`` (the library's quantizer, the oracle of
  every engine adapter) and whose other tensors are the new ones.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from foursight.calibration import builtin_texts  # noqa: E402
from helpers.checkpoints import folder_with  # noqa: E402
from helpers.logprobs import engine_prompt_logprobs, fixed_sequences  # noqa: E402
from helpers.vllm_engine import engine_model, fresh_logprobs, make_llm  # noqa: E402

pytestmark = pytest.mark.vllm

Q0 = "model.layers.0.self_attn.q_proj.weight"
QKV0 = "model.layers.0.self_attn.qkv_proj"


def _llm(path, **kw):
    return make_llm(path, quantization="foursight", **kw)


def _new_weights(src: Path, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the BF16 folder moved (what a learner step changes): 2-D weights by 30 % of
    their std, norms by a few %. HF names, in file order (TRL sends all parameters)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in load_file(str(src / "model.safetensors")).items():
        f = t.float()
        f = f + (0.3 * f.std() if t.dim() == 2 else 0.05 * f.abs().mean()) * torch.randn(t.shape, generator=g)
        out[n] = f.to(t.dtype).contiguous()
    return out


def _ckpt_folder(ckpt: Path, dst: Path, new: dict[str, torch.Tensor]) -> Path:
    """The checkpoint with every FourSight module re-quantized from the new weights with its own
    channel set (input scales kept), every other tensor replaced."""
    from safetensors.torch import load_file, save_file

    from foursight.layer import quantize_weight
    from foursight.schema import encode_module

    shutil.copytree(ckpt, dst)
    sd = load_file(str(ckpt / "model.safetensors"))
    for name, w in new.items():
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod is not None and f"{mod}.weight_packed" in sd:
            sd.update(encode_module(mod, quantize_weight(w, sd[f"{mod}.bf16_channels"], name=mod)))
        else:
            sd[name] = w
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    """The checkpoint, two learner steps of new weights, a half-synced mix, and the fresh-load
    logprobs of each in both modes (computed before any engine under test exists)."""
    from transformers import AutoTokenizer

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    src = Path(tiny_llama_dir)
    tmp = tmp_path_factory.mktemp("load-weights")
    ckpt = quantize_model(src, tmp / "ckpt", QuantizeConfig(channels="16"), progress=False).out_dir
    os.environ["FOURSIGHT_CHANNELS_FILE"] = str(ckpt / "foursight_channels.json")
    seqs = fixed_sequences(AutoTokenizer.from_pretrained(src), builtin_texts()[:3], 32)
    new1, new2 = _new_weights(src, 1), _new_weights(src, 2)
    mixed = {**new1, Q0: new2[Q0]}  # new1, then only q_proj of layer 0 from new2 (half a fused qkv)
    ref = {"online": {}, "checkpoint": {}}
    for key, w in (("new1", new1), ("new2", new2), ("mixed", mixed)):
        ref["online"][key] = fresh_logprobs(folder_with(src, tmp / f"bf16-{key}", w), seqs, quantization="foursight")
        ref["checkpoint"][key] = fresh_logprobs(_ckpt_folder(ckpt, tmp / f"ckpt-{key}", w), seqs, quantization="foursight")
    ref["checkpoint"]["new1-again"] = fresh_logprobs(tmp / "ckpt-new1", seqs, quantization="foursight")  # run-to-run floor: a second fresh engine
    return {"src": src, "ckpt": ckpt, "seqs": seqs, "new1": new1, "new2": new2, "ref": ref}


@pytest.fixture(scope="module", params=["checkpoint", "online"])
def engine(request, setup):
    mode = request.param
    llm = _llm(setup["ckpt"] if mode == "checkpoint" else setup["src"],
               weight_transfer_config={"backend": "foursight_file"})
    yield mode, llm
    del llm
    gc.collect()


def _trl_sync(llm, weights: dict[str, torch.Tensor]) -> None:
    """TRL colocate's sync: one ``load_weights`` call per parameter, no post-load step."""

    def load(model):
        for name, t in weights.items():
            model.load_weights([(name, t)])

    llm.apply_model(load)
    llm.reset_prefix_cache()


def _verl_sync(llm, weights: dict[str, torch.Tensor], buckets: int = 3) -> None:
    """verl's sync: ``load_weights`` per bucket (buckets cut through fused layers), then vLLM's
    post-load step once."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    items = list(weights.items())
    step = -(-len(items) // buckets)
    model_config = llm.llm_engine.vllm_config.model_config

    def load(model):
        for i in range(0, len(items), step):
            model.load_weights(iter(items[i : i + step]))
        process_weights_after_loading(model, model_config, torch.device("cpu"))

    llm.apply_model(load)
    llm.reset_prefix_cache()


def test_fresh_engines_reproduce_their_logprobs_exactly(setup):
    """The floor of every comparison below: two fresh engines on the same checkpoint agree bit
    for bit, and the learner steps move the logprobs far above it."""
    ref = setup["ref"]["checkpoint"]
    assert _same(ref["new1"], ref["new1-again"])
    assert _gap(ref["new1"], ref["new2"]) > 0.1 and _gap(ref["new1"], ref["mixed"]) > 1e-3


def test_trl_per_tensor_sync_twice_equals_a_fresh_load(engine, setup):
    """One tensor at a time (fused q/k/v and gate/up arrive as separate shards), no post-load step,
    two learner steps in a row, then the second step again (idempotent): each time the engine
    equals a fresh load of the weights it was given."""
    mode, llm = engine
    ref = setup["ref"][mode]
    before = engine_prompt_logprobs(llm, setup["seqs"])
    for key in ("new1", "new2", "new2"):
        _trl_sync(llm, setup[key])
        got = engine_prompt_logprobs(llm, setup["seqs"])
        assert _same(got, ref[key]), f"{mode} after {key}: |d| {_gap(got, ref[key]):.4f} from a fresh load"
    assert _gap(got, before) > 0.1
    assert not any(m.foursight_plan.loader.stale for m in engine_model(llm).modules() if getattr(m, "foursight_plan", None))


def test_half_a_fused_layer_is_requantized_before_its_next_forward(engine, setup):
    """Only q_proj of layer 0 arrives (k_proj and v_proj keep their current weights) and no post-load
    step runs: the layer is marked stale, and the next forward re-quantizes it from the new q and
    the current k/v (never the old q): equal to a fresh load of that mix."""
    mode, llm = engine
    _trl_sync(llm, setup["new1"])
    ref = setup["ref"][mode]

    def load_q(model):
        model.load_weights([(Q0, setup["new2"][Q0])])
        layer = model.get_submodule(QKV0)
        return layer.foursight_plan.loader.stale, sorted(layer.foursight_plan.loader.pending_weight)

    assert llm.apply_model(load_q) == [(True, [0])]
    llm.reset_prefix_cache()
    got = engine_prompt_logprobs(llm, setup["seqs"])
    assert _same(got, ref["mixed"]), f"{mode}: |d| {_gap(got, ref['mixed']):.4f} from a fresh load of the mix"
    assert not engine_model(llm).get_submodule(QKV0).foursight_plan.loader.stale


def test_verl_bucketed_sync_then_post_load_equals_a_fresh_load(engine, setup):
    """verl's loop: buckets that cut through fused layers, then vLLM's post-load step once; twice."""
    mode, llm = engine
    ref = setup["ref"][mode]
    for key in ("new2", "new1"):
        _verl_sync(llm, setup[key])
        got = engine_prompt_logprobs(llm, setup["seqs"])
        assert _same(got, ref[key]), f"{mode} after {key}: |d| {_gap(got, ref[key]):.4f} from a fresh load"


def test_sync_updates_the_execution_state_in_place(engine, setup):
    """The re-quantized state is written into the same storage (what a captured CUDA graph reads):
    the tensors of every FourSight layer keep their addresses across a sync."""
    mode, llm = engine

    def ptrs(model):
        from foursight.quant_methods.layer_state import state_tensors

        out = {}
        for n, m in model.named_modules():
            if getattr(m, "foursight_plan", None) is not None:
                ts: list[torch.Tensor] = []
                state_tensors(m.foursight_state, ts, set())
                out[n] = [t.data_ptr() for t in ts]
        return out

    (a,) = llm.apply_model(ptrs)
    _trl_sync(llm, setup["new2"])
    (b,) = llm.apply_model(ptrs)
    assert a == b
    assert _same(engine_prompt_logprobs(llm, setup["seqs"]), setup["ref"][mode]["new2"])


def test_a_bad_tensor_is_refused_naming_it(engine, setup):
    """A non-float or mis-shaped weight is refused with an error naming the tensor."""
    from foursight.schema import CheckpointError

    mode, llm = engine
    w = setup["new1"][Q0]

    def load(t):
        def fn(model):
            try:
                model.load_weights([(Q0, t)])
            except CheckpointError as e:
                return str(e)
            return None
        return fn

    (msg,) = llm.apply_model(load(w.to(torch.int32)))
    assert msg and "q_proj.weight" in msg and "dtype" in msg
    (msg,) = llm.apply_model(load(w[:, :-16].contiguous()))
    assert msg and "q_proj.weight" in msg


# ---- issue 28: a refused update changes nothing, on every vLLM route, and is never served later ----

def _bad_updates(new: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A whole update (every tensor) whose LAST tensor is bad, so a route that applied tensors
    one by one would already have changed the engine when it met it."""
    last = "model.layers.1.mlp.down_proj.weight"
    good = {n: t for n, t in new.items() if n != last}
    w = new[last]
    nan = w.clone()
    nan[3, 5] = float("nan")
    return {"shape": {**good, last: w[:, :-16].contiguous()}, "nan": {**good, last: nan}, "int32": {**good, last: w.to(torch.int32)},
            "name": {**good, last: w, "model.layers.1.mlp.no_such_proj.weight": w}}


@pytest.mark.parametrize("route", ["apply_weight_update", "native", "collective_rpc"])
def test_a_refused_update_changes_nothing_and_is_never_served_later(engine, setup, route, tmp_path):
    """Each bad update is refused before anything of it is loaded (the logprobs stay bit-identical,
    the weight version stays), and the next good update equals a fresh load of ITS weights (nothing
    of the refused one shows up under the later version)."""
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

    from foursight.quant_methods.vllm_weight_update import apply_weight_update

    mode, llm = engine
    _trl_sync(llm, setup["new1"])
    before = engine_prompt_logprobs(llm, setup["seqs"])
    if route == "native":
        llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))

    def push(weights: dict[str, torch.Tensor], version: int) -> None:
        if route == "apply_weight_update":
            llm.apply_model(lambda m: apply_weight_update(m, list(weights.items())))
            return
        path = tmp_path / f"u{version}.safetensors"
        save_file({n: t.contiguous() for n, t in weights.items()}, str(path))
        if route == "collective_rpc":
            llm.collective_rpc("foursight_update_weights", args=(str(path), version))
        else:
            llm.start_weight_update()
            llm.update_weights(WeightTransferUpdateRequest(update_info={"path": str(path)}))  # a bad file is refused here
            llm.finish_weight_update()

    for what, bad in _bad_updates(setup["new2"]).items():
        with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.(down|no_such)_proj\.weight"):
            push(bad, 7)
        llm.reset_prefix_cache()
        assert _same(engine_prompt_logprobs(llm, setup["seqs"]), before), f"{route}: the refused {what} update changed the engine"
        if route == "collective_rpc":
            assert llm.collective_rpc("foursight_weight_version") != [7]
    push(setup["new2"], 8)
    llm.reset_prefix_cache()
    assert _same(engine_prompt_logprobs(llm, setup["seqs"]), setup["ref"][mode]["new2"])


# ---- issue 38 item 3: a diverged learner step is refused on the trainers' own road ----

def _diverged(new: dict[str, torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """One bad tensor per case, as a diverged learner step hands it over (HF names)."""
    norm, emb = new["model.norm.weight"], new["model.embed_tokens.weight"]
    nan_norm = norm.clone()
    nan_norm[7] = float("nan")
    inf_row = emb.clone()
    inf_row[42] = float("inf")
    nan_q = new[Q0].clone()
    nan_q[2, 3] = float("nan")
    return {"nan norm": ("model.norm.weight", nan_norm), "inf embedding row": ("model.embed_tokens.weight", inf_row),
            "nan q_proj": (Q0, nan_q), "int32 norm": ("model.norm.weight", norm.to(torch.int32)),
            "mis-shaped norm": ("model.norm.weight", norm[:-1].contiguous())}


def test_a_diverged_step_is_refused_on_the_trainers_road(engine, setup):
    """TRL colocate's per-tensor ``load_weights`` and verl's bucketed one (the bad tensor last in
    its bucket), in both modes: every bad tensor (norm, embedding, FourSight layer; NaN, Inf, int32,
    wrong shape) is refused with an error naming it before anything is written, and the engine
    keeps serving with bit-identical logprobs. Before the fix the NaN norm, the Inf embedding row
    and the int32 norm were accepted (non-finite logprobs, a wedged engine, 66 nats moved) and an
    online layer's NaN wedged the engine."""
    from vllm import SamplingParams

    mode, llm = engine
    _trl_sync(llm, setup["new1"])
    before = engine_prompt_logprobs(llm, setup["seqs"])
    bucket = [(n, t) for n, t in setup["new2"].items() if n.startswith("model.layers.1.")]
    for what, (name, bad) in _diverged(setup["new2"]).items():
        for road in ("trl", "verl"):
            items = [(name, bad)] if road == "trl" else [*bucket, (name, bad)]
            with pytest.raises(Exception, match=name.replace(".", r"\.")):
                llm.apply_model(lambda m: m.load_weights(iter(items)))
            llm.reset_prefix_cache()
            got = engine_prompt_logprobs(llm, setup["seqs"])
            assert _same(got, before), f"{mode}/{road}: the refused {what} changed the engine (|d| {_gap(got, before):.3g})"
    (out,) = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_each_layer_is_requantized_once_per_sync(engine, setup):
    """Issue 37: however many ``load_weights`` calls feed a layer (TRL: one per shard; verl: buckets
    that cut through fused layers), each FourSight layer is processed exactly once per sync, and the
    result equals a fresh load."""
    mode, llm = engine

    def generations(model):
        return {n: m.foursight_plan.generation for n, m in model.named_modules() if getattr(m, "foursight_plan", None)}

    for sync, key in ((_trl_sync, "new1"), (_verl_sync, "new2")):
        (a,) = llm.apply_model(generations)
        sync(llm, setup[key])
        (b,) = llm.apply_model(generations)
        assert {n: b[n] - a[n] for n in a} == {n: 1 for n in a}, f"{mode} {sync.__name__}"
        assert _same(engine_prompt_logprobs(llm, setup["seqs"]), setup["ref"][mode][key])


def test_the_engine_holds_one_copy_of_each_layers_weight(engine, setup):
    """Issue 36 item 6, measured inside the running engine: every tensor a FourSight layer keeps (its
    parameters and its execution state, each storage once) against ``kernels.resident_bytes`` of the
    layer's execution form. The CPU reference backend's dequantized float32 cache (``w_deq``, the CPU
    forward's, which no GPU backend holds) is left out and reported apart. Checkpoint mode: the
    engine holds at most the resident form's bytes (before, the state kept a concatenated copy of
    each fused layer's checkpoint tensors beside the parameters: about 2x). Online mode: the BF16
    ``weight`` (the source every sync writes) plus at most one quantized copy."""
    from foursight.kernels.prepared import prepare_weight, resident_bytes
    from foursight.quant_methods.layer_state import state_tensors

    mode, llm = engine

    def measure(model):
        rows = []
        for n, m in model.named_modules():
            plan = getattr(m, "foursight_plan", None)
            if plan is None:
                continue
            params = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in m.parameters(recurse=False) if t.numel()}
            st = m.foursight_state
            cache = st.prepared.state[1] if st.prepared.backend.name == "reference" else None
            ts: list[torch.Tensor] = []
            state_tensors(st, ts, set())
            state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts
                     if t.numel() and (cache is None or t.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr())}
            extra = sum(b for p, b in state.items() if p not in params)
            rows.append((n, sum(params.values()), extra, resident_bytes(prepare_weight(st.qw, n)),
                         0 if cache is None else cache.untyped_storage().nbytes()))
        return rows

    (rows,) = llm.apply_model(measure)
    engine_bytes = sum(p + e for _, p, e, _, _ in rows)
    resident = sum(r for *_, r, _ in rows)
    print(f"{mode}: {len(rows)} layers, engine {engine_bytes} B (parameters {sum(p for _, p, *_ in rows)} B + state "
          f"{sum(e for _, _, e, _, _ in rows)} B), resident_bytes {resident} B, CPU reference cache {sum(c for *_, c in rows)} B")
    if mode == "checkpoint":
        assert engine_bytes <= resident, rows[:3]
    else:
        assert all(e <= r for _, _, e, r, _ in rows), rows[:3]
