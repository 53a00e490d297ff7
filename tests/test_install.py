"""The core install: ``pip install .`` with no extras pulls no application dependencies, and vLLM
finds and loads the FourSight plugin from a plain (non-editable, no-extras) install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "requirements" / "cpu-constraints.txt"
#: what only the applications (bridge, compare, rl, TRL) need
APP_ONLY = {"fastapi", "uvicorn", "matplotlib", "trl", "prometheus-client", "httpx", "transformers", "accelerate", "gguf"}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


@pytest.mark.slow
def test_core_install_pulls_no_application_dependencies(tmp_path):
    """pip resolves ``pip install .`` in a fresh venv (``--dry-run``, the repo's pinned versions):
    the core set (torch, triton, safetensors, pydantic, typer, rich and theirs), none of APP_ONLY."""
    env_dir = tmp_path / "clean"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    report = tmp_path / "report.json"
    r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), "-c", str(CONSTRAINTS), str(REPO)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    names = {_norm(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert {"foursight", "torch", "safetensors", "pydantic"} <= names, names
    assert not names & APP_ONLY, sorted(names & APP_ONLY)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_loads_the_plugin_from_a_plain_install(tmp_path, tiny_llama_dir):
    """A wheel of the repo installed without extras (``--target``, ahead of the editable install
    on the path) is the ``foursight`` vLLM imports: its entry point registers the method and a
    FourSight checkpoint loads and generates through it."""
    pytest.importorskip("vllm")
    from foursight.checkpoint import quantize_model
    from foursight.quantize_config import QuantizeConfig

    ckpt = quantize_model(tiny_llama_dir, tmp_path / "ckpt", QuantizeConfig(channels="16"), progress=False).out_dir
    wheels, target, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # build from a copy of the tracked sources (no stale build/ folder can leak into the wheel)
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "LICENSE", "foursight_autoload.py", "foursight_engine", "kernels", "quant_methods", "trainer_bridge"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("foursight-*.whl")
    import zipfile

    with zipfile.ZipFile(wheel) as z:  # the SPDX license field and the license file travel in the wheel
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        lic = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert lic and z.read(lic[0]) == (REPO / "LICENSE").read_bytes()
    assert "License-Expression: Apache-2.0" in meta.splitlines(), meta[:1500]
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "--target", str(target),
                        str(wheel)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    script = textwrap.dedent(f"""
        import importlib.metadata as md, json, os
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import foursight
        (dist,) = [d for d in md.distributions() if d.metadata["Name"] == "foursight"][:1]
        eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "foursight"]
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(ckpt)!r}, enforce_eager=True, max_model_len=128, dtype="bfloat16", seed=0)
        from vllm.model_executor.layers.quantization import get_quantization_config
        cls = get_quantization_config("foursight")
        out = llm.generate([[1, 5, 9, 13]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        print("RESULT" + json.dumps({{"foursight": foursight.__file__, "dist": str(dist.locate_file("")), "eps": eps,
                                     "config": cls.__module__, "config_file": __import__(cls.__module__, fromlist=["x"]).__file__,
                                     "tokens": list(out[0].outputs[0].token_ids)}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    res = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT"):])
    assert res["foursight"].startswith(str(target)) and res["dist"].startswith(str(target)), res
    assert res["eps"] == ["foursight.quant_methods.vllm_plugin:register"]
    assert res["config"] == "foursight.quant_methods.vllm_method" and res["config_file"].startswith(str(target)), res
    assert len(res["tokens"]) == 4


def test_every_package_folder_is_shipped():
    """Every folder with an ``__init__.py`` under the four source folders is in pyproject's package list
    (an editable install imports an unlisted subpackage; the wheel leaves it out)."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
