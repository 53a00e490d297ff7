"""Named, frozen tile configurations of the SpliceGEMM kernel forms, and the candidate lists the
autotuner times per datapath (:mod:`foursight.kernels.tuning`).

One dataclass per kernel form; ``form`` names the form and ``str(cfg)`` is the compact
``form/field/field/...`` tag the benchmarks write to JSON. A configuration that a form cannot run
correctly is refused when it is built (``__post_init__``), not at launch.
"""

from __future__ import annotations

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

    One warpgroup (the stored layout is that of a 4-warp wgmma), ``block_n`` a multiple of 64 (the
    stored block) and ``block_k`` 128 or 256 (one or two stored chunks; K is stored padded to 256)."""

    form: ClassVar[str] = "fragment"
    block_m: int
    block_n: int
    block_k: int = 128
    num_stages: int = 3
    split_k: int = 0
    #: register cap per thread for ptxas (0 = the compiler's choice): 128 lets four one-warpgroup
    #: programs share an SM instead of three (the decode tiles use 140)
    max_regs: int = 0

    def __post_init__(self):
        if (self.block_n % 64 or self.block_k not in (128, 256) or self.block_m not in (16, 32, 64, 128, 256)
                or self.max_regs not in (0, *range(64, 256, 8))):
            raise ValueError(
                f"FragmentConfig: block_n a multiple of 64, block_k 128 or 256, block_m in 16..256 (a power of two) and max_regs 0 or a multiple of 8 in 64..248, got {self}"
            )


@dataclass(frozen=True)
class WSConfig(_Config):
    """Warp-specialized fragment tile in Gluon (:mod:`.gluon_ws`; its plain-Triton twin
    :mod:`.gluon_ws_twin` under the interpreter): ``Yᵀ[block_n, block_m]``, 256-column K steps through
    a ``num_stages``-slot TMA/mbarrier ring, ``num_warps`` consumer warps (one or two warpgroups) plus
    one producer warp; ``split_k`` 0 = automatic, 1 = no split. CUDA sm_90 with Gluon only
    (:func:`.gluon_ws.available`); BF16 activations."""

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


KernelConfig = Union[GemvConfig, SwapConfig, SSConfig, DequantConfig, FragmentConfig, WSConfig]

#: Decode datapath (M <= DECODE_MAX_M), bf16 activations: the fragment form only (the GEMV, swap and
#: SS tiles were never chosen for bf16 on the H200 and read another weight layout; see
#: :data:`FP16_CONFIGS`).
DECODE_CONFIGS: tuple = (
    FragmentConfig(16, 64),
    FragmentConfig(16, 128),
    FragmentConfig(16, 64, 128, 4),
    FragmentConfig(16, 64, 256, 3),
    FragmentConfig(16, 128, 256, 3),
    FragmentConfig(16, 256, 128, 2),
    FragmentConfig(16, 64, 256, 3, max_regs=128),
    FragmentConfig(16, 64, 128, 3, max_regs=128),
)
#: Mid datapath (DECODE_MAX_M < M <= 128), bf16 activations.
MID_CONFIGS: tuple = (
    FragmentConfig(32, 64),
    FragmentConfig(64, 64),
    FragmentConfig(64, 128),
    FragmentConfig(128, 64),
    FragmentConfig(32, 128, 256, 3),
    FragmentConfig(64, 128, 256, 2),
    FragmentConfig(64, 64, 128, 3, max_regs=128),
    FragmentConfig(32, 64, 128, 3, max_regs=128),
    DequantConfig(64, 256),
)
#: Prefill datapath (M > 128), bf16 activations.
PREFILL_CONFIGS: tuple = (
    FragmentConfig(128, 64),
    FragmentConfig(128, 128),
    FragmentConfig(256, 64, 128, 2),
    DequantConfig(64, 256),
    DequantConfig(64, 128),
    DequantConfig(128, 256, 8),
    DequantConfig(128, 128, 8),
)
#: Warp-specialized Gluon tiles (:class:`WSConfig`), added to the decode and mid candidates where
#: :func:`.gluon_ws.available` (CUDA sm_90 with Gluon); ``FOURSIGHT_WS=only`` makes them the only
#: candidates of every path (``prefill`` then takes its list: benchmarks time the form alone at M = 256),
#: ``FOURSIGHT_WS=0`` leaves them out. Shared memory per stage: block_m x 512 + block_n x 128 bytes.
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
