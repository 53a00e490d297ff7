"""The table of kernel forms (``kernels/api.py`` ``FORMS``, read by ``kernels/forms.py``) and its switches.

The switches (``FOURSIGHT_WS``, ``FOURSIGHT_STREAM``, ``FOURSIGHT_PDL``) are read once, not per call: a
changed variable takes effect at the next :func:`foursight.kernels.forms.configure`. Which form each
configuration and switch setting runs is pinned against the old dispatch in ``tests/test_kernels_forms.py``.
No kernel runs here.
"""

from __future__ import annotations

import os
import typing

import pytest
import torch

from foursight.kernels import api, configs, forms
from helpers.kernel_switches import kernel_switches


def test_every_configuration_class_has_one_row_named_by_its_form():
    classes = typing.get_args(configs.KernelConfig)
    assert {f.config for f in api.FORMS} == set(classes) and len(api.FORMS) == len(classes)
    for cls in classes:
        row = forms.form_of(cls.__new__(cls))
        assert row.config is cls and row.name == cls.form and forms.FORMS[row.name] is row
    assert [f.name for f in forms.EXPERIMENTAL] == [f.name for f in api.FORMS if f.switch is not None]
    with pytest.raises(ValueError, match="unknown configuration"):
        forms.form_of(object())
    with pytest.raises(ValueError, match="FragmentConfig already has the form 'fragment'"):
        forms.register(forms.FORMS["fragment"])


def test_can_implement_says_why_not():
    frag, swap = forms.FORMS["fragment"], forms.FORMS["swap"]
    assert frag.can_implement(torch.bfloat16) == (True, None)
    ok, why = frag.can_implement(torch.float16)
    assert not ok and why == "the fragment form takes bf16 activations, got torch.float16"
    assert not frag.can_implement(torch.bfloat16, torch.float16)[0]  # the fp16 q*s of splice_gemm
    assert swap.can_implement(torch.float16) == (True, None) and swap.can_implement(torch.bfloat16) == (True, None)
    for f in forms.EXPERIMENTAL:  # their support rule by capability: sm_90 with Gluon only
        assert f.rule(None) and f.rule((10, 0)) and "sm_90" in f.rule((8, 0))


def test_switches_are_read_once_until_configure():
    with kernel_switches(FOURSIGHT_WS=None, FOURSIGHT_STREAM=None, FOURSIGHT_PDL=None) as read:
        assert read.forms == {"gluon_stream": ("off", False), "gluon_ws": ("off", False)} and read.pdl is False
        default = api.candidates("mid", 64, "linear")
        assert default == list(configs.MID_CONFIGS)
        os.environ["FOURSIGHT_WS"] = "only"  # not read yet: the calls keep the switches they started with
        assert api.candidates("mid", 64, "linear") == default and forms.switches() is read
        now = forms.configure()
        assert now.forms["gluon_ws"][0] == "only"
        # no Gluon here (CPU): "only" leaves no candidate, as the old dispatch did
        assert api.candidates("mid", 64, "linear") == [] and api.candidates("decode", 1, "w4a16") == []
        assert api.candidates("mid", 64, "linear", bf16=False) == list(configs.FP16_CONFIGS["mid"])  # fp16: not switched
    assert api.candidates("mid", 64, "linear") == default  # restored and read again on leaving


@pytest.mark.parametrize("env,mode", [({"FOURSIGHT_STREAM": "1"}, "on"), ({"FOURSIGHT_STREAM": "yes"}, "on"),
                                      ({"FOURSIGHT_STREAM": "only"}, "only"), ({"FOURSIGHT_STREAM": "0"}, "off"),
                                      ({"FOURSIGHT_WS": "yes"}, "off"), ({"FOURSIGHT_WS": "1"}, "on")])
def test_switch_values(env, mode):
    """``FOURSIGHT_STREAM``: any value but 0 switches it on (as before the table); ``FOURSIGHT_WS``: 1 or only."""
    with kernel_switches(**env) as read:
        name = "gluon_stream" if "FOURSIGHT_STREAM" in env else "gluon_ws"
        assert read.forms[name][0] == mode
