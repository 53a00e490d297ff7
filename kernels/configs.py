"""Named, frozen tile configurations of the SpliceGEMM kernel forms, and the candidate lists the
autotuner times per datapath (:mod:`foursight.kernels.tuning`).

One dataclass per kernel form; ``form`` names the form and ``str(cfg)`` is the compact
``form/field/field/...`` tag the benchmarks write to JSON. A configuration that a form cannot run
correctly is refused when it is built (``__post_init__``), not at launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import astuple, dataclass
from typing import ClassVar, Union


@dataclass(frozen=True)
class _Config:
    form: ClassVar[str] = ""

    def __str__(self) -> str:
        return "/".join([self.form, *map(str, astuple(self))])


@dataclass(frozen=True)
class GemvConfig(_Config):
    """One-row decode GEMV (:mod:`.gemv`): ``block_n`` output rows per program, K in ``block_k`` steps.

    The weight is read as 32-bit words and decoded in PTX (its portable twin in the interpreter)."""

    form: ClassVar[str] = "gemv"
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.block_k % 32:
            raise ValueError(f"GemvConfig.block_k: a multiple of 32 (4 words of 8 codes), got {self.block_k}")


@dataclass(frozen=True)
class _PackedTileConfig(_Config):
    """The fields of the wgmma tiles that read the compressed-tensors packed layout (swap and SS):
    a ``block_m`` x ``block_n`` output tile, K in ``block_k`` steps, ``num_warps`` warps,
    ``num_stages`` pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class SwapConfig(_PackedTileConfig):
    """Swap-AB wgmma tile (:mod:`.swap`): ``Yᵀ[block_n, block_m]`` with the decoded weight as the
    register operand; ``split_k`` 0 = automatic (about 4 programs per SM), 1 = no split.

    ``num_warps`` must be 4 (one warpgroup): with two warpgroups the BF16-segment MMA after the
    pipelined main loop returned garbage in 1-2 of 60 calls on the H200 (docs/kernels.md, "The W4A16
    prefill race"), so such a configuration is refused."""

    form: ClassVar[str] = "swap"
    split_k: int = 0

    def __post_init__(self):
        if self.num_warps != 4:
            raise ValueError(
                f"SwapConfig.num_warps: the swap form runs one warpgroup (4 warps), got {self.num_warps}; "
                "two warpgroups race in the BF16 segment (docs/kernels.md)"
            )


@dataclass(frozen=True)
class SSConfig(_PackedTileConfig):
    """SS wgmma tile (:mod:`.ss`): ``Y[block_m, block_n]``, both MMA operands in shared memory;
    ``prefetch`` loads the next packed weight tile into registers before the current decode."""

    form: ClassVar[str] = "ss"
    prefetch: bool = False


@dataclass(frozen=True)
class DequantConfig(_Config):
    """Dequantize-then-cuBLAS (:mod:`.dequant`): the weight-dequantization kernel's tile
    ``[block_n, block_k]`` over the fragment form (``block_n`` a multiple of 64, the stored block;
    ``block_k`` 128 or 256); the GEMM itself is one cuBLAS call."""

    form: ClassVar[str] = "dequant"
    block_n: int
    block_k: int
    num_warps: int = 4

    def __post_init__(self):
        if self.block_n % 64 or self.block_k not in (128, 256):
            raise ValueError(f"DequantConfig: block_n a multiple of 64 and block_k 128 or 256 (the fragment form's blocks), got {self}")


