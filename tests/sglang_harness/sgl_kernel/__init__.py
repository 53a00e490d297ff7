"""TEST HARNESS ONLY: a pure-torch stand-in for SGLang's CPU kernel package ``sgl_kernel``.

Why it exists: SGLang 0.5.23 on a CPU device imports ``assign_req_to_token_pool_cpu`` from
``sgl_kernel`` at module level (``sglang/srt/mem_cache/allocation.py``). The CPU build of
sgl-kernel is not published on PyPI and the CUDA ``sglang-kernel`` wheel cannot be imported
without libcuda, so the FourSight SGLang tests (tests/sglang) install this package into their
own venv (scripts/setup_sglang.sh). It is not part of FourSight and is never installed by
``pip install foursight``; on a real deployment SGLang's own sgl-kernel is used.

Only that one function is implemented. A few more names are imported at module level by SGLang's
CPU path (KV-cache page moves, speculative decoding); they are defined here only so that those
modules import, and raise NotImplementedError if ever called (the FourSight tests use neither
feature). Every other name is absent, so ``from sgl_kernel import X`` raises ImportError exactly
as if the package lacked it and SGLang's own fallbacks apply.
"""

from __future__ import annotations

import torch

#: Names SGLang 0.5.23 imports at module level on CPU that the tests never call.
_UNIMPLEMENTED = (
    "copy_all_layer_kv_cache_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)


def _unimplemented(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by FourSight's test-harness stand-in "
            "(tests/sglang_harness); install SGLang's real CPU sgl-kernel for this feature"
        )

    fn.__name__ = name
    return fn


for _name in _UNIMPLEMENTED:
    globals()[_name] = _unimplemented(_name)
del _name

__all__ = ["assign_req_to_token_pool_cpu", *_UNIMPLEMENTED]
__version__ = "0.0.1+foursight-test-harness"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Same contract as SGLang's Triton ``assign_req_to_token_pool`` kernel: for request ``i``
    (row ``req_pool_indices[i]``), positions ``start_offset[i]:end_offset[i]`` of
    ``req_to_token`` receive the next ``end_offset[i] - start_offset[i]`` entries of the flat
    ``out_cache_loc``, requests laid out one after another.

    Args:
        req_pool_indices: int [B], row of each request in ``req_to_token``.
        req_to_token: int32 [R, pool_len], modified in place.
        start_offset, end_offset: int [B], token range written for each request.
        out_cache_loc: int [sum(end - start)], the allocated KV slots.
        pool_len: ``req_to_token.shape[1]`` (kept for signature parity; checked).
    """
    if pool_len != req_to_token.shape[1]:
        raise ValueError(f"pool_len {pool_len} != req_to_token.shape[1] {req_to_token.shape[1]}")
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n
