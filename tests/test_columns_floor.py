"""benchmarks/kernels/columns_floor.py: the BF16 columns' byte floor against hand arithmetic."""

import importlib.util
from pathlib import Path

import pytest

_P = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "columns_floor.py"
_spec = importlib.util.spec_from_file_location("columns_floor", _P)
cf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cf)


def test_layer_floor_is_the_byte_ratio():
    rows = {r["linear"]: r for r in cf.layer_rows(128)}
    # 8192²: 2 bytes x 128 columns against 9/16 byte per value over 8192 values of a row
    assert rows["grid 8192²"]["floor"] == pytest.approx(2 * 128 / (8192 * 9 / 16))
    assert rows["grid 8192²"]["fp4_bytes"] == 8192 * 8192 * 9 // 16 and rows["grid 8192²"]["column_bytes"] == 8192 * 256
    assert rows["grid 8192²"]["target_reachable"] is False  # 5.6 % > 5 %
    assert rows["down"]["target_reachable"] is True and rows["qkv"]["target_applies"] is False  # K = 4096: no target
    assert {r["linear"]: r["floor"] for r in cf.layer_rows(32)}["grid 8192²"] == pytest.approx(rows["grid 8192²"]["floor"] / 4)


def test_step_floor_from_measured_bytes_and_times():
    dec = {"modes": {"foursight-w4a4": {"weight_bytes": 1_300_000_000, "decode": {"1": {"step_ms": 5.5}, "16": {"status": "skipped"}}},
                     "foursight-w4a4-k0": {"weight_bytes": 1_000_000_000, "decode": {"1": {"step_ms": 5.0}, "16": {"step_ms": 6.0}}}}}
    (r,) = cf.step_rows(dec, stream_tbps=3.0)  # batch 16 has no k = 128 time: left out
    assert r["batch"] == 1 and r["measured_overhead"] == pytest.approx(0.1)
    assert r["floor_ms"] == pytest.approx(0.3e9 / 3e12 * 1e3) and r["floor_overhead"] == pytest.approx(0.1 / 5.0)
    assert r["columns_effective_tbps"] == pytest.approx(0.3e9 / 0.5e-3 / 1e12)
    assert r["target_reachable_at_this_k0_step"] is True  # 2.0 % <= 2.3 %
