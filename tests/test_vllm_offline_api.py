"""docs/vllm.md's offline ``LLM(...)`` script, run exactly as printed on the CPU build.

The block between ``<!-- offline-llm-begin -->`` and ``<!-- offline-llm-end -->`` is written to
``run.py`` next to a ``ckpt`` folder (a FourSight checkpoint of the tiny Llama) and run with
``python run.py`` in a clean environment (none of the test suite's ``VLLM_*`` /
``TORCHDYNAMO_DISABLE`` settings): it must exit 0 and print generated text. The plain
``LLM(model="ckpt", quantization="foursight")`` does not start on this build (issue 24, item 7).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


def printed_block() -> str:
    m = re.search(r"<!-- offline-llm-begin -->\s*```python\n(.*?)```\s*<!-- offline-llm-end -->", DOC.read_text(), re.S)
    assert m, "docs/vllm.md lost its offline-llm block"
    return m.group(1)


def test_offline_llm_script_runs_as_printed(tiny_llama_dir, tmp_path):
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    quantize_model(tiny_llama_dir, tmp_path / "ckpt", QuantizeConfig(channels="16"), progress=False)
    (tmp_path / "run.py").write_text(printed_block())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "TORCHDYNAMO", "FOURSIGHT_"))}
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")  # keep the user's cache clean (not a setting the script needs)
    r = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip(), r.stderr[-2000:]
