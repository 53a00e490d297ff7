#!/usr/bin/env python
"""The bytes a FourSight vLLM engine really keeps for its linear layers (issue 36 item 6), measured inside
the engine, next to the BF16 engine's bytes for the same linears.

A FourSight checkpoint of SmolLM2-135M (k = 32, the weight-sync benchmark's cached one) is loaded with
vLLM's offline ``LLM`` API on the CPU build, and inside the worker (``llm.apply_model``) every FourSight
linear's tensors are counted once per storage, in three groups:

* **params**: the layer's registered parameters and buffers (the checkpoint tensors the loaders write: the
  packed FP4 codes, their E4M3 scales, ``W[:, S]``, the global scales, the channels; online mode would add
  its BF16 weight);
* **state**: what the layer's execution state (``layer.foursight_state``) holds beyond those, its
  ``QuantizedWeight`` (the plugin state) and the backend's prepared form. On the CPU the backend is the
  PyTorch reference, whose prepared form is the dequantized weight in float32 (a CPU-only speed choice);
  a GPU engine holds the fragment form there instead, whose bytes are
  ``foursight.kernels.api.resident_bytes`` (docs/kernels.md: 0.307x BF16 for Llama-3.1-8B's linears).

Then, in the same engine, every FourSight linear is re-processed with the ``triton`` backend (the plugin's
own ``refresh_layer``, the step that runs after a load or an update): its execution form is then the
fragment form a GPU engine holds, built on the CPU (no kernel runs), and the plugin releases the
checkpoint codes and block scales it can rebuild from it (issue 36 item 6, ``quant_methods/plan.py``).
The same three groups are counted again: that row is what a GPU engine keeps, measured, not a formula
(the formula is printed beside it as a check).

So the file says, from the engine itself, whether the plugin keeps a second copy of the checkpoint
tensors beside its execution form.

Usage::

    python benchmarks/kernels/engine_bytes.py --out benchmarks/results/engine_bytes
    python benchmarks/kernels/engine_bytes.py --llama8b-layers 2 --out benchmarks/results/engine_bytes_llama8b

``--llama8b-layers N`` measures Llama-3.1-8B's decoder linears themselves (hidden 4096, intermediate 14336,
32 / 8 heads of 128; N random-weight layers, a 512-token vocabulary, k = 128 BF16 channels per input group,
calibrated on the built-in texts): their K needs no padding, so the engine's bytes at the shapes that issue 36's
target names are measured, not derived from SmolLM2's by formula. The model and checkpoint are cached under
``foursight.cache.cache_dir()/bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import cpu_model, git_commit  # noqa: E402  (benchmarks/common.py)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: apply_model reaches it


def _tensors(obj, seen: set[int] | None = None):
    """Every tensor reachable from ``obj`` through tuples, lists, dicts and dataclasses."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("foursight"):
        yield from _tensors(vars(obj), seen)


def _storages(tensors) -> dict[int, int]:
    """Storage pointer -> bytes, one entry per storage (views of one storage count once)."""
    out: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def count(model) -> dict:
    """Per-group bytes of every FourSight linear of ``model`` (runs inside the vLLM worker)."""
    from foursight.quant_methods.config import foursight_layers

    layers, params_b, qw_b, prepared_b, bf16_b, shapes, backends, released = 0, 0, 0, 0, 0, [], set(), 0
    for mod in foursight_layers(model).values():
        state = mod.foursight_state
        layers += 1
        backends.add(type(state.prepared.backend).__name__)
        released += mod.foursight_plan.loader.released is not None
        p = _storages([*mod.parameters(recurse=False), *mod.buffers(recurse=False)])
        q = _storages(_tensors(state.qw))
        r = _storages(_tensors(state.prepared.state))
        params_b += sum(p.values())
        qw_b += sum(b for ptr, b in q.items() if ptr not in p)
        prepared_b += sum(b for ptr, b in r.items() if ptr not in p and ptr not in q)
        n, k = state.qw.out_features, state.qw.in_features
        bf16_b += 2 * n * k
        shapes.append((n, k, int(state.qw.bf16_channels.numel())))
    return {"layers": layers, "shapes": shapes, "params_bytes": params_b, "qw_beyond_params_bytes": qw_b,
            "prepared_beyond_bytes": prepared_b, "bf16_bytes": bf16_b,
            "backend": ", ".join(sorted(backends)), "layers_released": released}


