"""Blackwell (sm_100) native-FP4 path: capability gate only (see docs/kernels.md, "Blackwell plan").

On sm_100 the FP4 part of SpliceGEMM should run on the FP4 tensor cores (FlashInfer ``mm_fp4`` or
a CUTLASS block-scaled GEMM) with the BF16 channel segment added by a small BF16 GEMM into the
same output (or spliced as an epilogue). That path is not implemented in this repository and
has never run here (the device machines are Hopper H200s). ``blackwell_fp4_available`` is the
single gate the dispatcher would consult; it is False on every Hopper GPU, on CPU, and until an
implementation is registered.
"""

from __future__ import annotations

import torch

#: Set by a future sm_100 implementation; nothing registers one today.
_IMPL = None


def blackwell_fp4_available(device: torch.device | int | None = None) -> bool:
    """True only on a compute-capability-10.x GPU *and* with an sm_100 implementation registered."""
    if _IMPL is None or not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 10
