"""Kernel tests under the Triton interpreter on CPU (tests/test_kernels.py, test_kernels_actq.py,
test_blackwell_kernels.py; scripts/test.sh runs them in their own process).

Import this module before ``foursight.kernels``: the ``@triton.jit`` decorators choose the interpreter
at import, and Triton keeps reading ``TRITON_INTERPRET`` while interpreting, so it is set for the rest
of this (CPU-only) process. On a CUDA machine it is left alone: the GPU tests then use compiled
kernels and the interpreter tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def kernels_interpreted() -> bool:
    """Whether ``foursight.kernels`` was built for the interpreter (not on a CUDA machine, nor
    imported in compiled mode by an earlier test module of this process)."""
    from foursight.kernels.runtime import interpreting

    return interpreting()


#: the ``pytestmark`` of an interpreter test module
interpreted_only = pytest.mark.skipif(
    not kernels_interpreted(),
    reason="kernels not built for the Triton interpreter (CUDA machine, or imported earlier); run this file on its own on CPU",
)
