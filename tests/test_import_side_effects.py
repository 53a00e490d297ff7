"""Issue 27 item 6: registration side effects are what the entry points need, no more.

``import foursight`` (core) and importing the vLLM adapter's modules wrap no vLLM method; only the
plugin entry point vLLM calls (``vllm_plugin.register``) wraps its checkpoint loader, once
(:mod:`foursight.quant_methods.engine_hooks`). ``import foursight`` adds at most one ``sys.meta_path``
finder, FourSight's (the transformers quantizer's registration, :mod:`foursight_autoload`), and
none where transformers is not installed. The SGLang side: tests/sglang/test_plugin_side_effects.py.
Each check runs in a fresh interpreter (this one has imported and registered everything).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _run(code: str, **env) -> str:
    import os

    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_importing_foursight_wraps_no_vllm_loader_and_register_wraps_it_once():
    pytest.importorskip("vllm")
    out = _run("""
        import foursight, foursight.hf, foursight.checkpoint, foursight.quant_methods.config
        import foursight.quant_methods.vllm_method, foursight.quant_methods.vllm_weight_sync
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader as D
        from foursight.quant_methods.engine_hooks import is_wrapped
        before = is_wrapped(D, "get_all_weights")
        from foursight.quant_methods.vllm_plugin import register
        register(); once = D.get_all_weights
        register()
        print(before, is_wrapped(D, "get_all_weights"), D.get_all_weights is once)
    """)
    assert out == "False True True", out


def test_importing_foursight_adds_one_finder_and_none_without_transformers(tmp_path):
    code = """
        import sys
        n = len(sys.meta_path)
        import foursight
        added = sys.meta_path[: len(sys.meta_path) - n]
        print(len(added), all(getattr(f, "foursight", False) for f in added))
    """
    assert _run(code) == "1 True"
    # an interpreter where transformers cannot be found: no finder at all
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.machinery
        _orig = importlib.machinery.PathFinder.find_spec
        def find_spec(name, path=None, target=None):
            return None if name.split(".")[0] == "transformers" else _orig(name, path, target)
        importlib.machinery.PathFinder.find_spec = staticmethod(find_spec)
    """))
    import os

    assert _run(code, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")) == "0 True"
