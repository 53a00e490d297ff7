"""The autotuner's disk cache (kernels/tuning.py ``DiskCache``): a choice written by one process is read by the
next, only while it is still a candidate; on the GPU a second tuning of the same key times nothing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from foursight.kernels import tuning


@dataclass(frozen=True)
class _Cfg:
    block_n: int
    warps: int


def test_a_choice_round_trips_through_the_file(tmp_path):
    path = tmp_path / "card.json"
    key = ("linear", 8192, 8192, 16, True)
    cands = [_Cfg(64, 4), _Cfg(128, 4), _Cfg(128, 8)]
    tuning.DiskCache(path).put(key, cands[2])
    again = tuning.DiskCache(path)  # another process
    assert again.get(key, cands) == cands[2]
    assert again.get(key, cands[:2]) is None  # no longer offered: tuned again
    assert again.get(("linear", 1, 1, 1, True), cands) is None


def test_an_unreadable_file_is_an_empty_cache(tmp_path):
    path = tmp_path / "card.json"
    path.write_text("{not json")
    c = tuning.DiskCache(path)
    assert c.table == {} and c.get(("k",), [_Cfg(1, 1)]) is None
    c.put(("k",), _Cfg(1, 1))
    assert tuning.DiskCache(path).get(("k",), [_Cfg(1, 1)]) == _Cfg(1, 1)


def test_the_suite_times_afresh():
    import os

    assert os.environ.get("FOURSIGHT_TUNE_CACHE") == "0" and tuning.DiskCache.for_this_device() is None


@pytest.mark.gpu
def test_a_second_process_reads_the_choice_instead_of_timing(tmp_path, monkeypatch):
    """pick_config with the cache on: the first call times and writes; with the in-process cache emptied (a new
    process), the same key comes back from disk and no candidate is timed."""
    monkeypatch.setenv("FOURSIGHT_TUNE_CACHE", str(tmp_path))
    key = ("tune-cache-test", 1)
    x = torch.randn(256, 256, device="cuda")
    cands = [_Cfg(64, 4), _Cfg(128, 4)]
    first = tuning.pick_config(key, lambda cfg: x @ x, cands, cands[0])
    tuning.TUNED.pop(key)
    monkeypatch.setattr(tuning, "time_gpu", lambda fn, **kw: (_ for _ in ()).throw(AssertionError("timed again")))
    tuning.DiskCache._files.clear()
    assert tuning.pick_config(key, lambda cfg: x @ x, cands, cands[0]) == first
    tuning.TUNED.pop(key)