def count_fragment_form(model) -> dict:
    """Re-process every FourSight linear of ``model`` with the ``triton`` backend (its fragment form, built
    on the CPU; the plugin then releases the checkpoint codes it can rebuild) and :func:`count` again. The
    engine cannot run a forward on the CPU after this (the kernels need a GPU): measure, then drop it."""
    from foursight.dispatch import TritonBackend
    from foursight.quant_methods.config import foursight_layers
    from foursight.quant_methods.plan import refresh_layer

    for mod in foursight_layers(model).values():
        mod.foursight_plan.backend = TritonBackend()
        refresh_layer(mod, mod.quant_method.tp_context(mod))
    return count(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="FourSight checkpoint (default: the weight-sync benchmark's SmolLM2 k = 32)")
    ap.add_argument("--llama8b-layers", type=int, default=0,
                    help="measure Llama-3.1-8B-shaped decoder linears instead: this many random-weight layers, k = 128")
    ap.add_argument("--out", default="benchmarks/results/engine_bytes")
    args = ap.parse_args()

    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig
    from foursight.cache import cache_dir
    from foursight.models import build_tiny_model, prepare_smollm2

    if args.llama8b_layers:
        if args.ckpt:
            ap.error("--ckpt and --llama8b-layers: pass one")
        base = cache_dir() / "bench" / f"llama8b-shaped-{args.llama8b_layers}l"
        ckpt = base.with_name(base.name + "-fs128")
        if not (base / "config.json").exists():
            build_tiny_model(base, hidden_size=4096, intermediate_size=14336, num_layers=args.llama8b_layers, num_heads=32,
                             num_kv_heads=8, vocab_size=512, force=True)
        if not (ckpt / "config.json").exists():
            quantize_model(base, ckpt, QuantizeConfig(channels="128", force=True), progress=False)
        what = f"Llama-3.1-8B-shaped decoder linears ({args.llama8b_layers} random-weight layers), k = 128"
    else:
        ckpt = Path(args.ckpt) if args.ckpt else cache_dir() / "bench" / "smollm2-fs32"
        if not (ckpt / "config.json").exists():
            quantize_model(prepare_smollm2(), ckpt, QuantizeConfig(channels="32", force=True), progress=False)
        what = "SmolLM2-135M, k = 32" if not args.ckpt else ckpt.name
    from vllm import LLM

    llm = LLM(model=str(ckpt), quantization="foursight", enforce_eager=True, max_model_len=256, dtype="bfloat16", seed=0)
    (got,) = llm.apply_model(count)
    (frag,) = llm.apply_model(count_fragment_form)
    del llm
    commit = git_commit()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import resident_bytes as rb  # the fragment form's bytes (resident_bytes' formula)

    from foursight.kernels.fragment_layout import SCALES_AS_BF16  # the scale encoding the fragment form stores

    shapes = got.pop("shapes")
    padded = sorted({k for _, k, _ in shapes if k % 256})  # the fragment form stores K padded to 256
    pad_note = (", ".join(f"K = {k} pads to {-(-k // 256) * 256}" for k in padded)) if padded else "no K is padded"
    got["gpu_prepared_bytes"] = sum(rb.after_bytes(n, k, kk, SCALES_AS_BF16) for n, k, kk in shapes)
    # the params are the checkpoint tensors: codes N*K/2, E4M3 scales N*K/16, the small ones and W[:, S]; checked
    # against the measured params of these layers, then evaluated at Llama-3.1-8B's decoder linears (k = 128)
    params_formula = sum(rb.packed_bytes(n, k, kk) for n, k, kk in shapes)
    rows = [(n, k) for name, (n, k) in rb.SHAPES.items() if name in rb.LLAMA_8B_LAYER]
    llama = {"bf16": rb.LAYERS * sum(2 * n * k for n, k in rows),
             "params": rb.LAYERS * sum(rb.packed_bytes(n, k, rb.K_CHANNELS) for n, k in rows),
             "fragment": rb.LAYERS * sum(rb.after_bytes(n, k, rb.K_CHANNELS, SCALES_AS_BF16) for n, k in rows)}
    got["params_formula_bytes"] = params_formula
    frag.pop("shapes")
    frag["total_bytes"] = frag["params_bytes"] + frag["qw_beyond_params_bytes"] + frag["prepared_beyond_bytes"]
    got["fragment_form_engine"] = frag  # measured: the same engine's linears re-processed with the triton backend
    # with the release, what stays beside the fragment form per linear is small, at most: the plugin's per-row
    # global scale of a fused layer (4N) and its channel copy (4k), and per shard (at most 3) the two [1] scales
    # and the k channels the params keep; W[:, S] is the params' own storage, shared with the fragment form
    llama["kept_beside_fragment"] = rb.LAYERS * sum(4 * n + 4 * rb.K_CHANNELS + 3 * (8 + 4 * rb.K_CHANNELS) for n, _ in rows)
    llama["ratio_to_bf16_without_release"] = (llama["params"] + llama["fragment"]) / llama["bf16"]
    llama["ratio_to_bf16"] = (llama["fragment"] + llama["kept_beside_fragment"]) / llama["bf16"]
    got["llama_8b_gpu_engine"] = llama
    bf16 = got["bf16_bytes"]
    res = {"what": f"bytes of the FourSight linears inside a vLLM CPU engine ({what})", "commit": commit,
           "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}", "checkpoint": str(ckpt), **got,
           "ratios_to_bf16": {k: got[k] / bf16 for k in ("params_bytes", "qw_beyond_params_bytes", "prepared_beyond_bytes",
                                                         "gpu_prepared_bytes")}
           | {f"fragment_form_engine_{k}": frag[k] / bf16 for k in ("params_bytes", "qw_beyond_params_bytes",
                                                                     "prepared_beyond_bytes", "total_bytes")}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bytes.json").write_text(json.dumps(res, indent=1) + "\n")
    r = res["ratios_to_bf16"]
    md = [f"# Bytes of the FourSight linears inside a vLLM CPU engine ({what})\n",
          f"Commit `{commit}`, {res['machine']}, checkpoint {ckpt.name}, {got['layers']} linears, backend {got['backend']}; "
          f"`python benchmarks/kernels/engine_bytes.py{f' --llama8b-layers {args.llama8b_layers}' if args.llama8b_layers else ''} --out {args.out}`.\n",
          "| group | bytes | x BF16 (2NK) |", "|---|---|---|",
          f"| BF16 weights of the same linears | {bf16:,} | 1.000 |",
          f"| params (what the layers register: checkpoint tensors) | {got['params_bytes']:,} | {r['params_bytes']:.3f} |",
          f"| plugin state's QuantizedWeight beyond the params | {got['qw_beyond_params_bytes']:,} | {r['qw_beyond_params_bytes']:.3f} |",
          f"| the backend's prepared form beyond both (CPU: the reference's float32 weight) | {got['prepared_beyond_bytes']:,} "
          f"| {r['prepared_beyond_bytes']:.3f} |",
          f"| on a GPU, the fragment form instead (resident_bytes' formula on these shapes; {pad_note}) "
          f"| {got['gpu_prepared_bytes']:,} | {r['gpu_prepared_bytes']:.3f} |",
          "",
          f"The same engine, every linear re-processed by the plugin with the triton backend (the fragment form a GPU engine "
          f"holds, built on the CPU; {frag['layers_released']} of {frag['layers']} linears released their checkpoint codes "
          "and block scales):",
          "",
          "| group (fragment-form engine, measured) | bytes | x BF16 (2NK) |", "|---|---|---|",
          f"| params left (per-shard scales, channels, W[:, S]; codes and scales released) | {frag['params_bytes']:,} "
          f"| {r['fragment_form_engine_params_bytes']:.3f} |",
          f"| plugin state's QuantizedWeight beyond the params | {frag['qw_beyond_params_bytes']:,} "
          f"| {r['fragment_form_engine_qw_beyond_params_bytes']:.3f} |",
          f"| the fragment form beyond both | {frag['prepared_beyond_bytes']:,} | {r['fragment_form_engine_prepared_beyond_bytes']:.3f} |",
          f"| **all the linears hold** | **{frag['total_bytes']:,}** | **{r['fragment_form_engine_total_bytes']:.3f}** |",
          "",
          f"Without the release a GPU engine kept params + fragment form = {r['params_bytes'] + r['gpu_prepared_bytes']:.3f}x BF16 "
          f"for these linears (the params' formula, codes, scales, small tensors and W[:, S], gives {got['params_formula_bytes']:,} "
          f"bytes against {got['params_bytes']:,} measured). With it the engine holds {r['fragment_form_engine_total_bytes']:.3f}x, "
          f"against the fragment form's formula {r['gpu_prepared_bytes']:.3f}x ({pad_note}; 8B shapes pad none). "
          f"At Llama-3.1-8B's decoder linears (32 layers, k = 128) the same formulas give "
          f"{got['llama_8b_gpu_engine']['ratio_to_bf16_without_release']:.3f}x BF16 without the release and "
          f"{got['llama_8b_gpu_engine']['ratio_to_bf16']:.3f}x with it (fragment form + the small tensors kept beside it)."]
    (out / "engine_bytes.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
