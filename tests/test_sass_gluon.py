"""The offline SASS tools compile a Gluon kernel (``benchmarks/kernels/sass.py``'s ``compile_kernel`` builds
a ``GluonASTSource`` for a ``@gluon.jit`` function): the register-streaming form (``kernels/gluon_stream.py``)
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

_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sass_offline
renames = sass_offline.apply_gluon_renames()
from foursight.kernels import configs
rows = []
for cfg in configs.STREAM_CONFIGS[:2]:
    row = sass_offline.measure(*sass_offline.stream_case(cfg, sass_offline.stream_decode_m(cfg)))
    rows.append({"config": str(cfg), **row})
print("ROWS " + json.dumps(rows))
"""


def test_sass_offline_compiles_the_stream_kernel_for_sm90a():
    """Its main loop (the loop that issues HGMMA) streams the weight from global memory (LDG) with no
    shared-memory hop or barrier (no LDS, STS, BAR), issues one bf16 wgmma per 256-column step (256/16 = 16
    HGMMA of K 16), does not spill, and waits for each step's wgmma before the next (no
    ``WARPGROUP.DEPBAR.LE gsb0, 0x1``: an MMA left in flight raced on the H100)."""
    pytest.importorskip("triton.experimental.gluon")
    from foursight.kernels import gluon_stream

    if gluon_stream.gluon is None:
        pytest.skip(f"Gluon is not importable here: {gluon_stream.GLUON_IMPORT_ERROR}")
    r = subprocess.run([sys.executable, "-c", _PROBE, str(REPO / "benchmarks" / "kernels")], capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    line = next((x for x in r.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
    rows = json.loads(line[len("ROWS "):])
    for row in rows:
        ops = row["main_loop_ops"]
        assert ops["LDG"] > 0 and ops["LDS"] == ops["STS"] == ops["BAR"] == 0, row
        assert ops["HGMMA"] == 256 // 16, row
        assert row["spill_instructions"] == 0 and row["local_bytes"] == 0, row
        assert not row["async_mma_wait"], row
        assert row["per_weight"] == round(row["loop_instructions"] / 128, 2), row  # 64 rows x 256 columns / 128 threads
        assert 0 < row["registers"] <= 255 and row["shared_bytes"] > 0, row