@dataclass(frozen=True)
class FragmentConfig(_Config):
    """Fragment-layout swap-AB wgmma tile (:mod:`.fragment`, BF16 activations only): ``Yᵀ[block_n,
    block_m]`` from the weight's fragment execution form; ``split_k`` 0 = automatic, 1 = no split.

    ``block_n`` a multiple of 64 (the stored block) and ``block_k`` 128 or 256 (one or two stored
    chunks; K is stored padded to 256). The stored layout is that of a 4-warp wgmma, so with 8 warps
    (``num_warps``) the decoded tile is still correct but may pass through a layout conversion (the
    offline SASS says whether it does). The issue-36 options (triton_kernels' recipe and the
    quantization off the critical path), each timed by the autotuner against the plain tile:

    * ``narrow``: at M below ``block_m`` only the next power of two >= M activation rows are loaded
      (and repeated to the tile) instead of ``block_m`` rows that all re-read row 0 at M = 1;
    * ``quant_in``: W4A4 with a static activation scale at M <= ``fragment.QUANT_IN_MAX_M``: each
      program quantizes the activation slice it consumes (no quantizer launch; bit-identical ``q*s``);
      elsewhere the tile runs as without it;
    * ``persistent``: as many programs as fit on the GPU at once walk the (tile, split) work items;
    * ``q_split``: the standalone quantizer (dynamic scale, or M above ``QUANT_IN_MAX_M``) runs
      ``q_split`` programs per row instead of one (:func:`.act_quant.act_quant_launch`);
    * ``cols_late``: the BF16 columns' loads follow the FP4 loop instead of preceding it (their W[:, S]
      rows prefetched into L2 before it), each split's share even and in one step
      (:func:`.split_k.segment_plan`). Offline sm_90a SASS showed the preloaded columns stored to shared
      memory *before* the loop's first copies, so every program's FP4 stream waited for them
      (docs/kernels.md, "Why the columns cost more than their bytes"). Left out of ``str()`` when off, so
      the tags of the other tiles stay as the benchmarks recorded them.
    * ``zfill`` (issue 52 item 2): the activation tile's rows >= M are masked loads that zero-fill shared memory,
      so the tile goes by asynchronous copies straight into the MMA operand: no per-step store of a narrow
      row into ``block_m`` shared rows and no barrier of its own. ``block_m`` may then be 8 (an ``n = 8`` wgmma).
      Not with ``narrow`` or ``quant_in``; left out of ``str()`` when off, as ``cols_late``.
    """

    form: ClassVar[str] = "fragment"
    block_m: int
    block_n: int
    block_k: int = 128
    num_stages: int = 3
    split_k: int = 0
    #: register cap per thread for ptxas (0 = the compiler's choice): 128 lets four one-warpgroup
    #: programs share an SM instead of three (the decode tiles use 140)
    max_regs: int = 0
    num_warps: int = 4
    narrow: bool = False
    quant_in: bool = False
    persistent: bool = False
    q_split: int = 1
    cols_late: bool = False
    zfill: bool = False

    #: trailing fields left out of ``str()`` while off (added after the benchmarks recorded tags)
    _TAIL: ClassVar[tuple] = ("cols_late", "zfill")

    def __str__(self) -> str:
        tag = super().__str__().split("/")
        for name in reversed(self._TAIL):
            if getattr(self, name):
                break
            tag.pop()
        return "/".join(tag)

    def __post_init__(self):
        if (self.block_n % 64 or self.block_k not in (128, 256) or self.block_m not in (8, 16, 32, 64, 128, 256)
                or self.max_regs not in (0, *range(64, 256, 8)) or self.num_warps not in (4, 8)
                or self.q_split not in (1, 2, 4, 8, 16) or (self.block_m == 8 and not self.zfill)
                or (self.zfill and (self.narrow or self.quant_in))):
            raise ValueError(
                f"FragmentConfig: block_n a multiple of 64, block_k 128 or 256, block_m in 16..256 (a power of two; 8 with zfill), "
                f"max_regs 0 or a multiple of 8 in 64..248, num_warps 4 or 8, q_split 1..16 (a power of two), and zfill not with "
                f"narrow or quant_in, got {self}"
            )


