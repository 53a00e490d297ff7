"""Which kernel form runs, for every configuration class x environment switch x call (issue 54 item 2).

The dispatch between kernel forms moved from ``isinstance`` chains and per-call environment reads in
``kernels/api.py`` to one table of forms (``api.FORMS``, read by ``kernels/forms.py``). This test pins the
choice to what the old dispatch chose, from an expectation written out here by reading the old code
(commit 791f5a4), **not** from the table: it passed on that commit and must pass on every later one.

How it observes the choice without a GPU: a child process imports the kernels with the launch functions
of every form (and the activation quantizer) replaced by recorders that note their arguments and launch
nothing, under each set of switches (``FOURSIGHT_WS``, ``FOURSIGHT_STREAM``) and with the Gluon forms'
``available()`` forced either way. The switches are read when the kernels are imported (or first used),
so the child imports them afresh for each set: that is the contract both the old (per call) and the new
(once) code meet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from foursight.kernels.configs import (
    DECODE_CONFIGS,
    FP16_CONFIGS,
    INTERP_CONFIGS,
    MID_CONFIGS,
    PREFILL_CONFIGS,
    STREAM_CONFIGS,
    WS_CONFIGS,
    DequantConfig,
    FragmentConfig,
    GemvConfig,
    SSConfig,
    StreamConfig,
    SwapConfig,
    WSConfig,
)

#: the switch settings tried: off, on, only, and a value that is neither (the old code took any value
#: of FOURSIGHT_STREAM other than "0" as on, and only "1"/"only" of FOURSIGHT_WS)
ENVS = [("0", "0"), ("1", "0"), ("only", "0"), ("0", "1"), ("0", "only"), ("1", "1"), ("only", "only"),
        ("1", "only"), ("only", "1"), ("yes", "0"), ("0", "2")]
PATHS = ("decode", "mid", "prefill")
MS = (1, 8, 9, 16, 64)
FORMS = ("linear", "w4a16", "deq")
#: one configuration of every class, the fragment options that change the route, and the interpreter's tiles
CONFIGS = [FragmentConfig(16, 64, 128, 1), FragmentConfig(16, 64, 128, 1, narrow=True, quant_in=True),
           FragmentConfig(16, 64, 128, 1, q_split=8), SwapConfig(16, 16, 64, 4, 1), SSConfig(32, 32, 32, 4, 1, True),
           GemvConfig(16, 64), DequantConfig(64, 128), WSConfig(16, 64, 1, 4, 1), StreamConfig(8, 2)]

CHILD = textwrap.dedent(r'''
    import importlib, importlib.util, inspect, json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from foursight.layer import quantize_weight

    EXP = ("foursight.kernels.experimental" if importlib.util.find_spec("foursight.kernels.experimental")
           else "foursight.kernels")
    CASES = json.loads(sys.argv[1])
    CALLS = []
    DROP = {"pw", "out", "bias", "mask", "channels", "post", "num_warps"}

    def desc(v):
        if isinstance(v, torch.Tensor):
            return str(v.dtype).rsplit(".", 1)[-1]
        if isinstance(v, torch.dtype):
            return str(v).rsplit(".", 1)[-1]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return str(v)

    def recorder(name, orig, ret):
        sig = inspect.signature(orig)
        def rec(*a, **kw):
            b = sig.bind(*a, **kw)
            b.apply_defaults()
            CALLS.append([name, {k: desc(v) for k, v in b.arguments.items() if k not in DROP}])
            return ret(b.arguments)
        return rec

    def fake_quant(a):
        x = a["x"]
        xs = torch.zeros(x.shape[0], a["channels"].numel(), dtype=x.dtype) if a["write_xs"] else None
        return None, None, torch.zeros(x.shape, dtype=a["deq_dtype"]), torch.ones(x.shape[0]), xs

    def fresh(ws, stream, avail, interp=True):
        for k in [k for k in sys.modules if k == "foursight.kernels" or k.startswith("foursight.kernels.")]:
            del sys.modules[k]
        os.environ["FOURSIGHT_WS"], os.environ["FOURSIGHT_STREAM"] = ws, stream
        rt = importlib.import_module("foursight.kernels.runtime")
        if not interp:
            rt.interpreting = lambda: False
        out = lambda a: None  # what a launch returns under the interpreter (on a GPU: a kernel handle)
        for mod, fn, ret in [("fragment", "fragment_launch", out), ("swap", "swap_launch", out), ("ss", "ss_launch", out),
                             ("gemv", "gemv_launch", out), ("dequant", "dequant_linear", out),
                             ("act_quant", "act_quant_launch", fake_quant)]:
            m = importlib.import_module(f"foursight.kernels.{mod}")
            setattr(m, fn, recorder(fn, getattr(m, fn), ret))
        for mod, fn in [("gluon_ws_twin", "ws_twin_launch"), ("gluon_ws", "ws_launch"), ("gluon_stream", "stream_launch")]:
            m = importlib.import_module(f"{EXP}.{mod}")
            setattr(m, fn, recorder(fn, getattr(m, fn), out))
        for mod in ("gluon_ws", "gluon_stream"):
            importlib.import_module(f"{EXP}.{mod}").available = lambda device=None: avail
        return importlib.import_module("foursight.kernels.api"), importlib.import_module("foursight.kernels.configs")

    result = {"candidates": {}, "routes": {}}
    for ws, stream in CASES["envs"]:
        for avail in (False, True):
            api, _ = fresh(ws, stream, avail)
            for path in CASES["paths"]:
                for m in CASES["ms"]:
                    for form in CASES["forms"]:
                        for bf16 in (True, False):
                            key = f"{ws}|{stream}|{avail}|{path}|{m}|{form}|{bf16}"
                            result["candidates"][key] = [str(c) for c in api.candidates(path, m, form, bf16)]

    def routes(api, configs, tag, cfgs, ms):
        g = torch.Generator().manual_seed(0)
        for kk in (16, 0):
            qw = quantize_weight(torch.randn(64, 256, generator=g) * 0.05,
                                 torch.arange(0, 256, 256 // kk if kk else 1, dtype=torch.int32)[:kk])
            pw = api.prepare_weight(qw)
            for m in ms:
                for dt in ("bfloat16", "float16"):
                    x = torch.randn(m, 256, generator=g).to(getattr(torch, dt))
                    for tag_cfg in cfgs:
                        cfg = configs.config_from_str(tag_cfg) if tag_cfg else None
                        calls = []
                        for aq in (True, False):
                            for igs in (None, torch.tensor([3.0])):
                                calls.append(("linear", aq, igs is not None, lambda aq=aq, igs=igs: api.splice_linear(
                                    x, pw, input_global_scale=igs, act_quant=aq, config=cfg)))
                        calls.append(("gemm", False, False, lambda: api.splice_gemm(x, pw, None, config=cfg)))
                        deq = (torch.zeros(m, 256, dtype=torch.float16), torch.ones(m))
                        calls.append(("gemm", True, False, lambda: api.splice_gemm(x, pw, deq, config=cfg)))
                        for what, quant, static, call in calls:
                            CALLS.clear()
                            try:
                                call()
                                got = list(CALLS)
                            except Exception as e:  # noqa: BLE001 - the refusal is part of the route
                                got = [["error", type(e).__name__, str(e)]]
                            result["routes"][f"{tag}|{kk}|{m}|{dt}|{tag_cfg}|{what}|{quant}|{static}"] = got

    api, configs = fresh("0", "0", False)
    routes(api, configs, "interp", CASES["configs"] + [""], CASES["route_ms"])
    api, configs = fresh("0", "0", False, interp=False)
    routes(api, configs, "device", [c for c in CASES["configs"] if c.startswith("gluon")], [1])
    print("RESULT" + json.dumps(result))
''')


@pytest.fixture(scope="module")
def observed():
    cases = {"envs": ENVS, "paths": PATHS, "ms": MS, "forms": FORMS, "configs": [str(c) for c in CONFIGS],
             "route_ms": [1, 5, 17, 200]}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


# ------------------------------------------------------------------------------------------------
# the expectation, written from the old code (kernels/api.py at 791f5a4: candidates, _interp_config,
# _gemm_dispatch, _ws_run, linear_run, splice_gemm, splice_linear)
# ------------------------------------------------------------------------------------------------


def expected_candidates(ws: str, stream: str, avail: bool, path: str, m: int, form: str, bf16: bool) -> list:
    if form == "deq" or not bf16:
        return [c for c in FP16_CONFIGS[path] if not (isinstance(c, GemvConfig) and m != 1)]
    base = {"decode": DECODE_CONFIGS, "mid": MID_CONFIGS, "prefill": PREFILL_CONFIGS}[path]
    base = [c for c in base if getattr(c, "block_m", 16) >= 16 or m <= 4]  # issue 52: 8-row (zfill) tiles only at M <= 4
    if stream != "0" and path == "decode":
        if avail:
            if stream == "only":
                return list(STREAM_CONFIGS)
            return [*base, *(c for c in STREAM_CONFIGS if c.block_m == (8 if m <= 8 else 16))]
        if stream == "only":
            return []
    if ws == "only":
        return list(WS_CONFIGS[path]) if avail else []
    if ws == "1" and path in ("decode", "mid") and avail:
        return [*base, *WS_CONFIGS[path]]
    return list(base)


def datapath(m: int) -> str:
    return "decode" if m <= 16 else ("mid" if m <= 128 else "prefill")


def interp_config(path: str, m: int, bf16: bool, form: str = "linear"):
    if form == "deq" or not bf16:
        return INTERP_CONFIGS["fp16:gemv"] if m == 1 else INTERP_CONFIGS[f"fp16:{path}"]
    return INTERP_CONFIGS[path]


GLUON = (WSConfig, StreamConfig)


def bf16_error(cfg, dt):
    """The refusal of a bf16-only form (it names the activation ``x``'s dtype)."""
    return [["error", "NVFP4Error", f"foursight.kernels: the {cfg.form} form takes bf16 activations, got torch.{dt}"]]


def gluon_launch(cfg, device: bool) -> str:
    return ({"gluon_ws": "ws_launch", "gluon_stream": "stream_launch"}[cfg.form]) if device else "ws_twin_launch"


def expected_gemm_route(cfg, dt: str, qa: bool, xs=None, device: bool = False) -> list:
    """_gemm_dispatch: ``qa`` False = W4A16 (A = X), True = (deq fp16 q*s, gs float32)."""
    a, a_gs, a_quant, dot_bf16 = (dt, None, False, dt == "bfloat16") if not qa else ("float16", "float32", True, False)
    if isinstance(cfg, GLUON):
        if dt != "bfloat16" or a != "bfloat16":
            return bf16_error(cfg, dt)
        return [[gluon_launch(cfg, device), dict(cfg=str(cfg), a=a, a_gs=a_gs, x=dt, a_quant=a_quant, xs=xs)]]
    if isinstance(cfg, FragmentConfig):
        if dt != "bfloat16" or a != "bfloat16":
            return bf16_error(cfg, dt)
        return [["fragment_launch", dict(cfg=str(cfg), a=a, a_gs=a_gs, x=dt, a_quant=a_quant, pdl=False, quant_in=False,
                                         xs=None)]]
    if isinstance(cfg, SwapConfig):
        return [["swap_launch", dict(cfg=str(cfg), a=a, a_gs=a_gs, x=dt, a_quant=a_quant, dot_bf16=dot_bf16)]]
    if isinstance(cfg, SSConfig):
        return [["ss_launch", dict(cfg=str(cfg), a=a, a_gs=a_gs, x=dt, xs=xs, a_quant=a_quant, dot_bf16=dot_bf16)]]
    if isinstance(cfg, GemvConfig):
        return [["gemv_launch", dict(cfg=str(cfg), x=dt, a=a if a_quant else None, a_gs=a_gs)]]
    return [["error", "ValueError", "foursight.kernels: the dequant form quantizes the activation itself; use splice_linear"]]


def expected_linear_route(cfg, dt: str, aq: bool, igs: bool, m: int, kk: int, device: bool = False) -> list:
    """linear_run (after splice_linear's checks)."""
    if isinstance(cfg, DequantConfig):
        return [["dequant_linear", dict(cfg=str(cfg), x2=dt, input_global_scale="float32" if igs else None, act_quant=aq)]]
    if not aq:
        return expected_gemm_route(cfg, dt, False, device=device)
    frag = isinstance(cfg, (FragmentConfig, *GLUON))
    if frag and dt != "bfloat16":
        return bf16_error(cfg, dt)
    if isinstance(cfg, FragmentConfig) and cfg.quant_in and igs and m <= 4:
        return [["fragment_launch", dict(cfg=str(cfg), a=dt, a_gs="float32", x=dt, a_quant=True, pdl=False, quant_in=True,
                                         xs=None)]]
    want_xs = isinstance(cfg, (SSConfig, FragmentConfig, *GLUON)) and kk > 0
    deq = "bfloat16" if frag else "float16"
    quant = ["act_quant_launch", dict(x=dt, global_scale="float32" if igs else None, write_packed=False, write_deq=True,
                                      write_xs=want_xs, deq_dtype=deq, launch_deps=False,
                                      cols=cfg.q_split if isinstance(cfg, (FragmentConfig, StreamConfig)) else 1)]
    xs = dt if want_xs else None
    if isinstance(cfg, GLUON):
        return [quant, [gluon_launch(cfg, device), dict(cfg=str(cfg), a=deq, a_gs="float32", x=dt, a_quant=True, xs=xs)]]
    if isinstance(cfg, FragmentConfig):
        return [quant, ["fragment_launch", dict(cfg=str(cfg), a=deq, a_gs="float32", x=dt, a_quant=True, pdl=False,
                                                quant_in=False, xs=xs)]]
    return [quant, *expected_gemm_route(cfg, dt, True, xs=xs)]


def expected_route(key: str) -> list:
    tag, kk, m, dt, tag_cfg, what, aq, igs = key.split("|")
    kk, m, aq, igs, device = int(kk), int(m), aq == "True", igs == "True", tag == "device"
    bf16 = dt == "bfloat16"
    path = datapath(m)
    if what == "linear":
        if not tag_cfg:
            cfg = interp_config(path, m, bf16)
        else:
            cfg = next(c for c in CONFIGS if str(c) == tag_cfg)
        return expected_linear_route(cfg, dt, aq, igs, m, kk, device)
    if not tag_cfg:
        cfg = interp_config(path, m, bf16, "deq" if aq else "w4a16")
        cfg = INTERP_CONFIGS["mid"] if isinstance(cfg, DequantConfig) else cfg
    else:
        cfg = next(c for c in CONFIGS if str(c) == tag_cfg)
    return expected_gemm_route(cfg, dt, aq, device=device)


# ------------------------------------------------------------------------------------------------


def test_candidates_per_switch_setting_match_the_old_dispatch(observed):
    got = observed["candidates"]
    assert len(got) == len(ENVS) * 2 * len(PATHS) * len(MS) * len(FORMS) * 2
    wrong = []
    for key, cands in got.items():
        ws, stream, avail, path, m, form, bf16 = key.split("|")
        want = [str(c) for c in expected_candidates(ws, stream, avail == "True", path, int(m), form, bf16 == "True")]
        if cands != want:
            wrong.append(f"{key}: got {cands}, want {want}")
    assert not wrong, "\n".join(wrong[:10])


def test_the_expectation_can_tell_the_switches_apart(observed):
    """The pinned lists differ where the switches matter (else the test above could not fail for them)."""
    got = observed["candidates"]
    assert got["0|0|True|decode|1|linear|True"] != got["1|0|True|decode|1|linear|True"]
    assert got["0|only|True|decode|9|linear|True"] != got["0|1|True|decode|9|linear|True"]
    assert got["only|0|False|mid|1|linear|True"] == [] and got["only|0|True|prefill|1|linear|True"]


def test_each_configuration_runs_the_form_the_old_dispatch_ran(observed):
    got = observed["routes"]
    assert len(got) == 2 * 4 * 2 * (len(CONFIGS) + 1) * 6 + 2 * 2 * 2 * 6
    wrong = []
    for key, calls in got.items():
        want = expected_route(key)
        if calls != want:
            wrong.append(f"{key}:\n  got  {calls}\n  want {want}")
    assert not wrong, f"{len(wrong)} routes differ:\n" + "\n".join(wrong[:8])
