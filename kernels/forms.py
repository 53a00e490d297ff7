"""The kernel forms of the ``triton`` backend as one table, and the dispatch that reads it.

One row (:class:`KernelForm`) per form: its name (the ``form`` tag of its configurations), its
configuration class, the datapaths whose candidate lists hold its tiles, its launch, what it can
implement (:meth:`KernelForm.can_implement`: ``(ok, reason)``) and, for an experimental form, its
environment switch and the modules it lives in. The shape is vLLM's ``MPLinearKernel`` /
``choose_mp_linear_kernel`` (each kernel says ``can_implement(config) -> (ok, reason)``; a list of them
is consulted in order; ``VLLM_DISABLED_KERNELS`` read from the environment); here the autotuner
(:mod:`.tuning`) chooses among the candidate tiles, and the row of a tile is found by its
configuration's class, one dict lookup.

The rows are written in :mod:`.api` (:data:`.api.FORMS`, registered here with :func:`register`), which imports
the forms' modules; this module holds what the rows are and how they are read, below the forms (so that
the import chain stays short: ``tests/test_import_graph.py``). A new form adds its own module (its
configuration class in :mod:`.configs`, its kernel and a ``launch(cfg, ops, pw, bias, out, pdl=False)``) and
one row.

**Switches.** The experimental forms (:data:`EXPERIMENTAL`, in :mod:`.experimental`, imported by name
only when switched on) and programmatic dependent launch (``FOURSIGHT_PDL``) are switched by environment
variables that are read **once**, at the first call that needs them (:func:`switches`), not per call. A
process that changes them afterwards (a test, a benchmark timing one form against another) calls
:func:`configure` after setting them.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from foursight.nvfp4 import NVFP4Error

from . import act_quant as aq
from .backends import gluon_available, sm
from .configs import DECODE_CONFIGS, FP16_CONFIGS, MID_CONFIGS, PREFILL_CONFIGS, STREAM_CONFIGS, KernelConfig
from .runtime import interpreting, pdl_supported

if TYPE_CHECKING:
    from .prepared import PreparedWeight

PATHS: tuple[str, ...] = ("decode", "mid", "prefill")
#: The candidate lists of bf16 activations per datapath (fp16 ones: :data:`~.configs.FP16_CONFIGS`).
BF16_CANDIDATES: dict = {"decode": DECODE_CONFIGS, "mid": MID_CONFIGS, "prefill": PREFILL_CONFIGS}

#: Why programmatic dependent launch was turned off in this process (a failed PDL build), if it was;
#: the benchmarks record it. Empty: PDL is used wherever :func:`switches` says so.
PDL_ERRORS: list = []


class Operands(NamedTuple):
    """What a GEMM launch reads: ``a`` the A operand (X itself in W4A16, else the quantizer's ``q*s``)
    with ``a_gs`` its per-row global scales (None in W4A16), ``x`` the source of the BF16 columns, ``xs``
    the dense ``X[:, S]`` the quantizer wrote (or None) and ``a_quant`` whether A is quantized."""

    a: torch.Tensor
    a_gs: torch.Tensor | None
    x: torch.Tensor
    xs: torch.Tensor | None
    a_quant: bool


class Switch(NamedTuple):
    """An environment switch: ``only`` makes the form's tiles the only candidates where it applies; ``on``
    lists the values that add its tiles (None: any value but ``0``); any other value leaves it off."""

    env: str
    on: tuple[str, ...] | None = ("1",)

    def read(self) -> str:
        value = os.environ.get(self.env, "0")
        if value == "only":
            return "only"
        return "on" if (value != "0" if self.on is None else value in self.on) else "off"


@dataclass(frozen=True)
class KernelForm:
    """One kernel form: a row of :data:`FORMS`."""

    name: str
    config: type
    #: datapaths whose candidate lists hold its tiles (an experimental form: where ``on`` adds them)
    datapaths: tuple[str, ...]
    #: ``launch(cfg, ops: Operands, pw, bias, out, pdl=False)``; None: the form cannot run on given
    #: operands (the dequant form quantizes the activation itself: its :attr:`linear` does it all)
    launch: Callable | None
    #: the whole linear, ``linear(cfg, x2, pw, bias, input_global_scale, act_quant, out)``, for a form that
    #: quantizes the activation its own way
    linear: Callable | None = None
    #: bf16 activations only; the quantizer then writes ``q*s`` in bf16 (else fp16)
    bf16_only: bool = False
    #: reads the dense ``X[:, S]`` from the quantizer (else it gathers the columns from X by index)
    reads_xs: bool = False
    #: the most rows it takes (the one-row GEMV); None: any
    max_m: int | None = None
    #: its own W4A4 road, tried before the quantizer: ``w4a4(cfg, x2, pw, bias, input_global_scale, out)``
    #: -> whether it ran (False where it does not apply)
    w4a4: Callable | None = None
    #: launched with programmatic dependent launch after the quantizer where :func:`switches` allows it
    pdl: bool = False
    #: reads a producer's quantized operands (:func:`.api.splice_linear` of a ``ProducedInput``)
    produced: bool = False
    #: experimental: the switch, its support rule (``rule(capability)``: None where it can run, else why not),
    #: the module of its kernels and its plain-Triton twin (the interpreter's)
    switch: Switch | None = None
    rule: Callable | None = None
    module: str | None = None
    twin: str | None = None
    #: experimental: its tiles when switched ``on`` (``tiles(path, m)``) and ``only`` (``only_tiles(path)``),
    #: and the datapaths ``only`` applies to
    tiles: Callable | None = None
    only_tiles: Callable | None = None
    only_paths: tuple[str, ...] = PATHS

    def can_implement(self, x_dtype: torch.dtype, a_dtype: torch.dtype | None = None) -> tuple[bool, str | None]:
        """``(ok, reason)``: whether this form runs on activations ``x`` of ``x_dtype`` with an A operand of
        ``a_dtype`` (default ``x_dtype``), else why not (bf16-only forms name the activation's dtype)."""
        if self.bf16_only and (x_dtype != torch.bfloat16 or (a_dtype or x_dtype) != torch.bfloat16):
            return False, f"the {self.name} form takes bf16 activations, got {x_dtype}"
        return True, None

    def candidates_when(self, mode: str, available: bool, path: str, m: int, base) -> list | None:
        """An experimental form's say in the candidate list, switched ``mode``: a list, or None (no say)."""
        if mode == "only" and path in self.only_paths:
            return list(self.only_tiles(path)) if available else []
        if mode == "on" and path in self.datapaths and available:
            return [*base, *self.tiles(path, m)]
        return None


def stream_candidates(m: int) -> list:
    """The register-streaming tiles the autotuner times at M = ``m`` (decode) with ``FOURSIGHT_STREAM=1``:
    those whose token tile is the smallest that holds M (8 or 16 rows)."""
    bm = 8 if m <= 8 else 16
    return [c for c in STREAM_CONFIGS if c.block_m == bm]


# --------------------------------------------------------------------------------------------
# the experimental forms' launches and rules (their modules imported by name, when switched on)
# --------------------------------------------------------------------------------------------


@functools.cache
def form_module(name: str, interpreted: bool = False) -> ModuleType:
    """The module of the experimental form ``name`` (its plain-Triton twin when ``interpreted``), imported now."""
    row = FORMS[name]
    return importlib.import_module(row.twin if interpreted else row.module)


def gluon_launch(entry: str) -> Callable:
    """The launch of a Gluon form whose kernel module names it ``entry``; under the interpreter its twin's."""
    def launch(cfg, o: Operands, pw, bias, out, pdl: bool = False):
        interp = interpreting()
        run = getattr(form_module(cfg.form, interp), "ws_twin_launch" if interp else entry)
        return run(cfg, o.a.contiguous(), o.a_gs, o.x.contiguous(), pw, bias, out, o.a_quant, xs=o.xs)
    return launch


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

def gluon_rule(what: str) -> Callable:
    """The support rule of a Gluon form: CUDA sm_90 with ``triton.experimental.gluon``."""
    def rule(cap):
        if cap is not None and cap[0] == 9 and gluon_available():
            return None
        return f"the Gluon {what} form needs sm_90 and triton.experimental.gluon; this is {sm(cap)}"
    return rule


#: Every kernel form of the ``triton`` backend by name (the rows :mod:`.api` registers); the experimental
#: ones are consulted for the candidate lists in this order (the first switched on that has a say decides).
FORMS: dict[str, KernelForm] = {}
#: The experimental rows, in the order they are consulted.
EXPERIMENTAL: list[KernelForm] = []
_BY_CONFIG: dict[type, KernelForm] = {}


def register(*rows: KernelForm) -> None:
    """Add rows to the table (a configuration class has one row)."""
    for f in rows:
        if f.config in _BY_CONFIG:
            raise ValueError(f"foursight.kernels: {f.config.__name__} already has the form {_BY_CONFIG[f.config].name!r}")
        FORMS[f.name] = f
        _BY_CONFIG[f.config] = f
        if f.switch is not None:
            EXPERIMENTAL.append(f)
    _READ.clear()  # read the switches of the new rows too


def form_of(cfg: KernelConfig) -> KernelForm:
    """The row of ``cfg``'s form (by its class)."""
    try:
        return _BY_CONFIG[type(cfg)]
    except KeyError:
        raise ValueError(f"foursight.kernels: unknown configuration {cfg!r}") from None


# --------------------------------------------------------------------------------------------
# the switches, read once
# --------------------------------------------------------------------------------------------


class Switches(NamedTuple):
    """The environment as the kernels read it: per experimental form ``(mode, available)`` (``mode`` off, on
    or only; ``available``: its module's ``available()`` where switched on), and whether PDL is used."""

    forms: dict
    pdl: bool


_READ: list = []  # the one reading of the environment (a list of at most one Switches)


def configure() -> Switches:
    """Read the switches from the environment now (``FOURSIGHT_WS``, ``FOURSIGHT_STREAM``, ``FOURSIGHT_PDL``)
    and keep them for every later call: call it after changing them in a running process."""
    forms = {}
    for f in EXPERIMENTAL:
        mode = f.switch.read()
        forms[f.name] = (mode, mode != "off" and form_module(f.name).available())  # imported only when switched on
    _READ[:] = [Switches(forms, pdl_supported())]
    return _READ[0]


def switches() -> Switches:
    """The switches as read at first use (or by the last :func:`configure`)."""
    return _READ[0] if _READ else configure()


# --------------------------------------------------------------------------------------------
# the dispatch: table lookups
# --------------------------------------------------------------------------------------------


def candidates(path: str, m: int, form: str, bf16: bool = True) -> list:
    """Configurations the autotuner may time for ``path``. ``form``: "deq" (splice_gemm on the fp16
    q*s), "w4a16" (splice_gemm or splice_linear without activation quantization) or "linear"
    (splice_linear W4A4: the quantization is part of what is timed). BF16 activations take the
    lists of :mod:`.configs` (fragment and dequant forms, which read the one resident weight form), plus
    or instead of an experimental form's tiles where its switch says so; fp16 activations and the fp16
    ``q*s`` of splice_gemm take :data:`~.configs.FP16_CONFIGS`."""
    if form == "deq" or not bf16:
        return [c for c in FP16_CONFIGS[path] if (mx := form_of(c).max_m) is None or m <= mx]
    # an 8-row token tile only where M <= 4: the autotuner's decode buckets up to 4 are one M each, while the
    # bucket of M 5..16 would run it as two or more token tiles, each reading the whole weight (tuning.m_bucket)
    base = [c for c in BF16_CANDIDATES[path] if getattr(c, "block_m", 16) >= 16 or m <= 4]
    state = switches().forms
    for f in EXPERIMENTAL:
        got = f.candidates_when(*state[f.name], path, m, base)
        if got is not None:
            return got
    return list(base)


def require(row: KernelForm, x_dtype, a_dtype=None) -> None:
    """Raise :class:`NVFP4Error` with the reason where ``row`` cannot implement these operands."""
    ok, why = row.can_implement(x_dtype, a_dtype)
    if not ok:
        raise NVFP4Error(f"foursight.kernels: {why}")


def gemm_run(cfg: KernelConfig, x, pw: PreparedWeight, qa, bias, out, xs=None):
    """Run the GEMM of ``cfg``'s form. ``qa`` None (W4A16: A = X) or ``(deq q*s, gs [M])``."""
    row = form_of(cfg)
    if row.launch is None:
        raise ValueError(f"foursight.kernels: the {row.name} form quantizes the activation itself; use splice_linear")
    ops = Operands(x, None, x, xs, False) if qa is None else Operands(qa[0], qa[1], x, xs, True)
    require(row, x.dtype, ops.a.dtype)
    return row.launch(cfg, ops, pw, bias, out)


def linear_run(cfg: KernelConfig, x2, pw: PreparedWeight, bias, input_global_scale, act_quant: bool, out):
    """One W4A4/W4A16 linear with configuration ``cfg``: activation quantization (if W4A4) + GEMM."""
    row = form_of(cfg)
    if row.linear is not None:
        return row.linear(cfg, x2, pw, bias, input_global_scale, act_quant, out)
    if not act_quant:
        return gemm_run(cfg, x2, pw, None, bias, out)
    require(row, x2.dtype)
    if row.w4a4 is not None and row.w4a4(cfg, x2, pw, bias, input_global_scale, out):
        return out
    # X[:, S]: the wgmma forms read it contiguous from the quantizer (its ``write_xs`` copy). For the fragment
    # tiles this measured cheaper than gathering it by channel index in the GEMM, before or after the FP4
    # loop (H100, 8192², M = 16 / 64: the columns +2.1 / +2.0 µs dense against +3.8 / +9.9 µs gathered,
    # the copy +0.4 / +0.1 µs in the quantizer; benchmarks/results/h100-2026-12-06b-v4/columns.json)
    want_xs = row.reads_xs and pw.num_channels > 0
    pdl = row.pdl and x2.is_cuda and not PDL_ERRORS and switches().pdl
    if row.pdl:
        x2 = x2.contiguous()  # before the quantizer: nothing may run between it and a PDL-launched GEMM
    _, _, deq, gs, xs = aq.act_quant_launch(x2, pw.channel_mask, pw.bf16_channels, input_global_scale, False, True, want_xs,
                                            deq_dtype=torch.bfloat16 if row.bf16_only else torch.float16,
                                            launch_deps=pdl, cols=getattr(cfg, "q_split", 1))
    ops = Operands(deq, gs, x2, xs, True)
    if pdl:
        try:
            return row.launch(cfg, ops, pw, bias, out, pdl=True)
        except Exception as e:  # noqa: BLE001 - a Triton whose PDL build fails: run without it from now on
            PDL_ERRORS.append(f"{type(e).__name__}: {str(e)[:300]}")
    return row.launch(cfg, ops, pw, bias, out)
