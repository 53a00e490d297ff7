"""FourSight Triton kernels (import name ``foursight.kernels``).

This package imports none of its modules: import the module that holds what you use (importing
``foursight.kernels.act_quant`` then loads the quantizer and its primitives, not every kernel form).
The API the rest of the product calls is :mod:`foursight.kernels.api`: ``prepare_weight``,
``splice_linear``, ``quantize_activation``, ``splice_gemm``, ``resident_bytes`` (the bytes a prepared
layer keeps on its device), the configurations and ``TUNED``. Layout of the package (docs/kernels.md):

* :mod:`.primitives` — the shared ``@triton.jit`` NVFP4 decode/quantization primitives and the
  constants the forms share (e.g. ``DIV6_RECIP_ON_CUDA``);
* :mod:`.fragment_layout` — the weight's one resident execution form (layout, packer, in-kernel
  decode); :mod:`.prepared` — the execution form of a layer built on it; :mod:`.launch` — the
  weight-side launch arguments; :mod:`.split_k` — the split-K plan;
* one module per kernel form: :mod:`.act_quant`, :mod:`.fragment` (the BF16 decode GEMM),
  :mod:`.dequant`, :mod:`.gemv`, :mod:`.swap`, :mod:`.ss` (each names its PyTorch reference);
* :mod:`.configs` — the named tile configurations and the candidate lists per datapath;
  :mod:`.tuning` — the timing/autotune harness;
* :mod:`.forms` — the kernel forms as one table (its rows are :data:`.api.FORMS`) and the dispatch that
  reads it; :mod:`.activation` — the quantizer's entry point; :mod:`.tile_steps` — the tile steps the GEMM
  forms share;
* :mod:`.reference` — plain-PyTorch baselines; :mod:`.backends` — the backend choice by capability;
  :mod:`.experimental` — the experimental forms and backends, off the default path: the Gluon forms
  (:mod:`.experimental.gluon_ws`, :mod:`.experimental.gluon_stream`, their twin
  :mod:`.experimental.gluon_ws_twin`), :mod:`.experimental.dot_scaled` and
  :mod:`.experimental.flashinfer_gemm` (docs/blackwell.md).

The modules need Triton but no GPU: on CPU tensors the kernels run under ``TRITON_INTERPRET=1``
(the tests do this).
"""
