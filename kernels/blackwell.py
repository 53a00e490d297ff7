"""Which linear backend a CUDA device gets: the Blackwell (sm_100 / sm_120) native-FP4 backends are opt-in.

Two native-FP4 backends exist (docs/blackwell.md):

* ``flashinfer`` — FlashInfer's ``mm_nvfp4_svdquant`` (:mod:`.flashinfer_gemm`; static per-layer
  activation scales, bf16);
* ``dot_scaled`` — the Triton ``tl.dot_scaled`` form (:mod:`.dot_scaled`; any activation scale).

Neither has run on a Blackwell GPU (none is lent to this project), so :func:`choose_backend` never
picks one by itself: on every GPU the default stays the Triton SpliceGEMM path verified on the H200
(``triton``), and on sm_100/sm_120 the reason it gives says how to opt in. The choice is made with
the environment variable :data:`BACKEND_ENV` (``foursight serve --kernel-backend`` sets it for the
vLLM server it starts): ``auto`` (default), ``triton``, ``reference``, ``dot_scaled``,
``flashinfer``. A native backend asked for on a GPU that cannot run it is an error naming the GPU
and what it needs; on CPU tensors every choice runs the PyTorch reference.

The rule is the one backend registry's (:mod:`.backends`: every backend answers ``is_supported(capability)``
itself); this module keeps the device lookups. When a Blackwell run has verified a backend, it goes into
:data:`.backends.VERIFIED_NATIVE` and ``auto`` picks it there.
"""

from __future__ import annotations

import torch

# the rule lives in the one backend registry (:mod:`.backends`); these names stay importable from here
# (foursight_engine/cli.py and dispatch.py import them from this module)
from .backends import (  # noqa: F401
    BACKEND_ENV,
    CHOICES,
    FP4_MAJORS,
    NATIVE,
    VERIFIED_NATIVE,
    BackendUnavailable,
    choose_backend,
    flashinfer_svdquant_available,
    native_fp4,
    requested_backend,
    sm,
)


def device_capability(device: torch.device | int | None = None) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def blackwell_fp4_available(device: torch.device | int | None = None) -> bool:
    """True on a GPU whose native FP4 backends exist here (sm_100/sm_103/sm_120/sm_121); False on
    Hopper and CPU. Whether they run is :func:`~.backends.choose_backend`'s opt-in rule."""
    return native_fp4(device_capability(device))