@dataclass(frozen=True)
class WSConfig(_Config):
    """Warp-specialized fragment tile in Gluon (:mod:`.experimental.gluon_ws`; its plain-Triton twin
    :mod:`.experimental.gluon_ws_twin` under the interpreter): ``Yᵀ[block_n, block_m]``, 256-column K steps through
    a ``num_stages``-slot TMA/mbarrier ring, ``num_warps`` consumer warps (one or two warpgroups) plus
    one producer warp; ``split_k`` 0 = automatic, 1 = no split. CUDA sm_90 with Gluon only
    (:func:`.experimental.gluon_ws.available`); BF16 activations."""

    form: ClassVar[str] = "gluon_ws"
    block_m: int
    block_n: int = 64
    num_stages: int = 3
    num_warps: int = 4
    split_k: int = 0
    #: register cap per thread of the launch (Triton's ``maxnreg``; 0 = Triton's choice, which gives the
    #: CTA the whole register file): the consumer warps get what the producer's warpgroup leaves, and
    #: 128 lets two programs share an SM, 80 three
    max_regs: int = 128

    def __post_init__(self):
        if (self.num_warps not in (4, 8) or self.block_n % 64 or not 16 * self.num_warps <= self.block_n <= 256
                or self.block_m not in (16, 32, 64, 128) or not 1 <= self.num_stages <= 6
                or self.max_regs not in (0, *range(64, 257, 8))):
            raise ValueError(
                f"WSConfig: num_warps 4 or 8, block_n a multiple of 64 (the stored block) from 16 x num_warps to 256, "
                f"block_m in 16..128 (a power of two), 1..6 stages and max_regs 0 or a multiple of 8 in 64..256, got {self}"
            )


@dataclass(frozen=True)
class StreamConfig(_Config):
    """Register-streaming fragment tile in Gluon (:mod:`.experimental.gluon_stream`; its plain-Triton twin
    :mod:`.experimental.gluon_ws_twin` with ``cols_mma`` under the interpreter): ``Yᵀ[block_n, block_m]`` per program of
    one or two consumer warpgroups (64 output rows each), the program's activation slice in shared memory
    once, the weight words streamed from global memory into registers ``depth`` 256-column steps ahead (1 or
    2); ``split_k`` 0 = automatic; ``mma_async``: the steps unrolled with one ``wgmma`` in flight across the
    next step's decode. CUDA sm_90 with Gluon only (:func:`.experimental.gluon_ws.available`); BF16 activations; decode
    (M <= 16 rows a tile)."""

    form: ClassVar[str] = "gluon_stream"
    block_m: int = 8
    depth: int = 2
    split_k: int = 0
    #: register cap per thread (Triton's ``maxnreg``; 0 = the compiler's choice)
    max_regs: int = 0
    #: output rows per program: 64 per consumer warpgroup (the stored block), so ``16 · num_warps``; the words'
    #: load layout (:func:`.experimental.gluon_stream.words_layout`) then converts to the wgmma operand without data movement
    block_n: int = 64
    #: 4 (one warpgroup) or 8 (two consumer warpgroups, each its own 64 rows and its own wgmma)
    num_warps: int = 4
    #: programs per row of the activation quantizer before it (W4A4), as :class:`FragmentConfig`'s
    q_split: int = 8
    #: activation slots of a ring in shared memory (one barrier a step; the split plan is then free of the
    #: slice's size); 0 = the program's whole activation slice, loaded once
    ring: int = 0
    #: one ``wgmma`` left in flight across the next step's decode (the steps unrolled; not with a ring)
    mma_async: bool = False

    def __post_init__(self):
        if (self.block_m not in (8, 16, 32) or self.depth not in (1, 2) or self.num_warps not in (4, 8)
                or self.block_n != 16 * self.num_warps or self.split_k < 0 or self.max_regs not in (0, *range(64, 257, 8))
                or self.q_split not in (1, 2, 4, 8, 16) or self.ring not in (0, 2, 3, 4, 6, 8)
                or (self.mma_async and self.ring)):
            raise ValueError(
                f"StreamConfig: block_m 8, 16 or 32, depth 1 or 2, num_warps 4 or 8 (one or two warpgroups) with block_n "
                f"16 x num_warps, split_k >= 0, max_regs 0 or a multiple of 8 in 64..256, q_split 1..16 (a power of two), "
                f"ring 0, 2, 3, 4, 6 or 8, and mma_async only without a ring, got {self}"
            )


KernelConfig = Union[GemvConfig, SwapConfig, SSConfig, DequantConfig, FragmentConfig, WSConfig, StreamConfig]

# The candidate lists. **First-candidate rule:** with autotuning off (``FOURSIGHT_KERNELS_AUTOTUNE=0``),
# under CUDA-graph capture of a key never run eagerly, and wherever :func:`.tuning.pick_config` does not
# time, the *first* configuration of a list runs; so each list starts with its safest measured tile
# (the v3 form the H200 measured), and a new, unmeasured form never goes first.

