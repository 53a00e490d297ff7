"""FourSight Triton kernels (import name ``foursight.kernels``).

``prepare_weight``, ``splice_linear``, ``quantize_activation``, ``splice_gemm`` and ``resident_bytes``
(the bytes a prepared layer keeps on its device) are the API the rest of the product calls (see :mod:`foursight.kernels.api`). Layout of the package:

* :mod:`.primitives` — the shared ``@triton.jit`` NVFP4 decode/quantization primitives;
* one module per kernel form: :mod:`.act_quant`, :mod:`.gemv`, :mod:`.fragment` (the BF16 decode
  form on the weight's fragment layout), :mod:`.swap`, :mod:`.ss`, :mod:`.dequant` (each names its
  PyTorch reference);
* :mod:`.configs` — the named tile configurations and the candidate lists per datapath;
* :mod:`.tuning` — the timing/autotune harness; :mod:`.prepared` — the execution form of a layer;
* :mod:`.reference` — plain-PyTorch baselines; :mod:`.blackwell` — the backend choice by capability, with the
  Blackwell native-FP4 forms :mod:`.dot_scaled` and :mod:`.flashinfer_gemm` (docs/blackwell.md).

Importing this package needs Triton but no GPU: on CPU tensors the kernels run under
``TRITON_INTERPRET=1`` (the tests do this).
"""

from .api import (
    DECODE_MAX_M,
    TUNED,
    DequantConfig,
    FragmentConfig,
    GemvConfig,
    KernelConfig,
    PreparedWeight,
    SSConfig,
    SwapConfig,
    datapath_for,
    prepare_weight,
    quantize_activation,
    resident_bytes,
    splice_gemm,
    splice_linear,
)
from .blackwell import blackwell_fp4_available

__all__ = [
    "DECODE_MAX_M",
    "TUNED",
    "DequantConfig",
    "FragmentConfig",
    "GemvConfig",
    "KernelConfig",
    "PreparedWeight",
    "SSConfig",
    "SwapConfig",
    "blackwell_fp4_available",
    "datapath_for",
    "prepare_weight",
    "quantize_activation",
    "resident_bytes",
    "splice_gemm",
    "splice_linear",
]
