"""Rollout precisions: the one vocabulary of ``foursight compare --engines KIND:PRECISION``, ``foursight rl
--rollout-precision`` and the HF rollout engine (``trainer_bridge.backends.hf_rollout.HFRollout``).

* ``bf16`` — the model as trained;
* ``fp8`` — rowwise W8A8, the FlashRL anchor (:mod:`foursight.fp8`);
* ``nvfp4`` — plain NVFP4 W4A4 (k = 0);
* ``foursight`` — NVFP4 W4A4 with k BF16 channels per input (``--channels`` or ``--error-target``);
* ``w4a16`` — FourSight's 4-bit weights with k BF16 channels, BF16 activations.
"""

from __future__ import annotations

PRECISIONS = ("bf16", "fp8", "nvfp4", "foursight", "w4a16")
#: precisions whose layers carry a BF16 channel set chosen by calibration
CHANNEL_PRECISIONS = ("foursight", "w4a16")
#: precisions whose layers are FourSight NVFP4 layers (the weights 4-bit; k = 0 for nvfp4)
NVFP4_PRECISIONS = ("nvfp4", "foursight", "w4a16")
