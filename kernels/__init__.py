"""FourSight Triton kernels (import name ``foursight.kernels``).

``prepare_weight``, ``splice_linear``, ``quantize_activation`` and ``splice_gemm`` are the API the
rest of the product calls (see :mod:`foursight.kernels.api`). Importing this package needs Triton
but no GPU: on CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (the tests do this).
The Blackwell (sm_100) plan lives in :mod:`foursight.kernels.blackwell` and is never taken on Hopper.
"""

from .api import (
    DECODE_MAX_M,
    TUNED,
    PreparedWeight,
    datapath_for,
    prepare_weight,
    quantize_activation,
    splice_gemm,
    splice_linear,
)
from .blackwell import blackwell_fp4_available

__all__ = [
    "DECODE_MAX_M",
    "TUNED",
    "PreparedWeight",
    "blackwell_fp4_available",
    "datapath_for",
    "prepare_weight",
    "quantize_activation",
    "splice_gemm",
    "splice_linear",
]
