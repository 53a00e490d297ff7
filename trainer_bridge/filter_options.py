"""The TIM filter's options as the command lines take them, without torch: the policy names and the
default tail threshold. ``foursight rl`` and ``foursight compare`` build their flags from these, so
``foursight --help`` answers without importing torch; :mod:`.filters` and :mod:`.metrics`, which
compute with torch, take them from here."""

from __future__ import annotations

import math
from typing import Literal

#: the sequence-filter policies (:class:`foursight.trainer_bridge.filters.FilterConfig`)
Policy = Literal["none", "max_token", "mean_abs", "tail_count", "geo_mean", "quantile"]

#: Default tail threshold τ on |r|: ln 3, i.e. a token whose ratio leaves [1/3, 3]
#: (TRL's default ``vllm_importance_sampling_clip_max`` is 3.0).
DEFAULT_TAIL_THRESHOLD = math.log(3.0)
