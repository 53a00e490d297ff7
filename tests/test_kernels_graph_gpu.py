"""The FourSight linear on the engine's real road on a GPU: captured as the vLLM method calls it, under
``torch.compile`` and in a CUDA graph, bit-identical to eager (issue 36 item 5).

vLLM's ``FourSightLinearMethod.apply`` calls ``foursight.quant_methods.layer_state.apply_linear(layer.foursight_state,
x, bias)``, which calls the layer's ``PreparedLinear`` (``foursight.dispatch``: the Triton backend's
``splice_linear``). vLLM compiles the model with ``torch.compile`` (fullgraph, batch dimension dynamic)
and then captures CUDA graphs per batch size, after a warm-up run at each size (where our autotuner
times its candidates). These tests do the same with several layers (dynamic and static activation
scales, bias, a chained pair), M changing between captures, and autotuning finished before capture;
the replayed outputs must equal eager outputs bit for bit. vLLM itself does not run on the device
(its wheels need another torch), hence this stand-in at the call vLLM makes.

**Autotuning, cheaply.** The autotuner is the product's own (:func:`foursight.kernels.tuning.pick_config`:
reference check, bit-stability check, timing, cache), run on every one of the 16 keys (4 layers x 4 M)
before any capture; but each key times **two candidates of the product's lists** instead of all of them:
the first two, in list order, of the kernel family given to that layer (:data:`FAMILIES`). Each layer's
family is one launch road the graphs must replay: the plain tiles (the lists' first candidates, what runs
untimed), the activation quantized inside the GEMM (one launch, static scale) and the quantizer split over
8 programs per row with the columns before or after the FP4 loop, the persistent 8-warp tiles, and the
dequantize-then-cuBLAS form (a side stream) with an explicit split-K. With the full lists (15 decode, 10 mid
candidates) one process compiled about 285 Triton variants (a candidate run compiles the launch's occupancy
estimate and the launched variant), which did not finish in 140 s on an H100
(benchmarks/results/h100-2026-12-06b-v4/README.md); with two per key it is 32 candidate runs and about 65
compilations (counted on the CPU by running the launchers with recording stand-ins for the kernels).
``FOURSIGHT_GRAPH_ALL_CANDIDATES=1`` gives every key the full lists (several minutes). A key first met
inside a capture (the autotuner would silently take the first candidate there) fails the test.

Marked ``gpu``: skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import foursight.kernels.api as fk_api  # noqa: E402
from foursight.dispatch import prepare_linear  # noqa: E402
from foursight.kernels.configs import FragmentConfig  # noqa: E402
from foursight.kernels.tuning import TUNED  # noqa: E402
from foursight.layer import quantize_weight  # noqa: E402

try:
    from foursight.quant_methods.layer_state import LayerState, apply_linear
except ImportError:  # the device copy without the engine layer's dependencies (pydantic): the same call, spelled here
    from dataclasses import dataclass

    @dataclass
    class LayerState:  # the fields apply_linear reads
        qw: object
        prepared: object
        input_global_scale: object
        act_quant: bool
        channels: object
        generation: int

    def apply_linear(state, x, bias=None):
        """``foursight.quant_methods.layer_state.apply_linear``'s body: the call vLLM's apply() makes."""
        return state.prepared(x, bias, state.input_global_scale, state.act_quant)

DEV = "cuda"
MS = (1, 4, 16, 64)
#: (N, K, k, static activation scale, bias): qkv-like, gate_up-like, o-like; "down" reads gate_up's output
LAYERS = {"qkv": (1536, 1024, 64, False, True), "gate_up": (2048, 1024, 128, True, False),
          "o": (1024, 1024, 0, False, False), "down": (1024, 2048, 128, False, False)}


def _frag(c, **want) -> bool:
    return isinstance(c, FragmentConfig) and all(getattr(c, f) == v for f, v in want.items())


#: per layer: the kernel family its keys time (the first two matching candidates of the datapath's list)
FAMILIES = {
    # the plain tiles: the lists' first candidates (what runs untimed: the first-candidate rule of configs.py)
    "qkv": lambda c: _frag(c, narrow=False, quant_in=False, persistent=False, q_split=1, cols_late=False, split_k=0),
    # decode: the activation quantized inside the GEMM (M <= 4 with this static scale: no quantizer launch);
    # mid: the quantizer over 8 programs per row, the columns before / after the FP4 loop
    "gate_up": lambda c: _frag(c, quant_in=True) or (_frag(c) and c.q_split > 1 and c.block_m > 16),
    # triton_kernels' recipe: 8 warps, persistent programs walking (tile, split)
    "o": lambda c: _frag(c, persistent=True),
    # decode: the quantizer over 8 programs per row; mid: dequantize-then-cuBLAS (a side stream), split-K 4
    "down": lambda c: (_frag(c) and c.q_split > 1 and c.block_m == 16) or not isinstance(c, FragmentConfig) or _frag(c, split_k=4),
}
ALL_CANDIDATES = os.environ.get("FOURSIGHT_GRAPH_ALL_CANDIDATES", "0") == "1"


@pytest.fixture(scope="module", autouse=True)
def family_autotuning():
    """The product's autotuner on each key, over two candidates of the layer's family (module docstring);
    it fails a key first met inside a CUDA-graph capture. Yields the keys it tuned (key -> candidates, choice)."""
    real = fk_api.pick_config
    layer_of = {(n, k_dim): name for name, (n, k_dim, *_rest) in LAYERS.items()}
    tuned = {}

    def pick(key, run, cands, interp_cfg, out=None, reference=None):
        if key in TUNED or key[0] != "linear" or (key[3], key[4]) not in layer_of:
            return real(key, run, cands, interp_cfg, out, reference)
        assert not torch.cuda.is_current_stream_capturing(), f"{key}: first met inside a CUDA-graph capture (not autotuned before)"
        layer = layer_of[(key[3], key[4])]
        if not ALL_CANDIDATES:
            cands = [c for c in cands if FAMILIES[layer](c)][:2]
            assert cands, f"{layer}, {key[1]}: no candidate of the product's list is in this layer's family"
        t = time.time()
        cfg = real(key, run, cands, interp_cfg, out, reference)
        tuned[key] = ([str(c) for c in cands], str(cfg))
        print(f"[graph autotune] {layer} {key[1]} M-bucket {key[2]}: {len(cands)} candidates, chose {cfg} ({time.time() - t:.1f} s)",
              flush=True)
        return cfg

    mp = pytest.MonkeyPatch()
    mp.setattr(fk_api, "pick_config", pick)
    yield tuned
    mp.undo()


@pytest.fixture(scope="module")
def states():
    g = torch.Generator(device=DEV).manual_seed(36)
    out = {}
    for name, (n, k_dim, k, static, has_bias) in LAYERS.items():
        w = torch.randn(n, k_dim, generator=g, device=DEV) * 0.02
        ch = torch.sort(torch.randperm(k_dim, generator=g, device=DEV)[:k]).values.to(torch.int32)
        qw = quantize_weight(w, ch)
        gs = torch.tensor([3.0], device=DEV) if static else None
        fields = dict(qw=qw, prepared=prepare_linear(qw, name), input_global_scale=gs, act_quant=True, channels=ch, generation=1)
        st = LayerState(**{f.name: fields[f.name] for f in dataclasses.fields(LayerState) if f.name in fields})
        bias = (torch.randn(n, generator=g, device=DEV) * 0.1).bfloat16() if has_bias else None
        out[name] = (st, bias)
    assert type(out["qkv"][0].prepared.backend).__name__ == "TritonBackend"
    return out


def _forward(states, xh):
    """Several layers as a decoder block calls them: qkv, o, gate_up on x, down on h (its own input: an
    activation function compiled by inductor need not round like eager's, and only FourSight's ops are
    under test)."""
    x, h = xh
    ys = [apply_linear(states[n][0], x, states[n][1]) for n in ("qkv", "o", "gate_up")]
    ys.append(apply_linear(states["down"][0], h, states["down"][1]))
    return ys


def _inputs(m: int):
    g = torch.Generator(device=DEV).manual_seed(1000 + m)
    return ((torch.randn(m, 1024, generator=g, device=DEV) * 2).bfloat16(),
            torch.nn.functional.silu(torch.randn(m, 2048, generator=g, device=DEV) * 3).bfloat16())


def _capture_and_compare(states, fn):
    eager = {}
    for m in MS:  # warm-up at every size first: the autotuner times its candidates here, never in a capture
        x = _inputs(m)
        eager[m] = [y.clone() for y in _forward(states, x)]
    graphs = {}
    for m in MS:  # M changes between captures, as an engine captures its batch sizes
        x = tuple(t.clone() for t in _inputs(m))
        fn(x)  # the compiled function's first call at this size (compilation), outside capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = fn(x)
        graphs[m] = (g, x, ys)
    for m in reversed(MS):
        g, x, ys = graphs[m]
        for t, v in zip(x, _inputs(m)):
            t.copy_(v)
        g.replay()
        torch.cuda.synchronize()
        for name, y, e in zip(("qkv", "o", "gate_up", "down"), ys, eager[m]):
            assert y.shape == e.shape and torch.equal(y, e), f"{name}, M = {m}: replayed graph differs from eager"


def test_eager_calls_repeat_bit_identical(states, family_autotuning):
    for m in MS:
        x = _inputs(m)
        a, b = _forward(states, x), _forward(states, x)
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    # every (layer, M bucket) was autotuned here, eagerly (before any capture), choosing among at least two candidates
    assert len(family_autotuning) == len(LAYERS) * len(MS), sorted(family_autotuning)
    assert all(len(c) >= 2 for c, _ in family_autotuning.values()), family_autotuning


def test_cuda_graph_matches_eager(states):
    _capture_and_compare(states, lambda x: _forward(states, x))


def _compiled_graphs() -> int:
    """How many graphs dynamo compiled so far: 0 means torch.compile ran the function eagerly (with
    ``TORCHDYNAMO_DISABLE=1`` in the environment, as the CPU suite's conftest once set it on GPU machines too)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_torch_compile_and_cuda_graph_match_eager(states):
    """torch.compile as a user writes it (graph breaks allowed), then CUDA graphs."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: _forward(states, x), dynamic=False)
    before = _compiled_graphs()
    _capture_and_compare(states, fn)
    assert _compiled_graphs() > before, "torch.compile compiled nothing: dynamo is disabled in this process"


def test_torch_compile_fullgraph_dynamic_batch_and_cuda_graph_match_eager(states):
    """vLLM's mode: fullgraph, the batch dimension dynamic (the linear is one ``foursight::splice_linear``
    custom op under compilation), then CUDA graphs per size."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x: _forward(states, x), dynamic=True, fullgraph=True)
    before = _compiled_graphs()
    _capture_and_compare(states, fn)
    assert _compiled_graphs() > before, "torch.compile compiled nothing: dynamo is disabled in this process"
