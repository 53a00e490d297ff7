#!/usr/bin/env python
"""Compile the FourSight Triton and Gluon kernels for sm_90a (H100/H200) on a machine without a GPU, count the
SASS instructions of their loops, and count the launches of one linear.

Triton ships ``ptxas`` and ``cuobjdump``, so ``triton.compile`` with a ``GPUTarget("cuda", 90, 32)``
(Triton builds ``sm_90a`` for it) works on a CPU-only machine. Integer arguments are marked divisible
by 16 and unit strides are specialized, as Triton does at launch for contiguous tensors. The local
Triton may differ from the GPU machine's (3.9 here, 3.6 on the H200), so counts are a guide, not the
shipped SASS.

Usage::

    python benchmarks/kernels/sass_offline.py                      # print: the hand-picked cases below
    python benchmarks/kernels/sass_offline.py fragment act_quant   # a subset of them
    python benchmarks/kernels/sass_offline.py gluon_stream         # the register-streaming Gluon form
    python benchmarks/kernels/sass_offline.py --table --label after --out benchmarks/results/sass_v3 \\
        [--before benchmarks/results/sass_v3/before.json]
    python benchmarks/kernels/sass_offline.py --stream --label triton-3.6 --out benchmarks/results/sass_stream
    python benchmarks/kernels/sass_offline.py --decode --label triton-3.9 --out benchmarks/results/sass-quickwins-2026-12-07

``--table`` compiles **every configuration of the default candidate lists** (``DECODE_CONFIGS``,
``MID_CONFIGS``, ``PREFILL_CONFIGS`` of :mod:`foursight.kernels.configs`, whatever forms the imported
``foursight.kernels`` has), every register-streaming Gluon tile (``STREAM_CONFIGS``: the autotuner adds
them to the decode candidates at run time, :func:`foursight.kernels.api.stream_candidates`) at its
decode launch (:data:`STREAM_LAUNCH`), and the activation quantizer at its decode and prefill launches, and
counts, in a subprocess under ``TRITON_INTERPRET=1``, the launches of one W4A4 k = 128 linear at
decode (M = 1 and 16, the decode form) and at prefill (M = 256, the prefill form). It writes
``<out>/<label>.json`` (commit, sha256 of the kernels folder, Triton version, every figure) and, with
``--before``, ``<out>/sass_table.md`` with the two side by side. The BEFORE file is made by running
this same script with ``PYTHONPATH`` pointing at a copy of the older package (docs/kernels.md says
how). ``--stream`` compiles the Gluon tiles alone, writes ``<out>/<label>.json`` and rewrites
``<out>/stream_table.md`` from every such JSON in ``<out>`` (one section per run); ``--decode`` does the same for
the fragment tiles of ``DECODE_CONFIGS`` alone (``decode_table.md``, with the main loop's ``LDG``/``LDS``/``STS``/
``BAR``/``HGMMA`` counts, the wgmma left in flight, registers, spills and shared memory). ``--gluon-renames``
first maps the Gluon names Triton 3.6 has and later Tritons renamed onto their new ones, in this
process only (:data:`GLUON_RENAMES`), so a newer Triton compiles the unedited kernel as it would
after the rename: a preview of that fix, recorded as such (``gluon_renames`` in the JSON).
Metrics:

* **instructions per weight value** (main loop): the SASS instructions of the loop over K (the
  first backward branch; for a Gluon kernel the first loop that issues ``HGMMA``, as its
  activation-copy loop comes first) divided by the weight values one thread handles per iteration
  (``block_n · block_k / threads``; the register-streaming form: ``64 · 256 / 128`` = 128 per
  256-column step); for forms without a K loop (the dequant kernel), the whole kernel's instructions
  over the values per thread. With it, the main loop's ``LDG``/``LDS``/``STS``/``BAR``/``HGMMA``
  counts and ``async_mma_wait``: the loop waits with ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (one wgmma
  left in flight, the asynchronous MMA).
* **resources**: registers, local memory and ``STL``/``LDL`` count (spills), shared memory per program
  (:func:`sass.resources`).
* **instructions per activation element** (quantizer): the kernel's static instructions up to its
  first ``EXIT`` (the hot path; out-of-line slow-path subroutines such as IEEE division's follow it)
  divided by the elements per thread; the total including those subroutines is recorded too.
* **launches per linear**: Triton launches plus the device-kernel-launching torch calls made at the
  top level of ``splice_linear`` (``mm``, ``addmm``, ``index_copy_``, ``copy_``, ``zero_``,
  ``fill_``, ``clone``), counted on CPU tensors in the interpreter with the GPU's default form
  forced.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import git_commit, kernels_sha256  # noqa: E402  (benchmarks/common.py)
from sass import compile_kernel, instructions, is_gluon, loop_texts, loops, opcode, resources, sass_of  # noqa: E402  (benchmarks/kernels/sass.py)

_INTS = ("M", "N", "K", "KS", "SPLITS", "GROUPS_PER_SPLIT", "CHUNKS_PER_SPLIT", "FIRST_CHUNKS", "KCP", "NP", "KW", "SEG_PER_SPLIT",
         "TILES", "P0", "P1")
_NOT_DIV16 = ("M", "N", "SPLITS", "GROUPS_PER_SPLIT", "CHUNKS_PER_SPLIT", "FIRST_CHUNKS", "KCP", "NP", "SEG_PER_SPLIT", "TILES")


def _kernel(module: str, name: str):
    """``foursight.kernels.<module>.<name>`` or None when the imported package has no such form."""
    try:
        mod = __import__(f"foursight.kernels.{module}", fromlist=[name])
    except ImportError:
        return None
    return getattr(mod, name, None)


def compile_sm90(fn, ptr_types: dict, consts: dict, num_warps: int, num_stages: int, maxnreg: int = 0):
    """``triton.compile`` for sm_90a with launch-like specialization (see the module docstring)."""
    sig = {}
    params = inspect.signature(fn.fn).parameters
    # a constexpr parameter left out of ``consts`` takes its default, as at launch
    consts = {**{p: v.default for p, v in params.items() if "constexpr" in str(v.annotation) and v.default is not v.empty},
              **{k: v for k, v in consts.items() if k in params}}
    for p in params:
        if p in consts:
            sig[p] = "constexpr"
        elif p in ptr_types:
            sig[p] = ptr_types[p]
        elif p.startswith("stride") or p in _INTS:
            sig[p] = "i32"
        else:
            sig[p] = "*fp32"
    div16 = [n for n, ty in sig.items() if ty.startswith("*") or (ty == "i32" and n not in _NOT_DIV16)]
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if consts.get("GDC_WAIT"):
        opts["launch_pdl"] = True
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return compile_kernel(fn, 90, sig, consts, div16, **opts)


def loop_counts(sass: str) -> list[tuple[int, collections.Counter]]:
    """(length, counts of the base opcodes, modifiers dropped) of every loop body (:func:`sass.loops`)."""
    return [(len(body), collections.Counter(op.split(".")[0] for op in body)) for body in loops(sass)]


_MAIN_LOOP_OPS = ("LDG", "LDS", "STS", "BAR", "HGMMA")
_ASYNC_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x1\b")


def main_loop(fn, sass: str) -> list[str] | None:
    """The instruction texts of the main loop (the module docstring's rule), or None without a loop."""
    bodies = loop_texts(sass)
    if is_gluon(fn):
        bodies = [b for b in bodies if any(opcode(t).startswith("HGMMA") for t in b)]
    return bodies[0] if bodies else None


def unrolled_steps(sass: str, steps: int, per_thread: float) -> dict:
    """The main-loop figures of a Gluon kernel whose K steps are unrolled (``MMA_ASYNC``): a step is the span
    from one step's first ``HGMMA`` to the next's (16 ``HGMMA`` of K 16 a 256-column step), averaged over the
    ``steps - 1`` spans from step 0's first to the last step's first; ``loop_instructions`` is one step's
    average, and ``async_mma_wait`` looks in the whole span."""
    texts = [t for _a, t in instructions(sass)]
    h = [i for i, t in enumerate(texts) if opcode(t).startswith("HGMMA")]
    if len(h) < 16 * steps:
        raise RuntimeError(f"unrolled_steps: {len(h)} HGMMA for {steps} steps of 16")
    span = texts[h[0]:h[16 * (steps - 1)]]
    ops = collections.Counter(opcode(t).split(".")[0] for t in span)
    per_step = len(span) / (steps - 1)
    return dict(loop_instructions=round(per_step, 1), per_weight=round(per_step / per_thread, 2), unrolled=True,
                top_ops={k: round(v / (steps - 1), 1) for k, v in ops.most_common(6)},
                main_loop_ops={op: round(ops.get(op, 0) / (steps - 1), 1) for op in _MAIN_LOOP_OPS},
                async_mma_wait=any(_ASYNC_WAIT.search(t) for t in span))


def measure(fn, ptrs: dict, consts: dict, nw: int, ns: int, maxnreg: int, per_thread: float) -> dict:
    """Compile one case for sm_90a and return its figures (the module docstring's metrics)."""
    compiled = compile_sm90(fn, ptrs, consts, nw, ns, maxnreg)
    sass = sass_of(compiled)
    total = len(instructions(sass))
    row = {}
    body = main_loop(fn, sass)
    if body:
        ops = collections.Counter(opcode(t).split(".")[0] for t in body)
        row.update(loop_instructions=len(body), per_weight=round(len(body) / per_thread, 2), top_ops=dict(ops.most_common(6)),
                   main_loop_ops={op: ops.get(op, 0) for op in _MAIN_LOOP_OPS},
                   async_mma_wait=any(_ASYNC_WAIT.search(t) for t in body))
    elif is_gluon(fn) and consts.get("MMA_ASYNC") and consts["STEPS"] > 1:
        row.update(unrolled_steps(sass, consts["STEPS"], per_thread))
    else:  # one tile per program: the whole kernel is the per-tile work
        row.update(loop_instructions=None, per_weight=round(total / per_thread, 2))
    row.update(total_instructions=total, values_per_thread_per_step=per_thread, **resources(compiled, sass))
    return row


def hot_path(sass: str) -> int:
    """Instructions up to and including the first unpredicated ``EXIT`` (the code after it is
    out-of-line subroutines, e.g. the slow path of IEEE division)."""
    for i, (_a, t) in enumerate(instructions(sass)):
        if re.match(r"^EXIT\b", t.strip()):
            return i + 1
    return len(instructions(sass))


# --------------------------------------------------------------------------------------------
# the hand-picked cases of the plain print mode (kept for quick looks at one kernel)
# --------------------------------------------------------------------------------------------

def _fragment_ptrs(scale_bf16: bool) -> dict:
    return {"a_ptr": "*bf16", "x_ptr": "*bf16", "ch_ptr": "*i32", "wf_ptr": "*i32",
            "sf_ptr": "*i16", "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "cnt_ptr": "*i32", "xs_ptr": "*bf16", "xq_ptr": "*bf16", "smask_ptr": "*u8"}


_ACT_PTRS = {"x_ptr": "*bf16", "smask_ptr": "*u8", "ch_ptr": "*i32", "packed_ptr": "*u8", "scale_ptr": "*u8",
             "deq_ptr": "*bf16", "xs_ptr": "*bf16"}


def _act_case(block_k: int, nw: int, fq: bool, cols: int = 1):
    # WRITE_XS as launched: every fragment tile after the quantizer reads its dense X[:, S] copy (kernels.api,
    # one or ``q_split`` programs per row); the fake-quant (prefill) launch writes none
    c = dict(stride_xk=1, BLOCK_K=block_k, ONE_PASS=True, HAS_CH=True, STATIC_GS=False, WRITE_PACKED=False,
             WRITE_DEQ=True, WRITE_XS=not fq, BLOCK_KS=128, DIV6_RECIP=True, ROWS=1, FQ=fq, LAUNCH_DEPS=False)
    if cols > 1:
        c["COLS"] = cols
    return c, nw


def form_case(cfg, scale_bf16: bool):
    """(kernel, pointer types, constexprs, num_warps, num_stages, maxnreg, values per thread per step)
    for one configuration of a default list, or None for a form this script does not know."""
    form = type(cfg).__name__
    if form == "FragmentConfig":
        fn = _kernel("fragment", "_fragment_gemm_kernel")
        consts = dict(A_QUANT=True, HAS_BIAS=False, HAS_KS=True, SPLIT=True, SCALE_BF16=scale_bf16, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_KS=64, GROUP_M=8, INTERP=False,
                      # as the launch sets them: every fragment tile after a quantizer launch reads its dense
                      # X[:, S] (kernels.api; a quant_in tile gathers it: set below)
                      SEG_LATE=bool(getattr(cfg, "cols_late", False)), XS_DENSE=True)
        frag = __import__("foursight.kernels.fragment", fromlist=["x"])
        nw = getattr(cfg, "num_warps", 4)
        if hasattr(frag, "a_rows_for"):  # v4: the tile as it runs at M = 1 (decode) or at its block_m (mid, prefill)
            narrow = getattr(cfg, "narrow", False) or getattr(cfg, "quant_in", False)
            consts.update(BLOCK_KS=32, A_ROWS=1 if narrow and cfg.block_m == 16 else 0,
                          QUANT_IN=bool(getattr(cfg, "quant_in", False)) and cfg.block_m == 16, DIV6_RECIP=True,
                          PERSISTENT=bool(getattr(cfg, "persistent", False)))
            consts["XS_DENSE"] = not consts["QUANT_IN"]  # no quantizer launch, no copy: the tile gathers X[:, S]
            consts["A_ZFILL"] = bool(getattr(cfg, "zfill", False))  # issue 52: rows >= M by zero-filled copies
        elif hasattr(frag, "PDL_PREFETCH_CHUNKS"):  # v3's W4A4 default: launched with PDL after the quantizer
            consts.update(GDC_WAIT=True, PREFETCH_CHUNKS=frag.PDL_PREFETCH_CHUNKS)
        return fn, _fragment_ptrs(scale_bf16), consts, nw, cfg.num_stages, getattr(cfg, "max_regs", 0), cfg.block_n * cfg.block_k / (32 * nw)
    if form == "GemvConfig":
        fn = _kernel("gemv", "_splice_gemv1_kernel")
        ptrs = {"x_ptr": "*bf16", "a_ptr": "*fp16", "ch_ptr": "*i32", "wq_ptr": "*i32", "ws_ptr": "*u8",
                "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
        consts = dict(stride_xk=1, stride_on=1, A_MODE=1, HAS_BIAS=False, HAS_KS=True, BN=cfg.block_n, BK=cfg.block_k,
                      BLOCK_KS=128, USE_ASM=True, INTERP=False)
        return fn, ptrs, consts, cfg.num_warps, cfg.num_stages, 0, cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
    if form == "SwapConfig":
        fn = _kernel("swap", "_splice_gemm_kernel")
        ptrs = {"a_ptr": "*fp16", "x_ptr": "*bf16", "ch_ptr": "*i32", "wp_ptr": "*u8", "ws_ptr": "*u8",
                "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
        consts = dict(stride_ak=1, stride_xk=1, stride_on=1, A_QUANT=True, DOT_BF16=False, HAS_BIAS=False, HAS_KS=True,
                      SPLIT=True, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_KS=64,
                      GROUP_M=8, INTERP=False)
        return fn, ptrs, consts, cfg.num_warps, cfg.num_stages, 0, cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
    if form == "SSConfig":
        fn = _kernel("ss", "_splice_gemm_ss_kernel")
        ptrs = {"a_ptr": "*fp16", "xs_ptr": "*bf16", "ch_ptr": "*i32", "wp_ptr": "*u8", "ws_ptr": "*u8", "wb_ptr": "*bf16",
                "bias_ptr": "*bf16", "out_ptr": "*bf16"}
        consts = dict(stride_ak=1, stride_xsk=1, stride_on=1, A_QUANT=True, DOT_BF16=False, XS_DENSE=True, HAS_BIAS=False,
                      HAS_KS=True, EVEN_K=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_KS=64,
                      GROUP_M=8, PREFETCH=cfg.prefetch, INTERP=False)
        return fn, ptrs, consts, cfg.num_warps, cfg.num_stages, 0, cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
    if form == "StreamConfig":
        return stream_case(cfg, stream_decode_m(cfg))
    if form == "DequantConfig":
        fn = _kernel("dequant", "_dequant_weight_kernel")
        ptrs = {"wp_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": "*bf16", "wf_ptr": "*i32", "sf_ptr": "*i16",
                "wb_ptr": "*bf16", "ch_ptr": "*i32"}
        consts = dict(DIV_GS=False, BN=cfg.block_n, BK=cfg.block_k, SCALE_BF16=scale_bf16, INTERP=False, HAS_KS=True)
        return fn, ptrs, consts, cfg.num_warps, 1, 0, cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
    return None


def _scale_bf16() -> bool:
    """The fragment form's scale encoding: ``fragment_layout.SCALES_AS_BF16`` (since issue 39), else
    ``fragment``'s (older packages, for --before tables), else False (before the constant existed)."""
    import importlib

    for mod in ("foursight.kernels.fragment_layout", "foursight.kernels.fragment"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "SCALES_AS_BF16"):
            return bool(m.SCALES_AS_BF16)
    return False


def gemm_rows(decode_only: bool = False) -> list[dict]:
    from foursight.kernels import configs

    scale_bf16 = _scale_bf16()
    rows, seen = [], set()
    lists = [(lst, getattr(configs, lst)) for lst in ("DECODE_CONFIGS", "MID_CONFIGS", "PREFILL_CONFIGS")[:1 if decode_only else 3]]
    if not decode_only:
        lists += [(f"FP16_CONFIGS[{p}]", cs) for p, cs in getattr(configs, "FP16_CONFIGS", {}).items()]  # v3: fp16 activations
    for lst, cfgs in lists:
        for cfg in cfgs:
            if str(cfg) in seen:
                continue
            seen.add(str(cfg))
            case = form_case(cfg, scale_bf16)
            row = {"list": lst, "config": str(cfg)}
            if case is None or case[0] is None:
                row["error"] = "form unknown to this script"
                rows.append(row)
                continue
            try:
                row.update(measure(*case))
            except Exception as e:  # noqa: BLE001 - recorded, a failed compile is a finding
                row["error"] = _error_text(e)
            rows.append(row)
            print(f"  {lst:16s} {str(cfg):40s} {row.get('per_weight')}", flush=True)
    return rows


def _error_text(e: Exception) -> str:
    """A failed compile, for the JSON: the exception and the first line of its message, and for a
    Triton ``CompilationError`` (nested once per ``@jit`` function called) the innermost error and the
    source line it points at (e.g. a Gluon API that this Triton removed)."""
    def first(x: BaseException) -> str:
        return f"{type(x).__name__}: {str(x).splitlines()[0][:200] if str(x) else ''}"

    inner, where = e, ""
    while True:
        lines = str(inner).splitlines()
        marks = [i for i, ln in enumerate(lines) if ln.strip() == "^"]
        if marks and marks[-1] > 0:  # the source line above the deepest ``^`` marker
            where = lines[marks[-1] - 1].strip()
        if inner.__cause__ is None:
            break
        inner = inner.__cause__
    what = getattr(inner, "error_message", None) or inner  # a CompilationError without a cause keeps its error here
    if inner is e and not where:
        return first(e)
    return f"{first(e)} (innermost: {first(what) if isinstance(what, BaseException) else what}" + (f"; at `{where}`" if where else "") + ")"


# --------------------------------------------------------------------------------------------
# the register-streaming Gluon form (kernels/experimental/gluon_stream.py)
# --------------------------------------------------------------------------------------------

#: the decode launch every ``STREAM_CONFIGS`` row is compiled for: a W4A4 8192 x 8192 layer with 128 BF16
#: columns on a 132-SM Hopper GPU (H100 SXM, H200), M = 1 for a block_m 8 tile, M = block_m otherwise
STREAM_LAUNCH = {"n": 8192, "k": 8192, "kk": 128, "sms": 132}

_STREAM_PTRS = {"a_ptr": "*bf16", "wf_ptr": "*i32", "sf_ptr": "*i16", "a_gs_ptr": "*fp32", "x_ptr": "*bf16",
                "ch_ptr": "*i32", "w_gs_ptr": "*fp32", "wb_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                "ws_ptr": "*fp32", "cnt_ptr": "*i32", "xs_ptr": "*bf16"}


#: Gluon names the kernels use (Triton 3.6) -> their names in later Tritons (3.9): (module, old, new)
GLUON_RENAMES = (("triton.experimental.gluon.language.nvidia.ampere.async_copy", "async_copy_global_to_shared", "async_load"),
                 ("triton.experimental.gluon.language", "thread_barrier", "barrier"))


def apply_gluon_renames() -> list[str]:
    """Point each old name of :data:`GLUON_RENAMES` at its new builtin where this Triton has the new one
    (and has dropped or disabled the old); returns the renames applied. Compiles then go to a private
    Triton cache: Triton's cache key does not see the renames, so a shared cache would later hand these
    kernels to a run without them (and hide its compile error)."""
    import atexit
    import importlib
    import shutil
    import tempfile

    cache = tempfile.mkdtemp(prefix="sass-gluon-renames-")
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    os.environ["TRITON_CACHE_DIR"] = cache
    done = []
    for module, old, new in GLUON_RENAMES:
        mod = importlib.import_module(module)
        if hasattr(mod, new):
            setattr(mod, old, getattr(mod, new))
            done.append(f"{module}.{old} -> {new}")
    return done


def stream_decode_m(cfg) -> int:
    """The decode M a register-streaming tile stands for here: 1 for block_m 8, else its block_m."""
    return 1 if cfg.block_m == 8 else cfg.block_m


def stream_launch_plan(cfg, m: int) -> dict:
    """``gluon_stream.stream_plan`` of ``cfg``'s launch at M = ``m`` on :data:`STREAM_LAUNCH`, as the GPU
    plans it: the prepared weight is a stand-in holding the fragment form's shapes as meta tensors, and the
    device's SM count is patched in (on the CPU the plan assumes 8 program slots, not the GPU's)."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from foursight.kernels.experimental import gluon_stream as gs

    n, k = STREAM_LAUNCH["n"], STREAM_LAUNCH["k"]
    pw = SimpleNamespace(out_features=n, in_features=k, num_channels=STREAM_LAUNCH["kk"],
                         fragment=SimpleNamespace(words=torch.empty((n, k // 8), dtype=torch.int32, device="meta")),
                         weight_global_scale=torch.empty(n, device="meta"))
    sm = SimpleNamespace(multi_processor_count=STREAM_LAUNCH["sms"])
    with mock.patch.object(gs, "on_cuda", lambda _pw: True), mock.patch.object(gs.torch.cuda, "get_device_properties", lambda _d: sm):
        return gs.stream_plan(cfg, m, pw)


def stream_case(cfg, m: int):
    """:func:`form_case`'s tuple for a ``StreamConfig`` at its decode launch at M = ``m``: the constexprs
    ``gluon_stream.stream_launch`` passes for a W4A4 layer whose quantizer wrote the dense ``X[:, S]``."""
    from foursight.kernels.experimental import gluon_stream as gs

    if gs.gluon is None:
        raise RuntimeError(f"Gluon is not importable with this Triton ({gs.GLUON_IMPORT_ERROR})")
    plan = stream_launch_plan(cfg, m)
    consts = gs.stream_constexprs(cfg, plan, a_quant=True, has_bias=False, xs_dense=True, kk=STREAM_LAUNCH["kk"])
    # num_stages as a launch leaves it (Triton's default; Gluon does not pipeline)
    return gs._stream_kernel, _STREAM_PTRS, consts, cfg.num_warps, 3, cfg.max_regs, cfg.block_n * 256 / (32 * cfg.num_warps)


def stream_rows() -> list[dict]:
    """One row per ``STREAM_CONFIGS`` tile: its launch plan, constexprs (layouts by name) and figures."""
    from foursight.kernels import configs

    rows = []
    for cfg in getattr(configs, "STREAM_CONFIGS", ()):
        m = stream_decode_m(cfg)
        row = {"list": "STREAM_CONFIGS", "config": str(cfg), "m": m}
        try:
            row["plan"] = stream_launch_plan(cfg, m)
            case = stream_case(cfg, m)
            row["constexprs"] = {k: (v if isinstance(v, (bool, int)) else repr(v)) for k, v in case[2].items()}
            row.update(measure(*case))
        except Exception as e:  # noqa: BLE001 - recorded, a failed compile is a finding
            row["error"] = _error_text(e)
        rows.append(row)
        print(f"  {str(cfg):60s} M={m}: " + (row["error"] if "error" in row else
              f"{row['per_weight']} per weight value, {row['registers']} registers, {row['shared_bytes']} B shared, "
              f"loop {row['main_loop_ops']}, async wait {row['async_mma_wait']}"), flush=True)
    return rows


def _header(label: str) -> dict:
    """The provenance every JSON of this script starts with."""
    return {"label": label, "commit": os.environ.get("SASS_COMMIT") or git_commit(), "kernels_sha256": kernels_sha256(),
            "triton": triton.__version__, "target": "sm_90a (GPUTarget cuda 90)"}


def stream_table(label: str, out: str, renames: list[str]) -> None:
    """``--stream``: the Gluon tiles alone -> ``<out>/<label>.json`` and ``<out>/stream_table.md``."""
    os.makedirs(out, exist_ok=True)
    print(f"[{label}] register-streaming Gluon form (every STREAM_CONFIGS tile), Triton {triton.__version__}:", flush=True)
    res = {**_header(label), "gluon_renames": renames, "stream_launch": STREAM_LAUNCH, "stream": stream_rows()}
    path = os.path.join(out, f"{label}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    runs = []
    for p in sorted(Path(out).glob("*.json")):
        with open(p) as f:
            d = json.load(f)
        if d.get("stream"):
            runs.append(d)
    path = os.path.join(out, "stream_table.md")
    with open(path, "w") as f:
        f.write("\n".join(["# SASS offline: the register-streaming Gluon form (sm_90a, compiled on the CPU machine)", "",
                           "Written by `benchmarks/kernels/sass_offline.py --stream` (its docstring defines every metric). "
                           "Static SASS counts, a guide to issue cost, not a timing.", ""]
                          + [line for d in runs for line in stream_md(d)]) + "\n")
    print(f"wrote {path}")


def decode_table(label: str, out: str) -> None:
    """``--decode``: the decode list's tiles alone (the narrow and zero-fill activation tiles of issue 52 item 2
    among them) -> ``<out>/<label>.json`` and ``<out>/decode_table.md`` rewritten from every such JSON in ``<out>``."""
    os.makedirs(out, exist_ok=True)
    print(f"[{label}] DECODE_CONFIGS, Triton {triton.__version__}:", flush=True)
    res = {**_header(label), "decode": gemm_rows(decode_only=True)}
    path = os.path.join(out, f"{label}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    lines = ["# SASS offline: the decode tiles (sm_90a, compiled on the CPU machine)", "",
             "Written by `benchmarks/kernels/sass_offline.py --decode` (its docstring defines every metric; each tile as it "
             "runs at M = 1, W4A4 k > 0 with the quantizer's dense X[:, S]). Static SASS counts, a guide to issue cost, "
             "not a timing.", ""]
    for p in sorted(Path(out).glob("*.json")):
        with open(p) as f:
            d = json.load(f)
        if not d.get("decode"):
            continue
        lines += [f"## Triton {d['triton']} (`{d['label']}`)", "",
                  f"Commit `{d['commit'][:12]}`, kernels sha256 `{d['kernels_sha256'][:16]}`.", "",
                  "| configuration | per weight value | loop instructions | LDG | LDS | STS | BAR | HGMMA | wgmma in flight "
                  "(DEPBAR.LE gsb0, 0x1) | registers | spills (STL/LDL) | shared B |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in d["decode"]:
            if "error" in r:
                lines.append(f"| `{r['config']}` | failed: {r['error']} |||||||||||")
                continue
            ops = r.get("main_loop_ops", {})
            lines.append(f"| `{r['config']}` | {r['per_weight']} | {r.get('loop_instructions')} | "
                         + " | ".join(str(ops.get(op, "")) for op in _MAIN_LOOP_OPS)
                         + f" | {'yes' if r.get('async_mma_wait') else 'no'} | {r['registers']} | {r['spill_instructions']} | {r['shared_bytes']} |")
        lines.append("")
    path = os.path.join(out, "decode_table.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def stream_md(d: dict) -> list[str]:
    """The markdown lines of one run's ``stream`` rows."""
    L = STREAM_LAUNCH
    lines = [f"## Triton {d['triton']} (`{d['label']}`)", "",
             f"Commit `{d['commit'][:12]}`, kernels sha256 `{d['kernels_sha256'][:16]}`. Launch: W4A4 {L['n']} x {L['k']}, "
             f"k = {L['kk']}, {L['sms']} SMs."
             + (f" **Compiled with these Gluon renames applied (not the shipped kernel's API):** {'; '.join(d['gluon_renames'])}."
                if d.get("gluon_renames") else ""), "",
             "| configuration | M | splits · STEPS · SEGP | registers | spills (STL/LDL, local B) | shared B | main loop instructions "
             "| per weight value | LDG | LDS | STS | BAR | HGMMA | DEPBAR.LE gsb0, 0x1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["stream"]:
        if "error" in r:
            lines.append(f"| `{r['config']}` | {r['m']} | compile failed: {r['error']} |||||||||||")
            continue
        c, ops = r["constexprs"], r.get("main_loop_ops", {})
        lines.append(f"| `{r['config']}` | {r['m']} | {r['plan']['splits']} · {c['STEPS']} · {c['SEGP']} | {r['registers']} | "
                     f"{r['spill_instructions']} ({r['local_bytes']}) | {r['shared_bytes']} | {r['loop_instructions']} | {r['per_weight']} | "
                     + " | ".join(str(ops.get(op, "")) for op in _MAIN_LOOP_OPS) + f" | {'yes' if r.get('async_mma_wait') else 'no'} |")
    return lines + [""]


def act_rows() -> list[dict]:
    fn = _kernel("act_quant", "_act_quant_kernel")
    rows = []
    # decode (M <= 128: 32 warps at K >= 4096) and prefill (16 warps at K = 8192) launches, the fp16/bf16
    # q*s output (fused GEMMs) and the bf16 fake-quantized one (prefill)
    cases = {"decode K=8192 (q*s)": (8192, 32, False, 1), "prefill K=8192 (fake-quant)": (8192, 16, True, 1)}
    if "COLS" in inspect.signature(fn.fn).parameters:  # v4: the decode quantizer split over 8 programs per row (q_split)
        cases["decode K=8192 (q*s), 8 programs per row, dynamic"] = (8192, 4, False, 8)
    for name, (block_k, nw, fq, cols) in cases.items():
        consts, nw = _act_case(block_k, nw, fq, cols)
        sass = sass_of(compile_sm90(fn, _ACT_PTRS, consts, nw, 1))
        per_thread = block_k / (32 * nw * cols)
        total, hot = len(instructions(sass)), hot_path(sass)
        rows.append({"case": name, "per_element_hot": round(hot / per_thread, 2), "per_element_total": round(total / per_thread, 2),
                     "hot_instructions": hot, "total_instructions": total, "elements_per_thread": per_thread})
        print(f"  act_quant {name}: {rows[-1]['per_element_hot']} hot, {rows[-1]['per_element_total']} total", flush=True)
    return rows + producer_rows()


_PRODUCER_PTRS = {"a_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_out_ptr": "*bf16", "y_ptr": "*bf16",
                  "smask_ptr": "*u8", "ch_ptr": "*i32", "gs_in_ptr": "*fp32", "deq_ptr": "*bf16", "gs_out_ptr": "*fp32",
                  "xs_ptr": "*bf16", "eps": "fp32"}


def producer_rows() -> list[dict]:
    """The fused producers (:mod:`foursight.kernels.producers`) at the 8B decoder's decode launches: the residual
    add + RMSNorm (K = 4096) and SiLU·mul (K = 14336) quantizing for a k = 128 consumer (32 warps, as launched
    at M <= 128), and the same producers alone (the BF16 path). Per-element figures as the quantizer's."""
    fn = _kernel("producers", "_producer_kernel")
    if fn is None:
        return []
    rows = []
    for name, kind, block_k, nw, res, quant in (
            ("producer add+RMSNorm+quant K=4096 (decode)", 0, 4096, 32, True, True),
            ("producer SiLU·mul+quant K=14336 (decode)", 1, 16384, 32, False, True),
            ("producer add+RMSNorm alone K=4096", 0, 4096, 8, True, False),
            ("producer SiLU·mul alone K=14336", 1, 16384, 16, False, False)):
        consts = dict(KIND=kind, HAS_RES=res, WRITE_Y=not quant, QUANT=quant, HAS_CH=quant, STATIC_GS=False,
                      BLOCK_K=block_k, BLOCK_KS=128, DIV6_RECIP=True)
        compiled = compile_sm90(fn, _PRODUCER_PTRS, consts, nw, 1)
        sass = sass_of(compiled)
        per_thread = block_k / (32 * nw)
        total, hot = len(instructions(sass)), hot_path(sass)
        rows.append({"case": name, "per_element_hot": round(hot / per_thread, 2), "per_element_total": round(total / per_thread, 2),
                     "hot_instructions": hot, "total_instructions": total, "elements_per_thread": per_thread,
                     **resources(compiled, sass)})
        print(f"  {name}: {rows[-1]['per_element_hot']} hot, {rows[-1]['per_element_total']} total, "
              f"{rows[-1]['registers']} registers, {rows[-1]['spill_instructions']} spills", flush=True)
    return rows


_LAUNCH_PROBE = r"""
import json, torch, triton
from triton.runtime.interpreter import InterpretedFunction
from torch.overrides import TorchFunctionMode
from foursight.layer import quantize_weight
import foursight.kernels.api as fk
from foursight.kernels import configs

counts = {"n": 0, "inside": 0, "names": []}
orig_run = InterpretedFunction.run
def run(self, *a, **k):
    counts["n"] += 1; counts["names"].append(self.fn.__name__); counts["inside"] += 1
    try:
        return orig_run(self, *a, **k)
    finally:
        counts["inside"] -= 1
InterpretedFunction.run = run
LAUNCHING = {"mm", "addmm", "index_copy_", "copy_", "zero_", "fill_", "clone", "matmul"}
class Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if counts["inside"] == 0 and name in LAUNCHING:
            counts["n"] += 1; counts["names"].append("torch." + name)
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
n, k = 128, 512
w = torch.randn(n, k)
qw = quantize_weight(w, torch.arange(0, k, 4)[:128], name="probe")
pw = fk.prepare_weight(qw)
def first(lst, form):
    return next(c for c in lst if type(c).__name__ == form)
out = {}
for label, m, cfg in (("decode M=1", 1, %(DECODE1)s), ("decode M=16", 16, %(DECODE16)s), ("prefill M=256", 256, %(PREFILL)s)):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    fk.splice_linear(x, pw, config=cfg)  # warm caches (the fragment form is built once per layer)
    counts.update(n=0, names=[])
    with Mode():
        fk.splice_linear(x, pw, config=cfg)
    out[label] = {"launches": counts["n"], "what": list(counts["names"]), "config": str(cfg)}
print("LAUNCHES " + json.dumps(out))
"""


def launch_rows(decode1: str, decode16: str, prefill: str) -> dict:
    code = _LAUNCH_PROBE % {"DECODE1": decode1, "DECODE16": decode16, "PREFILL": prefill}
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("LAUNCHES "):
            return json.loads(line[len("LAUNCHES "):])
    return {"error": (r.stderr or r.stdout)[-2000:]}


def table(label: str, out: str, before: str | None, decode1: str, decode16: str, prefill: str) -> None:
    os.makedirs(out, exist_ok=True)
    import torch  # noqa: F401 - the launch probe's parent needs nothing else

    print(f"[{label}] GEMM forms (every default configuration):", flush=True)
    g = gemm_rows()
    print(f"[{label}] register-streaming Gluon form (STREAM_CONFIGS at their decode launch):", flush=True)
    st = stream_rows()
    print(f"[{label}] activation quantizer:", flush=True)
    a = act_rows()
    print(f"[{label}] launches per linear (interpreter):", flush=True)
    launches = launch_rows(decode1, decode16, prefill)
    print(json.dumps(launches, indent=1), flush=True)
    res = {**_header(label), "gemm": g, "stream_launch": STREAM_LAUNCH, "stream": st, "act_quant": a, "launches": launches}
    path = os.path.join(out, f"{label}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {path}")
    if before:
        with open(before) as f:
            b = json.load(f)
        write_md(b, res, os.path.join(out, "sass_table.md"))


def _best(rows: list[dict], lst: str) -> str:
    vals = [(r["per_weight"], r["config"]) for r in rows if r["list"] == lst and r.get("per_weight") is not None]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return f"{lo[0]} – {hi[0]}"


def write_md(b: dict, a: dict, path: str) -> None:
    lines = [
        "# SASS offline: before / after (sm_90a, compiled on the CPU machine)",
        "",
        f"Before: commit `{b['commit'][:12]}`, kernels sha256 `{b['kernels_sha256'][:16]}`, Triton {b['triton']}.  ",
        f"After: commit `{a['commit'][:12]}` (the commit this table was written from; the measured kernels are "
        f"those of kernels sha256 `{a['kernels_sha256'][:16]}`), Triton {a['triton']}.  ",
        "Written by `benchmarks/kernels/sass_offline.py --table` (its docstring defines every metric). Static SASS counts, "
        "a guide to issue cost, not a timing.",
        "",
        "## Summary",
        "",
        "| metric | before | after |",
        "|---|---|---|",
    ]
    for lst in ("DECODE_CONFIGS", "MID_CONFIGS", "PREFILL_CONFIGS"):
        lines.append(f"| instructions per weight value, main loop, {lst} (min – max over the list) | {_best(b['gemm'], lst)} | {_best(a['gemm'], lst)} |")
    for lst in sorted({r["list"] for r in a["gemm"]} - {"DECODE_CONFIGS", "MID_CONFIGS", "PREFILL_CONFIGS"}):
        before = _best(b["gemm"], lst) if any(r["list"] == lst for r in b["gemm"]) else "– (in the lists above)"
        lines.append(f"| instructions per weight value, main loop, {lst} (fp16 activations only) | {before} | {_best(a['gemm'], lst)} |")
    for name, lst in (("fragment", "DECODE_CONFIGS"), ("fragment", "MID_CONFIGS"), ("dequant", "PREFILL_CONFIGS")):
        bb = [r["per_weight"] for r in b["gemm"] if r["list"] == lst and r["config"].startswith(name) and r.get("per_weight")]
        aa = [r["per_weight"] for r in a["gemm"] if r["list"] == lst and r["config"].startswith(name) and r.get("per_weight")]
        if bb and aa:
            lines.append(f"| {name} form in {lst}: mean instructions per weight value | {sum(bb) / len(bb):.2f} | {sum(aa) / len(aa):.2f} |")
    for i, row in enumerate(a["act_quant"]):
        brow = b["act_quant"][i] if i < len(b["act_quant"]) else {}
        lines.append(f"| quantizer instructions per activation element, {row['case']}, hot path (total) | "
                     f"{brow.get('per_element_hot', '–')} ({brow.get('per_element_total', '–')}) | {row['per_element_hot']} ({row['per_element_total']}) |")
    for key in ("decode M=1", "decode M=16", "prefill M=256"):
        bl, al = b["launches"].get(key, {}), a["launches"].get(key, {})
        lines.append(f"| launches per W4A4 k>0 linear, {key} | {bl.get('launches', '–')} ({', '.join(bl.get('what', []))}) | "
                     f"{al.get('launches', '–')} ({', '.join(al.get('what', []))}) |")
    lines += ["", "## Every default configuration", "", "| list | configuration | side | instructions per weight value | loop instructions | total |", "|---|---|---|---|---|---|"]
    for side, d in (("before", b), ("after", a)):
        for r in d["gemm"]:
            lines.append(f"| {r['list']} | `{r['config']}` | {side} | {r.get('per_weight', r.get('error', ''))} | {r.get('loop_instructions', '')} | {r.get('total_instructions', '')} |")
    if a.get("stream"):
        lines += ["", "## The register-streaming Gluon form (after)", ""] + stream_md(a)[2:]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


CASES = {  # the plain print mode: name -> (form config builder)
    "fragment": lambda c: c.FragmentConfig(16, 64, 128, 3),
    "fragment256": lambda c: c.FragmentConfig(16, 64, 256, 3),
    "dequant": lambda c: c.DequantConfig(64, 256),
    "gluon_stream": lambda c: c.STREAM_CONFIGS[0],
}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--stream", action="store_true", help="the register-streaming Gluon tiles alone (see the docstring)")
    ap.add_argument("--decode", action="store_true", help="the decode list's tiles alone (see the docstring)")
    ap.add_argument("--gluon-renames", action="store_true", help="apply GLUON_RENAMES first (see the docstring)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default="benchmarks/results/sass_v3")
    ap.add_argument("--before", default=None)
    ap.add_argument("--decode1", default="first(configs.DECODE_CONFIGS, 'FragmentConfig')")
    ap.add_argument("--decode16", default="first(configs.DECODE_CONFIGS, 'FragmentConfig')")
    ap.add_argument("--prefill", default="first(configs.PREFILL_CONFIGS, 'DequantConfig')")
    args = ap.parse_args(argv)
    renames = apply_gluon_renames() if args.gluon_renames else []
    if args.stream:
        stream_table(args.label, args.out, renames)
        return
    if args.decode:
        decode_table(args.label, args.out)
        return
    if args.table:
        table(args.label, args.out, args.before, args.decode1, args.decode16, args.prefill)
        return
    from foursight.kernels import configs

    for name in args.names or [*CASES, "act_quant"]:
        if name == "act_quant":
            act_rows()
            continue
        fn, ptrs, consts, nw, ns, maxnreg, per_thread = form_case(CASES[name](configs), _scale_bf16())
        compiled = compile_sm90(fn, ptrs, consts, nw, ns, maxnreg)
        sass = sass_of(compiled)
        print(f"== {name}: {len(instructions(sass))} instructions; {resources(compiled, sass)}; constexprs {consts}, {nw} warps")
        main = main_loop(fn, sass)
        for i, (body, (n, ops)) in enumerate(zip(loop_texts(sass), loop_counts(sass))):
            extra = f" = {n / per_thread:.2f} per weight value per thread (main loop)" if body == main else ""
            print(f"   loop {i}: {n} instructions{extra}; {ops.most_common(12)}")


if __name__ == "__main__":
    main(sys.argv[1:])
