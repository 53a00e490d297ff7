"""The kernels' environment switches (``FOURSIGHT_WS``, ``FOURSIGHT_STREAM``, ``FOURSIGHT_PDL``) set for a block.

The kernels read them once (:func:`foursight.kernels.forms.configure`), not per call: setting a variable in a
running process changes nothing until the next ``configure()``. :func:`kernel_switches` sets them, reads
them, and on leaving restores the environment and reads it again, so no later test sees the block's switches.
"""

from __future__ import annotations

import contextlib
import os

from foursight.kernels import forms


@contextlib.contextmanager
def kernel_switches(**env: str | None):
    """``with kernel_switches(FOURSIGHT_WS="1"):`` (a value of None unsets the variable)."""
    old = {k: os.environ.get(k) for k in env}
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield forms.configure()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forms.configure()


def kernel_switches_for_test(request, **env: str | None):
    """:func:`kernel_switches` from here to the end of the test of ``request`` (pytest's fixture)."""
    block = kernel_switches(**env)
    state = block.__enter__()
    request.addfinalizer(lambda: block.__exit__(None, None, None))
    return state
