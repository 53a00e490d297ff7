"""The experimental kernels of ``foursight.kernels``, off the default path (issue 39 item 4, issue 54 item 2).

Nothing of the default path imports them: they are loaded by name only when asked for, the Gluon forms
(:mod:`.gluon_ws`, :mod:`.gluon_stream`, their plain-Triton twin :mod:`.gluon_ws_twin`) by the kernel-form
table (:mod:`foursight.kernels.forms`, switched on by ``FOURSIGHT_WS`` / ``FOURSIGHT_STREAM``), the
Blackwell native-FP4 backends (:mod:`.dot_scaled`, :mod:`.flashinfer_gemm`) by the backend registry
(:mod:`foursight.kernels.backends`, ``FOURSIGHT_KERNEL_BACKEND``). Each has measured slower than the
default forms or has not yet run on its GPU (docs/kernels.md, docs/blackwell.md). This package imports
none of them.
"""