#: The triton_kernels recipe (issue 36 item 3) in the fragment form: 8 warps, block_n 128-256, a
#: register cap that lets 2 programs share an SM, persistent over (tile, split), 4 stages, and an
#: activation tile of M rows. Unmeasured: autotune candidates after the measured tiles.
RECIPE_CONFIGS: tuple = (
    FragmentConfig(16, 128, 128, 4, max_regs=128, num_warps=8, narrow=True, persistent=True),
    FragmentConfig(16, 256, 128, 4, max_regs=128, num_warps=8, narrow=True, persistent=True),
    FragmentConfig(16, 128, 256, 4, max_regs=128, num_warps=8, narrow=True, persistent=True),
)

#: The BF16 columns loaded after the FP4 loop (``cols_late``), on the two tiles the H100 grid chose for
#: W4A4 k = 128 at 8192² (M = 16 and M = 64, benchmarks/results/h100-2026-12-06-v4/splice_gemm.json).
#: Unmeasured: autotune candidates after the measured tiles.
COLUMNS_LATE_CONFIGS: tuple = (
    FragmentConfig(16, 64, 256, 3, max_regs=128, narrow=True, q_split=8, cols_late=True),
    FragmentConfig(64, 64, q_split=8, cols_late=True),
)

#: The activation rows by zero-filling copies (``zfill``, issue 52 item 2) on the H100's M = 16 decode tile
#: (instead of its narrow row; uncapped: at 128 registers it spills) and as an 8-row tile (M <= 4 only:
#: :func:`.forms.candidates`), one with the BF16 columns after the loop. The MMA then reads the pipelined
#: buffer, so Triton keeps one wgmma in flight across steps. Unmeasured: autotune candidates after the measured tiles.
ZFILL_CONFIGS: tuple = (
    FragmentConfig(16, 64, 256, 3, q_split=8, zfill=True),
    FragmentConfig(8, 64, 256, 3, max_regs=128, q_split=8, zfill=True),
    FragmentConfig(8, 64, 256, 3, max_regs=128, q_split=8, cols_late=True, zfill=True),
)

# The v3 tiles kept below are those the H200 grid chose somewhere (benchmarks/results/h200-2026-12-05/
# splice_gemm.json, "*_config"); the ones it never chose left the lists (fewer compilations and timings
# per key). Each list starts with a tile that grid chose.

