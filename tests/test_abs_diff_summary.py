"""The one |Δlogp| summary (:func:`foursight.trainer_bridge.metrics.abs_diff_summary`) against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foursight.trainer_bridge.metrics import TIMError, abs_diff_summary


def test_summary_matches_numpy_over_ragged_sequences():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(n, generator=g, dtype=torch.float64) for n in (5, 0, 17, 3)]
    b = [x + torch.randn(x.shape, generator=g, dtype=torch.float64) * 0.1 for x in a]
    d = np.concatenate([np.abs(x.numpy() - y.numpy()) for x, y in zip(a, b)])
    s = abs_diff_summary(a, [y.tolist() for y in b])  # lists of floats are taken as well as tensors
    assert s["tokens"] == d.size == 25
    assert s["mean"] == pytest.approx(d.mean(), rel=1e-12) and s["max"] == pytest.approx(d.max(), rel=1e-12)
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(d, q), rel=1e-12)
    assert abs_diff_summary([], []) == {"mean": 0.0, "max": 0.0, "tokens": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_unpaired_sequences_are_refused_naming_the_sequence():
    with pytest.raises(TIMError, match="sequence 1 has 2 tokens against 3"):
        abs_diff_summary([torch.zeros(1), torch.zeros(2)], [torch.zeros(1), torch.zeros(3)])
    with pytest.raises(TIMError, match="2 sequences against 1"):
        abs_diff_summary([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])
