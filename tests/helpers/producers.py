"""The oracle check of the fused producers' tests (``tests/test_producers.py``, ``tests/test_producers_gpu.py``):
a ``ProducedInput``'s quantized operands against :func:`foursight.layer.quantize_activation` of the producer's
own bf16 row, bit for bit."""

from __future__ import annotations

import torch

from foursight.layer import quantize_activation
from foursight.nvfp4 import dequantize_nvfp4


def assert_quantized_like_oracle(p, y: torch.Tensor, channels: torch.Tensor, gs_static=None) -> None:
    """``p.deq`` = the oracle's ``q · s`` (its codes and E4M3 block scales, global scale 1: exact in fp32),
    ``p.gs`` its global scales, ``p.xs`` the bf16 row at ``channels``."""
    qa = quantize_activation(y, channels, gs_static)
    one = torch.ones((), device=y.device)
    assert torch.equal(p.deq.float(), dequantize_nvfp4(qa.packed, qa.scale, one)), "q·s differs from the oracle's"
    assert torch.equal(p.gs, qa.global_scale), "global scale differs from the oracle's"
    assert torch.equal(p.xs, qa.x_bf16), "X[:, S] differs from the bf16 row at the channels"
