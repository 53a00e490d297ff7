"""The offline SASS tools compile a Gluon kernel (``benchmarks/kernels/sass.py``'s ``compile_kernel`` builds
a ``GluonASTSource`` for a ``@gluon.jit`` function): the register-streaming form (``kernels/experimental/gluon_stream.py``)
for sm_90a at its decode launch, as ``sass_offline.py --stream`` does. Runs where Triton's Gluon imports (no
GPU needed: Triton ships ptxas and cuobjdump); skips cleanly elsewhere.

The compile runs in a subprocess with ``sass_offline.apply_gluon_renames`` (Gluon names later Tritons renamed,
applied in that process only, with its own Triton cache), so it checks the compile path on both the device's
Triton 3.6 and the local 3.9, where the shipped kernel's ``async_copy_global_to_shared`` is gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.scripts import REPO

# compiles the StreamConfig tiles given (a Python expression, argv[2]) in a subprocess; prints their rows
_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sass_offline
renames = sass_offline.apply_gluon_renames()
from foursight.kernels import configs
from foursight.kernels.configs import StreamConfig
rows = []
for cfg in eval(sys.argv[2]):
    row = sass_offline.measure(*sass_offline.stream_case(cfg, sass_offline.stream_decode_m(cfg)))
    rows.append({"config": str(cfg), **row})
print("ROWS " + json.dumps(rows))
"""


def _stream_rows(tiles: str) -> list[dict]:
    """The offline sm_90a figures of the tiles ``tiles`` names (skips where Gluon does not import)."""
    pytest.importorskip("triton.experimental.gluon")
    from foursight.kernels.experimental import gluon_stream

    if gluon_stream.gluon is None:
        pytest.skip(f"Gluon is not importable here: {gluon_stream.GLUON_IMPORT_ERROR}")
    r = subprocess.run([sys.executable, "-c", _PROBE, str(REPO / "benchmarks" / "kernels"), tiles], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
    return json.loads(line[len("ROWS "):])


def test_sass_offline_compiles_the_stream_kernel_for_sm90a():
    """Its main loop (the loop that issues HGMMA) streams the weight from global memory (LDG) with no
    shared-memory hop or barrier (no LDS, STS, BAR), issues one bf16 wgmma per 256-column step (256/16 = 16
    HGMMA of K 16), does not spill, and waits for each step's wgmma before the next (no
    ``WARPGROUP.DEPBAR.LE gsb0, 0x1``: an MMA left in flight raced on the H100)."""
    rows = _stream_rows("configs.STREAM_CONFIGS[:2]")
    for row in rows:
        ops = row["main_loop_ops"]
        assert ops["LDG"] > 0 and ops["LDS"] == ops["STS"] == ops["BAR"] == 0, row
        assert ops["HGMMA"] == 256 // 16, row
        assert row["spill_instructions"] == 0 and row["local_bytes"] == 0, row
        assert not row["async_mma_wait"], row
        assert row["per_weight"] == round(row["loop_instructions"] / 128, 2), row  # 64 rows x 256 columns / 128 threads
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0, row


def test_sass_offline_compiles_two_warpgroups_and_the_asynchronous_mma():
    """Issue 36 item 3 in full, offline for sm_90a. Two consumer warpgroups (8 warps, 128 rows a program): the
    words' load layout (``gluon_stream.words_layout``, a linear layout) reaches the wgmma register operand with
    no data movement (``convert_layout(..., assert_trivial=True)`` compiles), and the loop still streams the
    words with no shared-memory hop (no LDS/STS). One wgmma in flight (the steps unrolled): each 256-column step
    issues its 16 HGMMA and the wait leaves one group outstanding (``WARPGROUP.DEPBAR.LE gsb0, 0x1``). (The
    local Triton 3.9 puts one BAR a step in the two-warpgroup loop, the device's 3.6 none:
    benchmarks/results/sass_stream_v2/.)"""
    two_wg, async_mma = _stream_rows("(StreamConfig(8, 2, block_n=128, num_warps=8), StreamConfig(16, 2, mma_async=True))")
    assert two_wg["main_loop_ops"]["LDG"] > 0 and two_wg["main_loop_ops"]["LDS"] == two_wg["main_loop_ops"]["STS"] == 0, two_wg
    assert two_wg["main_loop_ops"]["HGMMA"] == 256 // 16 and not two_wg["async_mma_wait"], two_wg
    assert two_wg["per_weight"] == round(two_wg["loop_instructions"] / 128, 2), two_wg  # 128 rows x 256 / 256 threads
    assert async_mma["unrolled"] and async_mma["async_mma_wait"], async_mma
    assert async_mma["main_loop_ops"]["HGMMA"] == 256 // 16 and async_mma["main_loop_ops"]["LDS"] == 0, async_mma
    assert async_mma["spill_instructions"] == 0, async_mma