#: Decode datapath (M <= DECODE_MAX_M), bf16 activations: the fragment form only (the GEMV, swap and
#: SS tiles were never chosen for bf16 on the H200 and read another weight layout; see
#: :data:`FP16_CONFIGS`). The v3 tiles first, then the issue-36 forms (narrow activation tile,
#: quantization in the GEMM or split over programs, the recipe).
DECODE_CONFIGS: tuple = (
    FragmentConfig(16, 128),
    FragmentConfig(16, 64, 256, 3),
    FragmentConfig(16, 128, 256, 3),
    FragmentConfig(16, 64, 256, 3, max_regs=128),
    FragmentConfig(16, 64, 128, 3, max_regs=128),
    FragmentConfig(16, 128, narrow=True),
    FragmentConfig(16, 64, 256, 3, narrow=True),
    FragmentConfig(16, 128, narrow=True, quant_in=True),
    FragmentConfig(16, 64, 256, 3, narrow=True, quant_in=True),
    FragmentConfig(16, 128, narrow=True, q_split=8),
    FragmentConfig(16, 64, 256, 3, max_regs=128, narrow=True, q_split=8),
    *RECIPE_CONFIGS,
    COLUMNS_LATE_CONFIGS[0],
    *ZFILL_CONFIGS,
)
#: Mid datapath (DECODE_MAX_M < M <= 128), bf16 activations. ``split_k`` 4 and 2 spread the BF16 columns
#: (and K) over several programs per tile where the automatic plan gives one (M = 64: 9-17 µs of serial
#: segment in v3, benchmarks/results/h200-2026-12-05/breakdown.md).
MID_CONFIGS: tuple = (
    FragmentConfig(64, 64),
    FragmentConfig(32, 64),
    FragmentConfig(64, 64, 128, 3, max_regs=128),
    DequantConfig(64, 256),
    FragmentConfig(64, 64, split_k=4),
    FragmentConfig(64, 128, split_k=2),
    FragmentConfig(64, 64, q_split=8),
    FragmentConfig(64, 128, 128, 4, max_regs=128, num_warps=8, persistent=True),
    FragmentConfig(64, 256, 128, 3, max_regs=128, num_warps=8, persistent=True),
    COLUMNS_LATE_CONFIGS[1],
)
#: The v3 prefill tile with its BF16 columns loaded after the FP4 loop (``cols_late``), so that two programs
#: (two warpgroups) share every SM at k > 0 as they do at k = 0 (issue 36 item 4). Offline sm_90a (Triton
#: 3.6, docs/kernels.md): ``FragmentConfig(128, 64)`` asks 105 KB of shared memory at k = 0 but 117 KB with
#: the columns preloaded before its loop, so at k > 0 one program runs per SM (on the H100, 4096 x 14336,
#: M = 256: the GEMM 85.5 µs against 62.5 at k = 0); after the loop they reuse the pipeline's buffers
#: (105 KB). ``q_split`` 8 spreads the quantizer, 7-15 µs at M = 256, over 8 programs a row. Measured
#: (benchmarks/results/h100-2026-12-06f-v4/): chosen for k = 128 in all three M = 256 cells; the 2-stage
#: tile and the 8-warp 2-stage tiles tried beside it were never chosen and left.
PREFILL_COLS_LATE_CONFIGS: tuple = (
    FragmentConfig(128, 64, cols_late=True),
    FragmentConfig(128, 64, q_split=8, cols_late=True),
)
#: Prefill datapath (M > 128), bf16 activations.
PREFILL_CONFIGS: tuple = (
    FragmentConfig(128, 64),
    DequantConfig(64, 256),
    DequantConfig(128, 256, 8),
    FragmentConfig(128, 128, 128, 3, max_regs=128, num_warps=8, persistent=True),
    FragmentConfig(128, 256, 128, 3, num_warps=8, persistent=True),
    *PREFILL_COLS_LATE_CONFIGS,
)
#: Warp-specialized Gluon tiles (:class:`WSConfig`, :mod:`.experimental.gluon_ws`): **not candidates by
#: default** (measured slower than the fragment form in every cell on the H200:
#: benchmarks/results/h200-2026-12-05-ws/bench_ws.md). ``FOURSIGHT_WS=1`` adds them to the decode and mid
#: candidates where Gluon runs; ``FOURSIGHT_WS=only`` makes them the only candidates of every path
#: (``prefill`` then takes its list: benchmarks time the form alone at M = 256). Shared memory per stage:
#: block_m x 512 + block_n x 128 bytes.
WS_CONFIGS: dict = {
    "decode": (
        WSConfig(16, 64, 4, 4),
        WSConfig(16, 64, 4, 4, max_regs=80),
        WSConfig(16, 128, 4, 4),
        WSConfig(16, 128, 4, 8),
        WSConfig(16, 64, 6, 4),
    ),
    "mid": (
        WSConfig(32, 64, 4, 4),
        WSConfig(32, 64, 4, 4, max_regs=80),
        WSConfig(64, 64, 3, 4),
        WSConfig(64, 128, 3, 8),
        WSConfig(32, 128, 4, 8),
        WSConfig(128, 64, 2, 4),
    ),
    "prefill": (
        WSConfig(128, 64, 2, 4),
        WSConfig(128, 128, 2, 8),
        WSConfig(64, 128, 3, 8),
    ),
}
#: Register-streaming Gluon tiles (:class:`StreamConfig`, :mod:`.experimental.gluon_stream`, issue 36 item 3): **not
#: candidates by default** (measured slower than the fragment tiles in every decode cell of the H100 grid,
#: benchmarks/results/h100-2026-12-06e-v4/). ``FOURSIGHT_STREAM=1`` adds the tiles whose token tile fits M to
#: the decode candidates where Gluon runs (:func:`.forms.stream_candidates`); ``only`` makes this whole list
#: the only decode candidates.
STREAM_CONFIGS: tuple = (
    StreamConfig(8, 2),
    StreamConfig(8, 1),
    StreamConfig(16, 2),
    StreamConfig(16, 1),
    StreamConfig(16, 1, ring=4),
    StreamConfig(16, 2, ring=4),
    # issue 36 item 3 in full (offline sm_90a, Triton 3.6, benchmarks/results/sass_stream_v2/): two consumer
    # warpgroups (8 warps, 128 rows), capped at 128 registers (2 programs a SM) or not (163-175, one);
    # one wgmma in flight with the steps unrolled (244-255 registers); and both
    StreamConfig(8, 1, max_regs=128, block_n=128, num_warps=8),
    StreamConfig(8, 2, block_n=128, num_warps=8),
    StreamConfig(8, 2, mma_async=True),
    StreamConfig(8, 2, block_n=128, num_warps=8, mma_async=True),
    StreamConfig(16, 1, max_regs=128, block_n=128, num_warps=8),
    StreamConfig(16, 2, block_n=128, num_warps=8),
    StreamConfig(16, 2, mma_async=True),
    StreamConfig(16, 1, block_n=128, num_warps=8, mma_async=True),
)
#: fp16 activations (and ``splice_gemm`` on an fp16 ``q*s``): the fragment and dequant forms take
#: bf16 only, so fp16 models run the forms that read the compressed-tensors packed layout, which the
#: layer then rebuilds once from the fragment form and keeps (a second resident form, for fp16 only).
FP16_CONFIGS: dict = {
    "decode": (
        GemvConfig(8, 1024, 4),
        GemvConfig(16, 512, 4),
        SwapConfig(16, 64, 256),
        SwapConfig(16, 32, 256),
    ),
    "mid": (
        SwapConfig(32, 64, 256, 4, 3),
        SwapConfig(64, 64, 128, 4, 4),
        SSConfig(64, 64, 128, 4, 4),
    ),
    "prefill": (
        SSConfig(256, 128, 64, 8, 3, True),
        SSConfig(256, 64, 64, 8, 4, True),
        SSConfig(128, 128, 64, 4, 4),
    ),
}
#: Fixed small tiles for Triton's CPU interpreter (tests), per datapath: bf16 activations run the
#: default forms (fragment, dequant), fp16 the packed-layout forms (``"fp16:<path>"``).
INTERP_CONFIGS: dict = {
    "decode": FragmentConfig(16, 64, 128, 1, 0),
    "mid": FragmentConfig(32, 64, 128, 1, 0),
    "prefill": DequantConfig(64, 128),
    "fp16:gemv": GemvConfig(16, 64),
    "fp16:decode": SwapConfig(16, 16, 64, 4, 1),
    "fp16:mid": SwapConfig(32, 32, 32, 4, 1, 1),
    "fp16:prefill": SSConfig(32, 32, 32, 4, 1, True),
}


