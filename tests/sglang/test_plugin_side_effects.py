"""Issue 27 item 6 on SGLang: importing FourSight's SGLang modules wraps no SGLang method; the plugin
entry point SGLang calls (``sglang_plugin.register``) wraps its two loader methods and its three
weight-update entry points, each once (:mod:`foursight.quant_methods.engine_hooks`). In a fresh
interpreter (this one has registered everything)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.sglang]


def test_importing_the_sglang_plugin_wraps_nothing_and_register_wraps_once():
    code = textwrap.dedent("""
        import foursight, foursight.quant_methods.sglang_plugin as plugin, foursight.quant_methods.sglang_method
        from sglang.srt.model_loader.loader import DefaultModelLoader as L
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater as W
        from foursight.quant_methods.engine_hooks import is_wrapped
        names = [(L, "_get_weights_iterator"), (L, "_get_all_weights"), (W, "update_weights_from_disk"),
                 (W, "update_weights_from_tensor"), (W, "load_weights_from_distributed")]
        before = [is_wrapped(c, n) for c, n in names]
        plugin.register(); once = [getattr(c, n) for c, n in names]
        plugin.register()
        print(sum(before), sum(is_wrapped(c, n) for c, n in names), all(getattr(c, n) is f for (c, n), f in zip(names, once)))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "0 5 True", r.stdout