def interp_config(path: str, m: int, bf16: bool = True, form: str = "linear") -> KernelConfig:
    """The interpreter's tile (:data:`INTERP_CONFIGS`) for ``path``: fp16 activations or the fp16 ``q*s``
    (``form`` "deq") take the packed-layout forms, the GEMV at one row."""
    if form == "deq" or not bf16:
        return INTERP_CONFIGS["fp16:gemv"] if m == 1 else INTERP_CONFIGS[f"fp16:{path}"]
    return INTERP_CONFIGS[path]


_FORMS: dict = {c.form: c for c in (GemvConfig, SwapConfig, SSConfig, DequantConfig, FragmentConfig, WSConfig, StreamConfig)}


def config_from_str(tag: str) -> KernelConfig:
    """The configuration whose ``str()`` is ``tag`` (``form/field/...``, as the benchmarks write it)."""
    form, *vals = tag.split("/")
    if form not in _FORMS:
        raise ValueError(f"config_from_str: unknown form {form!r} in {tag!r}")
    cls = _FORMS[form]
    fields = dataclasses.fields(cls)
    if len(vals) > len(fields):
        raise ValueError(f"config_from_str: {tag!r} has {len(vals)} fields, {cls.__name__} {len(fields)}")
    kw = {f.name: (v == "True") if f.type in (bool, "bool") else int(v) for f, v in zip(fields, vals)}
    return cls(**kw)
